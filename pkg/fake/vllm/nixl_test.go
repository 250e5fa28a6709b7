package vllm_test

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/smg-project/smg-extproc/pkg/fake/vllm"
)

var nixlPrefillKV = map[string]any{
	"do_remote_decode": true, "do_remote_prefill": false,
	"remote_engine_id": nil, "remote_block_ids": nil, "remote_host": nil, "remote_port": nil,
}

// A correct sequential NIXL dispatch: the prefill answers one token and a
// handoff, the decode gets the client body plus the handoff verbatim, loads
// it (X-Fake-KV: transferred) and answers exactly what a non-PD fake does.
func TestNixlSequentialDispatch(t *testing.T) {
	t.Parallel()
	p, d := pair(t, vllm.Nixl)
	plain := start(t, vllm.Config{})
	cases := []struct {
		name, path string
		body       map[string]any
		stream     bool
	}{
		{"chat", "/v1/chat/completions", chatBody, false},
		{"chat stream with usage", "/v1/chat/completions", with(chatBody, "stream", true, "stream_options", map[string]any{"include_usage": true}), true},
		{"chat max_completion_tokens", "/v1/chat/completions", with(chatBody, "max_completion_tokens", 5), false},
		{"completions", "/v1/completions", completionBody, false},
		{"completions stream", "/v1/completions", with(completionBody, "stream", true), true},
		{"messages", "/v1/messages", messagesBody, false},
		{"messages stream", "/v1/messages", with(messagesBody, "stream", true), true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			rid := "req-" + strings.ReplaceAll(tc.name, " ", "-")
			pr := post(t.Context(), p.URL()+tc.path, prefillLeg(tc.path, tc.body, nixlPrefillKV), "X-Request-Id", rid)
			require.NoError(t, pr.err)
			require.Equal(t, http.StatusOK, pr.status, string(pr.body))
			assert.Equal(t, "issued", pr.header.Get(vllm.HeaderFakeHandoff))
			assert.Empty(t, pr.header.Get(vllm.HeaderFakeKV))
			handoff := pr.kv(t)
			require.NotNil(t, handoff)
			assert.Equal(t, true, handoff["do_remote_prefill"])
			assert.Equal(t, false, handoff["do_remote_decode"])
			assert.Equal(t, p.EngineID(0), handoff["remote_engine_id"])
			assert.Equal(t, "127.0.0.1", handoff["remote_host"])
			assert.EqualValues(t, p.SideChannelPorts()[0], handoff["remote_port"])
			assert.EqualValues(t, 1, handoff["tp_size"])
			blocks := handoff["remote_block_ids"].([]any)
			require.Len(t, blocks, 1, "one list per KV-cache group")
			assert.NotEmpty(t, blocks[0])
			reqID := handoff["remote_request_id"].(string)
			assert.Regexp(t, `^(chatcmpl|cmpl|msg)_?-?`+rid, reqID)
			assert.NotEqual(t, rid, reqID, "the internal id carries a random suffix")
			assert.Len(t, strings.Fields(outputText(t, tc.path, false, pr)), 1, "the prefill answers one token")
			held := false
			for _, h := range p.State().Held {
				held = held || h.Key == reqID
			}
			assert.True(t, held, "the prefill holds the blocks until the decode reads them")

			dr := post(t.Context(), d.URL()+tc.path, with(tc.body, "kv_transfer_params", handoff), "X-Request-Id", rid)
			require.NoError(t, dr.err)
			require.Equal(t, http.StatusOK, dr.status, string(dr.body))
			assert.Equal(t, "transferred", dr.header.Get(vllm.HeaderFakeKV))
			nr := post(t.Context(), plain.URL()+tc.path, tc.body)
			assert.Equal(t, "none", nr.header.Get(vllm.HeaderFakeKV))
			want := outputText(t, tc.path, tc.stream, nr)
			got := outputText(t, tc.path, tc.stream, dr)
			assert.Equal(t, want, got, "PD output must equal non-PD output")
			assert.True(t, strings.HasPrefix(got, outputText(t, tc.path, false, pr)), "the decode's first token is the prefill's")
			if !tc.stream {
				assert.Nil(t, dr.kv(t), "the decode returns no handoff")
			}
		})
	}
	// Runs after the parallel subtests, before the servers close.
	t.Cleanup(func() { assert.Empty(t, p.State().Held, "every handoff was consumed once") })
}

// nixlHandoff runs a prefill leg and returns the handoff.
func nixlHandoff(t *testing.T, p *vllm.Server, body map[string]any) map[string]any {
	t.Helper()
	pr := post(t.Context(), p.URL()+"/v1/chat/completions", prefillLeg("/v1/chat/completions", body, nixlPrefillKV))
	require.Equal(t, http.StatusOK, pr.status, string(pr.body))
	h := pr.kv(t)
	require.NotNil(t, h)
	return h
}

