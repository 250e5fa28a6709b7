package pd

import (
	"encoding/json"
	"errors"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/smg-project/smg-extproc/pkg/apierr"
)

const testXfer = "xfer-0190a5f4-1c2d-7abc-8def-0123456789ab"

func mustRequest(t testing.TB, path, body string) *Request {
	t.Helper()
	route, ok := LookupRoute(path)
	require.True(t, ok, path)
	req, err := ParseRequest(route, []byte(body))
	require.NoError(t, err)
	return req
}

func nixlWorker() VLLMWorker { return VLLMWorker{URL: "http://p:8000", KVConnector: NixlConnector} }

func mooncakeWorker(host string, port *int, engine string) VLLMWorker {
	return VLLMWorker{URL: "http://p:8000", KVConnector: MooncakeConnector, BootstrapHost: host, BootstrapPort: port, KVEngineID: engine}
}

func TestConnectorMode(t *testing.T) {
	cases := []struct {
		prefill, decode string
		want            ConnectorMode
		label           string
	}{
		{NixlConnector, NixlConnector, ModeNixl, "nixl"},
		{MooncakeConnector, "", ModeMooncake, "mooncake"},
		{MoRIIOConnector, MoRIIOConnector, ModeMoRIIO, "moriio"},
		{"", "", ModePassthrough, "passthrough"},
		{"MultiConnector", NixlConnector, ModePassthrough, "passthrough"},
		{"nixlconnector", "", ModePassthrough, "passthrough"}, // exact match only
		{" NixlConnector", "", ModePassthrough, "passthrough"},
		{"LMCacheConnector", "", ModePassthrough, "passthrough"},
		// A MoRI-IO decode always takes the MoRI-IO path (the pair check refuses the mix).
		{NixlConnector, MoRIIOConnector, ModeMoRIIO, "moriio"},
		{"", MoRIIOConnector, ModeMoRIIO, "moriio"},
		{MoRIIOConnector, NixlConnector, ModeMoRIIO, "moriio"},
	}
	for _, c := range cases {
		got := PairConnectorMode(c.prefill, c.decode)
		assert.Equal(t, c.want, got, "%q/%q", c.prefill, c.decode)
		assert.Equal(t, c.label, got.String())
	}
}

func TestMooncakeEngineID(t *testing.T) {
	cases := []struct {
		name string
		w    VLLMWorker
		want string
		ok   bool
	}{
		{"plain", VLLMWorker{KVEngineID: "eng"}, "eng", true},
		{"empty means unknown", VLLMWorker{}, "", false},
		{"dp 2 rank 1 (item 41)", VLLMWorker{KVEngineID: "eng", DPSize: intp(2), DPRank: intp(1)}, "eng_dp1", true},
		{"dp 2 unpinned (item 41)", VLLMWorker{KVEngineID: "eng", DPSize: intp(2)}, "", false},
		{"dp 1 ignores rank", VLLMWorker{KVEngineID: "eng", DPSize: intp(1), DPRank: intp(3)}, "eng", true},
		{"dp label", VLLMWorker{KVEngineID: "eng", DPRank: intp(0), Labels: map[string]string{"dp_size": "4"}}, "eng_dp0", true},
		{"dp label unpinned", VLLMWorker{KVEngineID: "eng", Labels: map[string]string{"dp_size": "4"}}, "", false},
		{"dp label 1", VLLMWorker{KVEngineID: "eng", Labels: map[string]string{"dp_size": "1"}}, "eng", true},
		{"invalid dp label fails closed", VLLMWorker{KVEngineID: "eng", Labels: map[string]string{"dp_size": "not-a-number"}}, "", false},
		{"zero dp label fails closed", VLLMWorker{KVEngineID: "eng", Labels: map[string]string{"dp_size": "0"}}, "", false},
		{"worker dp size wins over a bad label", VLLMWorker{KVEngineID: "eng", DPSize: intp(1), Labels: map[string]string{"dp_size": "x"}}, "eng", true},
	}
	for _, c := range cases {
		got, ok := MooncakeEngineID(c.w)
		assert.Equal(t, c.ok, ok, c.name)
		assert.Equal(t, c.want, got, c.name)
	}
}

