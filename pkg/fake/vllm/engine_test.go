package vllm_test

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/smg-project/smg-extproc/pkg/fake/vllm"
)

func TestKVTransferParamsMustBeAnObject(t *testing.T) {
	t.Parallel()
	s := start(t, vllm.Config{Connector: vllm.Nixl})
	cases := []struct {
		name, path, body string
		anthropic        bool
	}{
		{"string", "/v1/chat/completions", `{"messages":[{"role":"user","content":"a"}],"kv_transfer_params":"x"}`, false},
		{"list", "/v1/completions", `{"prompt":"a","kv_transfer_params":[1,2]}`, false},
		{"number", "/v1/completions", `{"prompt":"a","kv_transfer_params":7}`, false},
		{"bool", "/v1/chat/completions", `{"messages":[{"role":"user","content":"a"}],"kv_transfer_params":true}`, false},
		{"messages string", "/v1/messages", `{"model":"m","max_tokens":3,"messages":[{"role":"user","content":"a"}],"kv_transfer_params":"x"}`, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			r := doRaw(t.Context(), s.URL()+tc.path, []byte(tc.body), nil)
			require.NoError(t, r.err)
			require.Equal(t, http.StatusBadRequest, r.status, string(r.body))
			m := r.json(t)
			if tc.anthropic {
				assert.Equal(t, "error", m["type"])
				assert.Equal(t, "invalid_request_error", m["error"].(map[string]any)["type"])
			} else {
				assert.Equal(t, map[string]any{
					"message": m["error"].(map[string]any)["message"], "type": "BadRequestError", "param": nil, "code": 400.0,
				}, m["error"])
			}
			assert.Contains(t, r.errMessage(t), "kv_transfer_params: Input should be a valid dictionary")
		})
	}
	r := doRaw(t.Context(), s.URL()+"/v1/completions", []byte(`{"prompt":"a","kv_transfer_params":null}`), nil)
	assert.Equal(t, http.StatusOK, r.status, "null is allowed")
}

func TestRequestValidation(t *testing.T) {
	t.Parallel()
	s := start(t, vllm.Config{})
	cases := []struct {
		name, path, body, contains string
	}{
		{"not an object", "/v1/completions", `[1]`, "valid dictionary or object"},
		{"invalid json", "/v1/completions", `{"prompt":`, "valid dictionary or object"},
		{"chat without messages", "/v1/chat/completions", `{}`, "messages: Field required"},
		{"completions without prompt", "/v1/completions", `{}`, "Either prompt or prompt_embeds"},
		{"max_tokens zero", "/v1/completions", `{"prompt":"a","max_tokens":0}`, "max_tokens must be at least 1"},
		{"max_tokens not int", "/v1/completions", `{"prompt":"a","max_tokens":"x"}`, "max_tokens"},
		{"n zero", "/v1/chat/completions", `{"messages":[],"n":0}`, "n must be at least 1"},
		{"stream not bool", "/v1/completions", `{"prompt":"a","stream":"yes"}`, "stream"},
		{"messages without max_tokens", "/v1/messages", `{"model":"m","messages":[{"role":"user","content":"a"}]}`, "max_tokens: Field required"},
		{"messages without model", "/v1/messages", `{"max_tokens":2,"messages":[{"role":"user","content":"a"}]}`, "model: Field required"},
		{"responses without input", "/v1/responses", `{"model":"m"}`, "input: Field required"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			r := doRaw(t.Context(), s.URL()+tc.path, []byte(tc.body), nil)
			require.NoError(t, r.err)
			require.Equal(t, http.StatusBadRequest, r.status, string(r.body))
			assert.Contains(t, r.errMessage(t), tc.contains)
		})
	}
	r := get(t, s.URL()+"/v1/completions")
	assert.Equal(t, http.StatusMethodNotAllowed, r.status)
}

func TestRequestIDs(t *testing.T) {
	t.Parallel()
	s := start(t, vllm.Config{Connector: vllm.Nixl})
	kv := map[string]any{"do_remote_decode": true}
	cases := []struct {
		name   string
		path   string
		body   map[string]any
		header []string
		id     string // response id; "" = generated
		intern string // prefix of remote_request_id
	}{
		{"header wins", "/v1/completions", with(completionBody, "request_id", "body-id"), []string{"X-Request-Id", "hdr-id"}, "cmpl-hdr-id", "cmpl-hdr-id-0-"},
		{"body request_id", "/v1/chat/completions", with(chatBody, "request_id", "body-id"), nil, "chatcmpl-body-id", "chatcmpl-body-id-"},
		{"generated uuid", "/v1/chat/completions", chatBody, nil, "", "chatcmpl-"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			r := post(t.Context(), s.URL()+tc.path, prefillLeg(tc.path, tc.body, kv), tc.header...)
			require.Equal(t, http.StatusOK, r.status, string(r.body))
			m := r.json(t)
			if tc.id != "" {
				assert.Equal(t, tc.id, m["id"])
			} else {
				assert.Regexp(t, `^chatcmpl-[0-9a-f]{32}$`, m["id"])
			}
			internal := r.kv(t)["remote_request_id"].(string)
			assert.True(t, strings.HasPrefix(internal, tc.intern), internal)
			assert.Regexp(t, `-[0-9a-f]{8}$`, internal)
		})
	}
}