// Every way a gateway can mangle or reuse a NIXL handoff fails the decode.
func TestNixlDecodeRejectsBadHandoffs(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name    string
		lax     bool
		policy  string
		mutate  func(t *testing.T, h map[string]any, p, d *vllm.Server) map[string]any // returns the decode's kv_transfer_params
		body    map[string]any                                                         // decode body (default chatBody)
		status  int
		kv      string // X-Fake-KV on success
		message string
		event   string // decode event
	}{
		{name: "reused handoff", mutate: func(t *testing.T, h map[string]any, _, d *vllm.Server) map[string]any {
			r := post(t.Context(), d.URL()+"/v1/chat/completions", with(chatBody, "kv_transfer_params", h))
			require.Equal(t, http.StatusOK, r.status, string(r.body))
			return h
		}, status: 500, message: "was already consumed by a decode", event: "kv_load_failed"},
		{name: "flattened remote_block_ids", mutate: func(_ *testing.T, h map[string]any, _, _ *vllm.Server) map[string]any {
			return with(h, "remote_block_ids", h["remote_block_ids"].([]any)[0])
		}, status: 500, message: "differ from the blocks issued", event: "kv_load_failed"},
		{name: "remote_request_id rewritten from X-Request-Id", mutate: func(_ *testing.T, h map[string]any, _, _ *vllm.Server) map[string]any {
			return with(h, "remote_request_id", "chatcmpl-client-id")
		}, status: 500, message: "unknown remote_request_id", event: "kv_load_failed"},
		{name: "foreign engine id", mutate: func(_ *testing.T, h map[string]any, _, _ *vllm.Server) map[string]any {
			return with(h, "remote_engine_id", "someone-else")
		}, status: 500, message: "unknown remote_engine_id", event: "kv_load_failed"},
		{name: "tp_size differs", mutate: func(_ *testing.T, h map[string]any, _, _ *vllm.Server) map[string]any {
			return with(h, "tp_size", 2)
		}, status: 500, message: "tp_size 2 differs", event: "kv_load_failed"},
		{name: "wrong side channel port", mutate: func(t *testing.T, h map[string]any, _, _ *vllm.Server) map[string]any {
			return with(h, "remote_port", freePort(t))
		}, status: 500, message: "KV load failed for chatcmpl-", event: "kv_load_failed"},
		{name: "another prompt", mutate: func(_ *testing.T, h map[string]any, _, _ *vllm.Server) map[string]any { return h },
			body: with(chatBody, "messages", []any{map[string]any{"role": "user", "content": "different"}}), status: 500, message: "KV mismatch", event: "kv_load_failed"},
		{name: "recompute policy", policy: vllm.PolicyRecompute, mutate: func(_ *testing.T, h map[string]any, _, _ *vllm.Server) map[string]any {
			return with(h, "remote_request_id", "nope")
		}, status: 200, kv: "recomputed", event: "recomputed"},
		{name: "missing remote_request_id strict", mutate: func(_ *testing.T, h map[string]any, _, _ *vllm.Server) map[string]any {
			return with(h, "remote_request_id", nil)
		}, status: 400, message: "invalid kv_transfer_params: missing remote_request_id", event: "kv_params_invalid"},
		{name: "missing remote_request_id lax recomputes", lax: true, mutate: func(_ *testing.T, h map[string]any, _, _ *vllm.Server) map[string]any {
			return with(h, "remote_request_id", nil, "remote_host", nil)
		}, status: 200, kv: "recomputed", event: "kv_params_invalid"},
		{name: "empty remote_block_ids strict", mutate: func(_ *testing.T, h map[string]any, _, _ *vllm.Server) map[string]any {
			return with(h, "remote_block_ids", []any{})
		}, status: 400, message: "missing remote_block_ids", event: "kv_params_invalid"},
		{name: "empty remote_block_ids lax is an engine assertion", lax: true, mutate: func(_ *testing.T, h map[string]any, _, _ *vllm.Server) map[string]any {
			return with(h, "remote_block_ids", nil)
		}, status: 500, message: "AssertionError", event: "kv_params_invalid"},
		{name: "no kv_transfer_params recomputes", mutate: func(_ *testing.T, _ map[string]any, _, _ *vllm.Server) map[string]any { return nil },
			status: 200, kv: "recomputed", event: "recomputed"},
		{name: "decode leg with n>1", mutate: func(_ *testing.T, h map[string]any, _, _ *vllm.Server) map[string]any { return h },
			body: with(chatBody, "n", 2), status: 400, message: "PD decode leg must be single-sequence (got n=2)", event: "decode_multi_sequence"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p, d := pair(t, vllm.Nixl, func(_, dc *vllm.Config) { dc.Lax, dc.KVLoadFailurePolicy = tc.lax, tc.policy })
			kv := tc.mutate(t, nixlHandoff(t, p, chatBody), p, d)
			body := chatBody
			if tc.body != nil {
				body = tc.body
			}
			if kv != nil {
				body = with(body, "kv_transfer_params", kv)
			}
			r := post(t.Context(), d.URL()+"/v1/chat/completions", body)
			require.NoError(t, r.err)
			require.Equal(t, tc.status, r.status, string(r.body))
			if tc.status == 200 {
				assert.Equal(t, tc.kv, r.header.Get(vllm.HeaderFakeKV))
			} else {
				assert.Contains(t, r.errMessage(t), tc.message)
				assert.Equal(t, errorTypes[tc.status], r.json(t)["error"].(map[string]any)["type"])
			}
			assert.Contains(t, outcomes(d, "decode"), tc.event)
		})
	}
}