func TestMintTransferID(t *testing.T) {
	re := regexp.MustCompile(`^xfer-[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`)
	seen := map[string]bool{}
	for range 100 {
		id, err := MintTransferID()
		require.NoError(t, err)
		assert.Regexp(t, re, id)
		assert.False(t, seen[id], "duplicate %s", id)
		seen[id] = true
	}
	var rnd [16]byte
	for i := range rnd {
		rnd[i] = 0xff
	}
	id := transferIDFrom(time.UnixMilli(0x0190a5f41c2d), rnd)
	assert.Equal(t, "xfer-0190a5f4-1c2d-7fff-bfff-ffffffffffff", id)
}

func TestBuildVLLMLegsSanitization(t *testing.T) {
	const msgs = `"messages":[{"role":"user","content":"hi"}]`
	const nixlTag = `"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false}`
	cases := []struct {
		name, path, body string
		prefill          VLLMWorker
		model            string
		wantPrefill      string
		wantDecode       string // "" means the client body unchanged
	}{
		{name: "NIXL chat (item 34)", path: "/v1/chat/completions", prefill: nixlWorker(),
			body:        `{"model":"m",` + msgs + `,"max_tokens":50,"stream_options":{"include_usage":true},"top_p":0.95}`,
			wantPrefill: `{"model":"m",` + msgs + `,"max_tokens":1,"top_p":0.95,"stream":false,` + nixlTag + `}`},
		{name: "chat with both caps, n, stream, stream_options, min_tokens (items 35, 36)", path: "/v1/chat/completions",
			body:        `{` + msgs + `,"max_tokens":50,"max_completion_tokens":40,"n":1,"stream":true,"stream_options":{"include_usage":true},"min_tokens":5,"temperature":0.7}`,
			wantPrefill: `{` + msgs + `,"max_completion_tokens":1,"n":1,"stream":false,"temperature":0.7}`},
		{name: "n present but not an integer is set to 1", path: "/generate",
			body:        `{"text":"a","n":"3"}`,
			wantPrefill: `{"text":"a","n":1,"stream":false,"max_tokens":1}`},
		{name: "chat with only max_tokens", path: "/v1/chat/completions",
			body:        `{` + msgs + `,"max_tokens":88}`,
			wantPrefill: `{` + msgs + `,"max_tokens":1,"stream":false}`},
		{name: "chat with only max_completion_tokens", path: "/v1/chat/completions",
			body:        `{"max_completion_tokens":9,` + msgs + `}`,
			wantPrefill: `{"max_completion_tokens":1,` + msgs + `,"stream":false}`},
		{name: "chat without a cap", path: "/v1/chat/completions",
			body:        `{` + msgs + `}`,
			wantPrefill: `{` + msgs + `,"stream":false,"max_tokens":1}`},
		{name: "responses", path: "/v1/responses",
			body:        `{"input":"hi","max_output_tokens":100,"max_tokens":7,"stream":true}`,
			wantPrefill: `{"input":"hi","max_output_tokens":1,"max_tokens":7,"stream":false}`},
		{name: "responses without a cap", path: "/v1/responses",
			body:        `{"input":"hi"}`,
			wantPrefill: `{"input":"hi","stream":false,"max_output_tokens":1}`},
		{name: "completions without a cap", path: "/v1/completions",
			body:        `{"prompt":"a","n":1}`,
			wantPrefill: `{"prompt":"a","n":1,"stream":false,"max_tokens":1}`},
		{name: "completions keeps max_completion_tokens", path: "/v1/completions",
			body:        `{"prompt":"a","max_completion_tokens":5}`,
			wantPrefill: `{"prompt":"a","max_completion_tokens":5,"stream":false,"max_tokens":1}`},
		{name: "generate", path: "/generate",
			body:        `{"text":"a","stream":false}`,
			wantPrefill: `{"text":"a","stream":false,"max_tokens":1}`},
		{name: "messages", path: "/v1/messages",
			body:        `{` + msgs + `,"max_tokens":1024,"stream":true}`,
			wantPrefill: `{` + msgs + `,"max_tokens":1,"stream":false}`},
		{name: "whitespace and unknown fields survive", path: "/v1/chat/completions",
			body:        "{ " + msgs + " ,\n \"min_tokens\" : 2 ,\n \"x\":[1e-9,null], \"top_p\": 0.95 }",
			wantPrefill: "{ " + msgs + " ,\n \"x\":[1e-9,null], \"top_p\": 0.95,\"stream\":false,\"max_tokens\":1 }"},
		{name: "duplicate keys collapse", path: "/v1/chat/completions",
			body:        `{"stream":true,` + msgs + `,"stream":true,"min_tokens":1,"min_tokens":2}`,
			wantPrefill: `{"stream":false,` + msgs + `,"max_tokens":1}`},
		{name: "client kv_transfer_params replaced on the NIXL prefill", path: "/v1/completions", prefill: nixlWorker(),
			body:        `{"prompt":"a","kv_transfer_params":{"x":1}}`,
			wantPrefill: `{"prompt":"a",` + nixlTag + `,"stream":false,"max_tokens":1}`},
		{name: "model canonicalised on both legs", path: "/v1/chat/completions", model: "M",
			body:        `{"model":"alias",` + msgs + `}`,
			wantPrefill: `{"model":"M",` + msgs + `,"stream":false,"max_tokens":1}`,
			wantDecode:  `{"model":"M",` + msgs + `}`},
		{name: "model never added", path: "/v1/chat/completions", model: "M",
			body:        `{` + msgs + `}`,
			wantPrefill: `{` + msgs + `,"stream":false,"max_tokens":1}`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			req := mustRequest(t, c.path, c.body)
			plan, err := BuildVLLMLegs(req, VLLMAttempt{Prefill: c.prefill, Model: c.model, TransferID: testXfer})
			require.NoError(t, err)
			assert.True(t, plan.SendPrefill)
			assert.Equal(t, c.wantPrefill, string(plan.Prefill))
			assert.True(t, json.Valid(plan.Prefill))
			want := c.wantDecode
			if want == "" {
				want = c.body
			}
			assert.Equal(t, want, string(plan.Decode))
			for _, leg := range [][]byte{plan.Prefill, plan.Decode} {
				assert.NotContains(t, string(leg), "bootstrap_")
			}
			assert.Equal(t, c.body, string(req.Raw), "client bytes must not be modified")
		})
	}
}