// Two workers given the same X-Request-Id use different internal ids.
func TestInternalIDsDifferPerWorker(t *testing.T) {
	t.Parallel()
	a, b := start(t, vllm.Config{Connector: vllm.Nixl}), start(t, vllm.Config{Connector: vllm.Nixl})
	body := prefillLeg("/v1/completions", completionBody, map[string]any{"do_remote_decode": true})
	ra := post(t.Context(), a.URL()+"/v1/completions", body, "X-Request-Id", "same")
	rb := post(t.Context(), b.URL()+"/v1/completions", body, "X-Request-Id", "same")
	assert.NotEqual(t, ra.kv(t)["remote_request_id"], rb.kv(t)["remote_request_id"])
}

func TestResponseShapes(t *testing.T) {
	t.Parallel()
	s := start(t, vllm.Config{})
	t.Run("chat non-stream", func(t *testing.T) {
		t.Parallel()
		m := post(t.Context(), s.URL()+"/v1/chat/completions", with(chatBody, "max_tokens", 3)).json(t)
		assert.Equal(t, "chat.completion", m["object"])
		for _, k := range []string{"kv_transfer_params", "prompt_logprobs", "prompt_token_ids", "service_tier", "system_fingerprint"} {
			assert.Contains(t, m, k)
		}
		assert.Nil(t, m["kv_transfer_params"])
		c := m["choices"].([]any)[0].(map[string]any)
		assert.Equal(t, "length", c["finish_reason"])
		assert.Contains(t, c, "stop_reason")
		assert.Equal(t, "assistant", c["message"].(map[string]any)["role"])
		u := m["usage"].(map[string]any)
		assert.EqualValues(t, 3, u["completion_tokens"])
		assert.Contains(t, u, "prompt_tokens_details")
	})
	t.Run("chat stream with continuous usage", func(t *testing.T) {
		t.Parallel()
		r := post(t.Context(), s.URL()+"/v1/chat/completions", with(chatBody, "max_tokens", 3, "n", 2, "stream", true,
			"stream_options", map[string]any{"include_usage": true, "continuous_usage_stats": true}))
		require.Equal(t, http.StatusOK, r.status, string(r.body))
		ev := parseSSE(t, r.body)
		require.Equal(t, "[DONE]", ev[len(ev)-1].data)
		first := decodeJSON(t, ev[0].data)
		assert.Equal(t, "chat.completion.chunk", first["object"])
		assert.Equal(t, map[string]any{"role": "assistant", "content": ""}, first["choices"].([]any)[0].(map[string]any)["delta"])
		usage := decodeJSON(t, ev[len(ev)-2].data)
		assert.Empty(t, usage["choices"])
		assert.EqualValues(t, 6, usage["usage"].(map[string]any)["completion_tokens"])
		finishes := 0
		for _, e := range ev[:len(ev)-2] {
			m := decodeJSON(t, e.data)
			assert.Contains(t, m, "usage", "continuous_usage_stats: usage in every chunk")
			if m["choices"].([]any)[0].(map[string]any)["finish_reason"] == "length" {
				finishes++
			}
		}
		assert.Equal(t, 2, finishes)
	})
	t.Run("stop string", func(t *testing.T) {
		t.Parallel()
		full := post(t.Context(), s.URL()+"/v1/completions", with(completionBody, "max_tokens", 6)).json(t)
		text := full["choices"].([]any)[0].(map[string]any)["text"].(string)
		words := strings.Fields(text)
		m := post(t.Context(), s.URL()+"/v1/completions", with(completionBody, "max_tokens", 6, "stop", words[2])).json(t)
		c := m["choices"].([]any)[0].(map[string]any)
		assert.Equal(t, "stop", c["finish_reason"])
		assert.Equal(t, words[2], c["stop_reason"])
		assert.Equal(t, words[0]+" "+words[1]+" ", c["text"])
	})
	t.Run("messages", func(t *testing.T) {
		t.Parallel()
		m := post(t.Context(), s.URL()+"/v1/messages", messagesBody).json(t)
		assert.Equal(t, "message", m["type"])
		assert.Equal(t, "max_tokens", m["stop_reason"])
		assert.Contains(t, m, "kv_transfer_params")
	})
}