var errorTypes = map[int]string{400: "BadRequestError", 500: "InternalServerError"}

func TestNixlHandoffExpires(t *testing.T) {
	t.Parallel()
	p, d := pair(t, vllm.Nixl, func(pc, _ *vllm.Config) { pc.AbortRequestTimeout = 50 * time.Millisecond })
	h := nixlHandoff(t, p, chatBody)
	require.Eventually(t, func() bool { return hasEvent(p, "handoff_expired") }, 3*time.Second, 5*time.Millisecond)
	assert.Empty(t, p.State().Held)
	r := post(t.Context(), d.URL()+"/v1/chat/completions", with(chatBody, "kv_transfer_params", h))
	require.Equal(t, http.StatusInternalServerError, r.status, string(r.body))
	assert.Contains(t, r.errMessage(t), "expired")
}

// What a prefill leg does when the gateway gets the leg wrong.
func TestNixlPrefillLegRules(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name    string
		cfg     func(c *vllm.Config)
		body    map[string]any
		status  int
		handoff bool   // a non-null kv_transfer_params in the body
		header  string // X-Fake-Handoff
		message string
		event   string
	}{
		{name: "capped max_tokens", body: prefillLeg("/v1/chat/completions", chatBody, nixlPrefillKV), status: 200, handoff: true, header: "issued", event: "handoff_issued"},
		{name: "n>1 strict", body: with(prefillLeg("/v1/chat/completions", chatBody, nixlPrefillKV), "n", 2), status: 400, message: "PD prefill leg must be single-sequence (got n=2)", event: "prefill_multi_sequence"},
		{name: "beam search strict", body: with(prefillLeg("/v1/chat/completions", chatBody, nixlPrefillKV), "use_beam_search", true), status: 400, message: "single-sequence (got use_beam_search)", event: "prefill_multi_sequence"},
		{name: "n>1 lax runs, handoff for choice 0", cfg: func(c *vllm.Config) { c.Lax = true }, body: with(prefillLeg("/v1/chat/completions", chatBody, nixlPrefillKV), "n", 2), status: 200, handoff: true, header: "issued", event: "prefill_multi_sequence"},
		{name: "uncapped strict", body: with(prefillLeg("/v1/chat/completions", chatBody, nixlPrefillKV), "max_tokens", 8), status: 400, message: "capped at one output token (got max_tokens=8)", event: "prefill_uncapped"},
		{name: "no cap at all strict", body: with(prefillLeg("/v1/chat/completions", chatBody, nixlPrefillKV), "max_tokens", nil), status: 400, message: "(got no output cap)", event: "prefill_uncapped"},
		{name: "uncapped lax generates and still hands off", cfg: func(c *vllm.Config) { c.Lax = true }, body: with(prefillLeg("/v1/chat/completions", chatBody, nixlPrefillKV), "max_tokens", 8), status: 200, handoff: true, header: "issued", event: "prefill_generated_gt_1"},
		{name: "stream loses the handoff", body: with(prefillLeg("/v1/chat/completions", chatBody, nixlPrefillKV), "stream", true), status: 200, header: "issued", event: "prefill_streamed"},
		{name: "first token EOS", cfg: func(c *vllm.Config) { c.EOSAt = 1 }, body: prefillLeg("/v1/chat/completions", chatBody, nixlPrefillKV), status: 200, header: "none", event: "no_handoff"},
		{name: "first token EOS with ignore_eos", cfg: func(c *vllm.Config) { c.EOSAt = 1 }, body: with(prefillLeg("/v1/chat/completions", chatBody, nixlPrefillKV), "ignore_eos", true), status: 200, handoff: true, header: "issued", event: "handoff_issued"},
		{name: "stream_options without stream", body: with(prefillLeg("/v1/chat/completions", chatBody, nixlPrefillKV), "stream_options", map[string]any{"include_usage": true}), status: 400, message: "Stream options can only be defined when `stream=True`."},
		{name: "min_tokens above the cap", body: with(prefillLeg("/v1/chat/completions", chatBody, nixlPrefillKV), "min_tokens", 4), status: 400, message: "min_tokens must be less than or equal to max_tokens=1, got 4."},
		{name: "consumer cannot prefill", cfg: func(c *vllm.Config) { c.Role = vllm.Consumer }, body: prefillLeg("/v1/chat/completions", chatBody, nixlPrefillKV), status: 400, message: "kv_role kv_consumer cannot serve a prefill leg", event: "role_mismatch"},
		{name: "producer cannot decode", cfg: func(c *vllm.Config) { c.Role = vllm.Producer }, body: with(chatBody, "kv_transfer_params", map[string]any{"do_remote_prefill": true}), status: 400, message: "kv_role kv_producer cannot serve a decode leg", event: "role_mismatch"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			cfg := vllm.Config{Connector: vllm.Nixl}
			if tc.cfg != nil {
				tc.cfg(&cfg)
			}
			s := start(t, cfg)
			r := post(t.Context(), s.URL()+"/v1/chat/completions", tc.body)
			require.NoError(t, r.err)
			require.Equal(t, tc.status, r.status, string(r.body))
			if tc.event != "" {
				assert.Contains(t, outcomes(s, ""), tc.event)
			}
			if tc.status != 200 {
				assert.Contains(t, r.errMessage(t), tc.message)
				return
			}
			assert.Equal(t, tc.header, r.header.Get(vllm.HeaderFakeHandoff))
			if tc.body["stream"] == true {
				outputText(t, "/v1/chat/completions", true, r) // asserts no chunk carries kv_transfer_params
				return
			}
			if tc.handoff {
				assert.NotNil(t, r.kv(t))
			} else {
				assert.Nil(t, r.kv(t))
			}
		})
	}
}