// TestVLLMPrefillSanitizer runs the sanitizer without the relay gate, as
// SMG's prefill_sanitization_is_route_aware does (item 36: n:3 -> 1; through
// BuildVLLMLegs an n > 1 request has no prefill leg at all, item 37).
func TestVLLMPrefillSanitizer(t *testing.T) {
	body := `{"messages":[],"max_tokens":50,"max_completion_tokens":40,"n":3,"stream":true,"stream_options":{"include_usage":true},"min_tokens":5,"top_p":0.95}`
	req := mustRequest(t, "/v1/chat/completions", body)
	f, err := scanVLLMFields(req)
	require.NoError(t, err)
	out, err := req.vllmPrefill(&f, nil, nil, false)
	require.NoError(t, err)
	assert.Equal(t, `{"messages":[],"max_completion_tokens":1,"n":1,"stream":false,"top_p":0.95}`, string(out))
	assert.Equal(t, body, string(req.Raw))
}

func TestBuildVLLMLegsFanoutSkipsPrefill(t *testing.T) { // item 37
	body := `{"messages":[{"role":"user","content":"hi"}],"n":2,"stream":true,"min_tokens":3}`
	for _, w := range []VLLMWorker{nixlWorker(), mooncakeWorker("p", intp(9090), "eng"), {}} {
		t.Run(ConnectorModeOf(w.KVConnector).String(), func(t *testing.T) {
			req := mustRequest(t, "/v1/chat/completions", body)
			plan, err := BuildVLLMLegs(req, VLLMAttempt{Prefill: w, TransferID: testXfer})
			require.NoError(t, err)
			assert.False(t, plan.SendPrefill)
			assert.Nil(t, plan.Prefill)
			assert.Equal(t, body, string(plan.Decode))
			assert.Nil(t, plan.DecodeParams)
			assert.Empty(t, plan.TransferID)
			assert.Equal(t, HandoffNone, plan.Handoff)
			dec, failed, err := plan.DecodeAfterPrefill([]byte(`{"kv_transfer_params":{"a":1}}`))
			require.NoError(t, err)
			assert.False(t, failed)
			assert.Equal(t, body, string(dec))
		})
	}
	// Non-integer n counts as 1 (generate has no n validation).
	for _, n := range []string{`2.0`, `"2"`, `null`, `-3`, `1e1`, `99999999999999999999999`} {
		req := mustRequest(t, "/generate", `{"text":"a","n":`+n+`}`)
		plan, err := BuildVLLMLegs(req, VLLMAttempt{Prefill: nixlWorker()})
		require.NoError(t, err)
		assert.True(t, plan.SendPrefill, n)
		assert.Contains(t, string(plan.Prefill), `"n":1`, n)
	}
}