// /v1/responses does not declare kv_transfer_params: vLLM ignores the
// field, so no handoff is returned and a decode recomputes.
func TestResponsesRouteIgnoresKVTransferParams(t *testing.T) {
	t.Parallel()
	p, d := pair(t, vllm.Nixl)
	body := map[string]any{"model": "m", "input": "tell me a story", "max_output_tokens": 6}
	pr := post(t.Context(), p.URL()+"/v1/responses", prefillLeg("/v1/responses", body, nixlPrefillKV))
	require.Equal(t, http.StatusOK, pr.status, string(pr.body))
	assert.NotContains(t, pr.json(t), "kv_transfer_params")
	assert.Empty(t, pr.header.Get(vllm.HeaderFakeHandoff))
	assert.Contains(t, outcomes(p, ""), "kv_params_ignored")
	dr := post(t.Context(), d.URL()+"/v1/responses", with(body, "kv_transfer_params", map[string]any{"do_remote_prefill": true}))
	require.Equal(t, http.StatusOK, dr.status, string(dr.body))
	assert.Equal(t, "recomputed", dr.header.Get(vllm.HeaderFakeKV))
	assert.Len(t, strings.Fields(outputText(t, "/v1/responses", false, dr)), 6)
}

func TestMetadataEndpoints(t *testing.T) {
	t.Parallel()
	s := start(t, vllm.Config{Connector: vllm.Nixl, Role: vllm.Producer, Model: "my-model", EngineID: "eng", MaxModelLen: 4096, TPSize: 2})
	r := get(t, s.URL()+"/health")
	assert.Equal(t, http.StatusOK, r.status)
	assert.Empty(t, r.body)
	assert.Equal(t, http.StatusOK, get(t, s.URL()+"/ping").status)
	assert.JSONEq(t, `{"version":"`+vllm.DefaultVersion+`"}`, string(get(t, s.URL()+"/version").body))
	models := get(t, s.URL()+"/v1/models").json(t)
	m := models["data"].([]any)[0].(map[string]any)
	assert.Equal(t, "vllm", m["owned_by"])
	assert.Equal(t, "my-model", m["id"])
	assert.EqualValues(t, 4096, m["max_model_len"])
	post(t.Context(), s.URL()+"/v1/completions", completionBody)
	metrics := string(get(t, s.URL()+"/metrics").body)
	for _, name := range []string{"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:generation_tokens_total"} {
		assert.Contains(t, metrics, name)
	}
	assert.Contains(t, metrics, `vllm:generation_tokens_total{engine="0",model_name="my-model"} 8`)
	assert.Equal(t, http.StatusNotFound, get(t, s.URL()+"/server_info").status, "/server_info needs VLLM_SERVER_DEV_MODE")
	assert.Equal(t, http.StatusNotFound, get(t, s.URL()+"/get_server_info").status)

	s.UpdateConfig(func(c *vllm.Config) { c.DevMode = true })
	info := get(t, s.URL()+"/server_info?config_format=json").json(t)
	ktc := info["vllm_config"].(map[string]any)["kv_transfer_config"].(map[string]any)
	assert.Equal(t, "NixlConnector", ktc["kv_connector"])
	assert.Equal(t, "kv_producer", ktc["kv_role"])
	assert.Equal(t, "eng", ktc["engine_id"])
	assert.IsType(t, "", get(t, s.URL()+"/server_info").json(t)["vllm_config"], "text format by default")
}