// A streamed prefill leg hands nothing to the gateway, so the decode can
// only recompute, and says so.
func TestNixlStreamedPrefillMeansRecompute(t *testing.T) {
	t.Parallel()
	p, d := pair(t, vllm.Nixl)
	pr := post(t.Context(), p.URL()+"/v1/completions", with(prefillLeg("/v1/completions", completionBody, nixlPrefillKV), "stream", true))
	require.Equal(t, http.StatusOK, pr.status)
	outputText(t, "/v1/completions", true, pr)
	assert.Contains(t, outcomes(p, "prefill"), "prefill_streamed")
	dr := post(t.Context(), d.URL()+"/v1/completions", completionBody)
	require.Equal(t, http.StatusOK, dr.status)
	assert.Equal(t, "recomputed", dr.header.Get(vllm.HeaderFakeKV))
}

func TestNixlDataParallelRanks(t *testing.T) {
	t.Parallel()
	p, d := pair(t, vllm.Nixl, func(pc, _ *vllm.Config) { pc.DPSize, pc.EngineID = 2, "eng" })
	require.Len(t, p.SideChannelPorts(), 2)
	pr := post(t.Context(), p.URL()+"/v1/chat/completions", prefillLeg("/v1/chat/completions", chatBody, nixlPrefillKV), "X-data-parallel-rank", "1")
	require.Equal(t, http.StatusOK, pr.status, string(pr.body))
	h := pr.kv(t)
	assert.Equal(t, "eng_dp1", h["remote_engine_id"])
	assert.EqualValues(t, p.SideChannelPorts()[1], h["remote_port"])

	bad := with(h, "remote_port", p.SideChannelPorts()[0])
	r := post(t.Context(), d.URL()+"/v1/chat/completions", with(chatBody, "kv_transfer_params", bad))
	require.Equal(t, http.StatusInternalServerError, r.status)
	assert.Contains(t, r.errMessage(t), "unknown remote_engine_id")

	r = post(t.Context(), d.URL()+"/v1/chat/completions", with(chatBody, "kv_transfer_params", h))
	require.Equal(t, http.StatusOK, r.status, string(r.body))
	assert.Equal(t, "transferred", r.header.Get(vllm.HeaderFakeKV))

	r = post(t.Context(), p.URL()+"/v1/chat/completions", chatBody, "X-data-parallel-rank", "2")
	require.Equal(t, http.StatusBadRequest, r.status)
	assert.Contains(t, r.errMessage(t), "out of range")
}