func TestBuildVLLMLegsHandoff(t *testing.T) {
	const body = `{"messages":[{"role":"user","content":"hi"}],"max_tokens":50,"top_p":0.95}`
	const sanitized = `{"messages":[{"role":"user","content":"hi"}],"max_tokens":1,"top_p":0.95,"stream":false`
	const mcDecode = `"kv_transfer_params":{"do_remote_decode":false,"do_remote_prefill":true,"transfer_id":"` + testXfer + `","remote_engine_id":`
	const nixlResp = `{"id":"x","kv_transfer_params": {"remote_engine_id":"eng0", "remote_block_ids":[1,2],"tp_size":1} ,"choices":[]}`
	cases := []struct {
		name        string
		prefill     VLLMWorker
		body        string // "" = body
		response    string
		wantMode    ConnectorMode
		wantHandoff HandoffKind
		wantPrefill string
		wantDecode  string
		wantFailed  bool
	}{
		{name: "NIXL relays the prefill slice byte for byte (item 34)", prefill: nixlWorker(), response: nixlResp,
			wantMode: ModeNixl, wantHandoff: HandoffRelay,
			wantPrefill: sanitized + `,"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false}}`,
			wantDecode:  strings.TrimSuffix(body, "}") + `,"kv_transfer_params":{"remote_engine_id":"eng0", "remote_block_ids":[1,2],"tp_size":1}}`},
		{name: "NIXL without params (item 38)", prefill: nixlWorker(), response: `{"id":"x"}`,
			wantMode: ModeNixl, wantHandoff: HandoffRelay,
			wantPrefill: sanitized + `,"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false}}`,
			wantDecode:  body, wantFailed: true},
		{name: "NIXL null params (item 38)", prefill: nixlWorker(), response: `{"kv_transfer_params":null}`,
			wantMode: ModeNixl, wantHandoff: HandoffRelay,
			wantPrefill: sanitized + `,"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false}}`,
			wantDecode:  body, wantFailed: true},
		{name: "NIXL relay replaces a client kv_transfer_params", prefill: nixlWorker(), response: `{"kv_transfer_params":{"a":1}}`,
			body:     `{"kv_transfer_params":{"evil":true},"prompt":"x"}`,
			wantMode: ModeNixl, wantHandoff: HandoffRelay,
			wantPrefill: `{"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false},"prompt":"x","stream":false,"max_tokens":1}`,
			wantDecode:  `{"kv_transfer_params":{"a":1},"prompt":"x"}`},
		{name: "Mooncake mints and synthesizes (item 39)", prefill: mooncakeWorker("p", intp(9090), "eng"), response: nixlResp,
			wantMode: ModeMooncake, wantHandoff: HandoffNone,
			wantPrefill: sanitized + `,"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"transfer_id":"` + testXfer + `"}}`,
			wantDecode:  strings.TrimSuffix(body, "}") + `,` + mcDecode + `"eng","remote_bootstrap_addr":"http://p:9090"}}`},
		{name: "Mooncake default port (item 40)", prefill: mooncakeWorker("p", nil, "eng"), response: `{}`,
			wantMode: ModeMooncake, wantHandoff: HandoffNone,
			wantPrefill: sanitized + `,"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"transfer_id":"` + testXfer + `"}}`,
			wantDecode:  strings.TrimSuffix(body, "}") + `,` + mcDecode + `"eng","remote_bootstrap_addr":"http://p:8998"}}`},
		{name: "Mooncake bracketed IPv6 (item 40)", prefill: mooncakeWorker("[fd00::1]", nil, "eng"), response: `{}`,
			wantMode: ModeMooncake, wantHandoff: HandoffNone,
			wantPrefill: sanitized + `,"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"transfer_id":"` + testXfer + `"}}`,
			wantDecode:  strings.TrimSuffix(body, "}") + `,` + mcDecode + `"eng","remote_bootstrap_addr":"http://[fd00::1]:8998"}}`},
		{name: "Mooncake bare IPv6 gets brackets", prefill: mooncakeWorker("fd00::1", intp(1), "eng"), response: `{}`,
			wantMode: ModeMooncake, wantHandoff: HandoffNone,
			wantPrefill: sanitized + `,"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"transfer_id":"` + testXfer + `"}}`,
			wantDecode:  strings.TrimSuffix(body, "}") + `,` + mcDecode + `"eng","remote_bootstrap_addr":"http://[fd00::1]:1"}}`},
		{name: "Mooncake DP rank suffix (item 41)",
			prefill:  VLLMWorker{KVConnector: MooncakeConnector, BootstrapHost: "p", KVEngineID: "eng", DPSize: intp(2), DPRank: intp(1)},
			response: `{}`, wantMode: ModeMooncake, wantHandoff: HandoffNone,
			wantPrefill: sanitized + `,"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"transfer_id":"` + testXfer + `"}}`,
			wantDecode:  strings.TrimSuffix(body, "}") + `,` + mcDecode + `"eng_dp1","remote_bootstrap_addr":"http://p:8998"}}`},
		{name: "Mooncake DP unpinned recomputes (item 41)",
			prefill:  VLLMWorker{KVConnector: MooncakeConnector, BootstrapHost: "p", KVEngineID: "eng", DPSize: intp(2)},
			response: nixlResp, wantMode: ModeMooncake, wantHandoff: HandoffNone,
			wantPrefill: sanitized + `}`, wantDecode: body},
		{name: "Mooncake without engine id (item 42)", prefill: mooncakeWorker("p", intp(9090), ""), response: nixlResp,
			wantMode: ModeMooncake, wantHandoff: HandoffNone,
			wantPrefill: sanitized + `}`, wantDecode: body},
		{name: "passthrough relays what prefill returns (item 43)", prefill: VLLMWorker{KVConnector: "MultiConnector"}, response: nixlResp,
			wantMode: ModePassthrough, wantHandoff: HandoffRelay,
			wantPrefill: sanitized + `}`,
			wantDecode:  strings.TrimSuffix(body, "}") + `,"kv_transfer_params":{"remote_engine_id":"eng0", "remote_block_ids":[1,2],"tp_size":1}}`},
		{name: "passthrough without params (item 43)", response: `not json`,
			wantMode: ModePassthrough, wantHandoff: HandoffRelay,
			wantPrefill: sanitized + `}`, wantDecode: body},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			b := c.body
			if b == "" {
				b = body
			}
			path := "/v1/chat/completions"
			if strings.Contains(b, `"prompt"`) {
				path = "/v1/completions"
			}
			plan, err := BuildVLLMLegs(mustRequest(t, path, b), VLLMAttempt{Prefill: c.prefill, Decode: nixlWorker(), TransferID: testXfer})
			require.NoError(t, err)
			assert.Equal(t, c.wantMode, plan.Mode)
			assert.Equal(t, c.wantHandoff, plan.Handoff)
			assert.True(t, plan.SendPrefill)
			assert.Equal(t, c.wantPrefill, string(plan.Prefill))
			dec, failed, err := plan.DecodeAfterPrefill([]byte(c.response))
			require.NoError(t, err)
			assert.Equal(t, c.wantDecode, string(dec))
			assert.Equal(t, c.wantFailed, failed)
			assert.True(t, json.Valid(plan.Prefill))
			assert.True(t, json.Valid(dec))
			if c.wantMode == ModeMooncake && plan.DecodeParams != nil {
				assert.Equal(t, testXfer, plan.TransferID)
			}
		})
	}
}