func TestFaultInjectionAndConfig(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name string
		run  func(t *testing.T, s *vllm.Server)
	}{
		{"fail_status via /_fake/config", func(t *testing.T, s *vllm.Server) {
			r := post(t.Context(), s.URL()+"/_fake/config", map[string]any{"fail_status": 503, "fail_body": map[string]any{"error": "boom"}})
			require.Equal(t, http.StatusOK, r.status, string(r.body))
			assert.EqualValues(t, 503, r.json(t)["fail_status"])
			r = post(t.Context(), s.URL()+"/v1/completions", completionBody)
			assert.Equal(t, http.StatusServiceUnavailable, r.status)
			assert.JSONEq(t, `{"error":"boom"}`, string(r.body))
			assert.Len(t, s.Requests(), 1, "the request is still recorded")
			require.Equal(t, http.StatusOK, post(t.Context(), s.URL()+"/_fake/reset", nil).status)
			assert.Equal(t, http.StatusOK, post(t.Context(), s.URL()+"/v1/completions", completionBody).status)
		}},
		{"hang never answers until the client leaves", func(t *testing.T, s *vllm.Server) {
			s.UpdateConfig(func(c *vllm.Config) { c.Hang = true })
			ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
			defer cancel()
			r := post(ctx, s.URL()+"/v1/completions", completionBody)
			require.Error(t, r.err)
			require.Eventually(t, func() bool { return s.State().InFlight == 0 }, 3*time.Second, 5*time.Millisecond)
		}},
		{"startup window", func(t *testing.T, s *vllm.Server) {
			r := post(t.Context(), s.URL()+"/_fake/config", map[string]any{"startup_ms": 60000})
			require.Equal(t, http.StatusOK, r.status)
			assert.Equal(t, http.StatusServiceUnavailable, get(t, s.URL()+"/health").status)
			s.Reset()
			assert.Equal(t, http.StatusOK, get(t, s.URL()+"/health").status)
		}},
		{"bad patch", func(t *testing.T, s *vllm.Server) {
			assert.Equal(t, http.StatusBadRequest, post(t.Context(), s.URL()+"/_fake/config", map[string]any{"nope": 1}).status)
			assert.Equal(t, http.StatusBadRequest, post(t.Context(), s.URL()+"/_fake/config", map[string]any{"kv_load_failure_policy": "retry"}).status)
			assert.Equal(t, http.StatusBadRequest, post(t.Context(), s.URL()+"/_fake/config", map[string]any{"fail_status": 42}).status)
		}},
		{"introspection", func(t *testing.T, s *vllm.Server) {
			post(t.Context(), s.URL()+"/v1/completions", completionBody)
			post(t.Context(), s.URL()+"/v1/chat/completions", chatBody)
			var reqs []map[string]any
			r := get(t, s.URL()+"/_fake/requests?path=/v1/completions")
			require.NoError(t, jsonUnmarshal(r.body, &reqs))
			require.Len(t, reqs, 1)
			assert.Equal(t, "/v1/completions", reqs[0]["path"])
			st := get(t, s.URL()+"/_fake/state").json(t)
			assert.EqualValues(t, 2, st["requests_total"])
			assert.Equal(t, "nixl", st["connector"])
			assert.NotEmpty(t, get(t, s.URL()+"/_fake/events").body)
			cfg := get(t, s.URL()+"/_fake/config").json(t)
			assert.Equal(t, true, cfg["strict"])
			assert.EqualValues(t, 480000, cfg["abort_request_timeout_ms"])
		}},
		{"per-token delay", func(t *testing.T, s *vllm.Server) {
			s.UpdateConfig(func(c *vllm.Config) { c.PerTokenDelay = 20 * time.Millisecond })
			begin := time.Now()
			r := post(t.Context(), s.URL()+"/v1/completions", with(completionBody, "max_tokens", 4, "stream", true))
			require.Equal(t, http.StatusOK, r.status)
			assert.GreaterOrEqual(t, time.Since(begin), 60*time.Millisecond)
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			tc.run(t, start(t, vllm.Config{Connector: vllm.Nixl}))
		})
	}
}

func TestConfigParsing(t *testing.T) {
	t.Parallel()
	roles := []struct {
		in   string
		want vllm.Role
	}{{"producer", vllm.Producer}, {"kv_consumer", vllm.Consumer}, {"BOTH", vllm.Both}}
	for _, tc := range roles {
		got, err := vllm.ParseRole(tc.in)
		require.NoError(t, err)
		assert.Equal(t, tc.want, got)
	}
	_, err := vllm.ParseRole("x")
	assert.Error(t, err)
	conns := []struct {
		in   string
		want vllm.Connector
	}{{"nixl", vllm.Nixl}, {"NixlConnector", vllm.Nixl}, {"mooncake", vllm.Mooncake}, {"MoRIIOConnector", vllm.MoRIIO}, {"none", vllm.None}}
	for _, tc := range conns {
		got, err := vllm.ParseConnector(tc.in)
		require.NoError(t, err)
		assert.Equal(t, tc.want, got)
	}
	_, err = vllm.ParseConnector("lmcache")
	assert.Error(t, err)
	s := vllm.New(vllm.Config{DPSize: 2, DPRank: 2})
	assert.ErrorContains(t, s.Start(t.Context()), "dp rank 2")
	assert.NoError(t, s.Close())
}