func TestBuildVLLMLegsNeedsTransferID(t *testing.T) {
	req := mustRequest(t, "/v1/completions", `{"prompt":"a"}`)
	_, err := BuildVLLMLegs(req, VLLMAttempt{Prefill: mooncakeWorker("p", nil, "eng")})
	require.Error(t, err)
	var ae *apierr.Error
	assert.False(t, errors.As(err, &ae), "an internal error, not a refusal")
	_, err = BuildVLLMLegs(nil, VLLMAttempt{})
	assert.Error(t, err)
}

func TestHarvestKVTransferParams(t *testing.T) {
	cases := []struct {
		body, want string
		ok         bool
	}{
		{`{"id":"x","kv_transfer_params":{"remote_engine_id":"e", "remote_block_ids":[1, 2],"n":0.10}}`, `{"remote_engine_id":"e", "remote_block_ids":[1, 2],"n":0.10}`, true},
		{" {\"kv_transfer_params\" :\n{ }\n} ", `{ }`, true},
		{`{"kv_transfer_params":{"a":1},"kv_transfer_params":{"b":2}}`, `{"b":2}`, true},
		{`{"kv_transfer_params":null}`, "", false},
		{`{"id":"x"}`, "", false},
		{`[1,2]`, "", false},
		{`not json`, "", false},
		{``, "", false},
		{`{"kv_transfer_params":[1]}`, "", false},
		{`{"kv_transfer_params":"x"}`, "", false},
		{`{"kv_transfer_params":{"a":1}`, "", false},
		{`{"kv_transfer_params":{"a":1}} trailing`, "", false},
		{`{"o":{"kv_transfer_params":{"a":1}}}`, "", false},
	}
	for _, c := range cases {
		raw, ok := HarvestKVTransferParams([]byte(c.body))
		assert.Equal(t, c.ok, ok, c.body)
		assert.Equal(t, c.want, string(raw), c.body)
	}
}

func TestDecodeBody(t *testing.T) {
	cases := []struct {
		body, params, want string
		err                bool
	}{
		{`{"prompt":"a","max_tokens":50}`, `{"x": 1}`, `{"prompt":"a","max_tokens":50,"kv_transfer_params":{"x": 1}}`, false},
		{`{"kv_transfer_params":{"old":1},"prompt":"a"}`, `{"new":2}`, `{"kv_transfer_params":{"new":2},"prompt":"a"}`, false},
		{`{"prompt":"a"}`, ``, `{"prompt":"a"}`, false},
		{`{"prompt":"a"}`, `{bad`, ``, true},
		{`[1]`, `{}`, ``, true},
	}
	for _, c := range cases {
		var params []byte
		if c.params != "" {
			params = []byte(c.params)
		}
		out, err := DecodeBody([]byte(c.body), params)
		if c.err {
			assert.Error(t, err, c.body)
			continue
		}
		require.NoError(t, err)
		assert.Equal(t, c.want, string(out))
	}
}

func TestVLLMErrors(t *testing.T) {
	cause := errors.New("connection refused")
	cases := []struct {
		name   string
		err    *apierr.Error
		status int
		code   string
		msg    string
	}{
		{"prefill 429 error.message (item 44)", PrefillUpstreamError(429, []byte(`{"error":{"message":"full"}}`)), 429, CodePrefillUpstreamError, "full"},
		{"prefill 422 top-level message", PrefillUpstreamError(422, []byte(`{"message":"bad"}`)), 422, CodePrefillUpstreamError, "bad"},
		{"prefill 503 raw text", PrefillUpstreamError(503, []byte("busy")), 503, CodePrefillUpstreamError, "busy"},
		{"prefill 400 object detail", PrefillUpstreamError(400, []byte(`{"detail":"x"}`)), 400, CodePrefillUpstreamError, `{"detail":"x"}`},
		{"prefill odd status", PrefillUpstreamError(200, nil), 502, CodePrefillUpstreamError, ""},
		{"prefill transport (item 45)", PrefillRequestError(cause), 502, CodePrefillRequestFailed, "Prefill transport error: connection refused"},
		{"prefill read", PrefillReadError(cause), 502, CodePrefillReadFailed, "Failed to read prefill response: connection refused"},
		{"decode transport (item 46)", DecodeRequestError(cause), 502, CodeDecodeRequestFailed, "Decode transport error: connection refused"},
		{"nil cause", DecodeRequestError(nil), 502, CodeDecodeRequestFailed, "Decode transport error: <nil>"},
	}
	for _, c := range cases {
		assert.Equal(t, c.status, c.err.Status, c.name)
		assert.Equal(t, c.code, c.err.Code, c.name)
		assert.Equal(t, c.msg, c.err.Message, c.name)
	}
	assert.ErrorIs(t, PrefillRequestError(cause), cause)
	assert.Equal(t, http.StatusBadGateway, PrefillReadError(cause).Status)
}

func FuzzBuildVLLMLegs(f *testing.F) {
	seeds := []string{
		`{"messages":[{"role":"user","content":"x"}],"max_tokens":5,"stream":true,"stream_options":{}}`,
		`{"prompt":["a","b"],"n":3,"min_tokens":1,"min_tokens":2}`, `{}`, ` { "max_completion_tokens" : 3 } `,
		`{"input":"x","stop":["a"],"stop_token_ids":[1],"request_id":"r"}`, `{"\u006e":2,"model":"m"}`,
		`{"kv_transfer_params":{"a":1},"prompt":[1,2]}`, `[1]`, `{"a":`,
	}
	for i, s := range seeds {
		f.Add([]byte(s), uint8(i), uint8(i))
	}
	moriio := func(mode string) VLLMWorker {
		return VLLMWorker{URL: "http://w:1", KVConnector: MoRIIOConnector, BootstrapHost: "10.0.0." + mode[:1],
			Labels: map[string]string{"moriio_mode": "write", "moriio_write_dispatch": mode, "tp_size": "2"}}
	}
	attempts := []VLLMAttempt{
		{Prefill: nixlWorker(), Model: "canon"},
		{Prefill: mooncakeWorker("fd00::1", nil, "eng\"x"), TransferID: testXfer},
		{Prefill: VLLMWorker{KVConnector: "x"}},
		{Prefill: moriio("sequential"), Decode: moriio("concurrent"), TransferID: testXfer, Model: "canon"},
	}
	responses := []string{`{"kv_transfer_params":{"remote_engine_id":"e"}}`, `{"id":1}`, `nope`,
		`{"kv_transfer_params":{"do_remote_prefill":true,"transfer_id":"` + testXfer + `","remote_engine_id":"e","remote_block_ids":[[1]],"remote_host":"h","remote_handshake_port":"6301","remote_notify_port":61005}}`}
	f.Fuzz(func(t *testing.T, body []byte, ri, ai uint8) {
		route := Routes()[int(ri)%len(Routes())]
		req, err := ParseRequest(route, body)
		if err != nil {
			return
		}
		a := attempts[int(ai)%len(attempts)]
		plan, err := BuildVLLMLegs(req, a)
		if err != nil {
			var ae *apierr.Error
			if !errors.As(err, &ae) {
				t.Fatalf("internal error for valid body %q: %v", body, err)
			}
			return
		}
		if plan.SendPrefill && !json.Valid(plan.Prefill) {
			t.Fatalf("invalid prefill %q from %q", plan.Prefill, body)
		}
		if !json.Valid(plan.Decode) {
			t.Fatalf("invalid decode %q from %q", plan.Decode, body)
		}
		for _, resp := range responses {
			dec, _, err := plan.DecodeAfterPrefill([]byte(resp))
			if err == nil && !json.Valid(dec) {
				t.Fatalf("invalid decode %q after %q from %q", dec, resp, body)
			}
		}
	})
}
