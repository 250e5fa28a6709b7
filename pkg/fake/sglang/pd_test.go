package sglang_test

import (
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/smg-project/smg-extproc/pkg/fake/sglang"
)

// A correct parallel dispatch succeeds on every route, the decode answer
// equals a non-PD fake's answer, and the prefill answers one token.
func TestParallelDispatchSucceedsOnEveryRoute(t *testing.T) {
	t.Parallel()
	pair := newPair(t)
	null := start(t, fast(sglang.Null))
	routes := []struct {
		path string
		body map[string]any
	}{
		{"/generate", map[string]any{"text": "the quick brown fox", "sampling_params": map[string]any{"max_new_tokens": 8}}},
		{"/v1/chat/completions", map[string]any{"model": "m", "messages": []any{
			map[string]any{"role": "system", "content": "be brief"},
			map[string]any{"role": "user", "content": []any{map[string]any{"type": "text", "text": "hello there"}}},
		}, "max_tokens": 8}},
		{"/v1/completions", map[string]any{"model": "m", "prompt": "once upon a time", "max_tokens": 8}},
		{"/v1/messages", map[string]any{"model": "m", "system": "be nice", "messages": []any{map[string]any{"role": "user", "content": "hi"}}, "max_tokens": 8}},
		{"/v1/responses", map[string]any{"model": "m", "input": "tell me a story", "max_output_tokens": 8}},
		{"/v1/rerank", map[string]any{"query": "what is go", "documents": []any{"go is a language", "a board game", "to go somewhere"}}},
	}
	for _, rb := range routes {
		for _, stream := range []bool{false, true} {
			if rb.path == "/v1/rerank" && stream {
				continue
			}
			name := strings.TrimPrefix(rb.path, "/")
			if stream {
				name += "/stream"
			}
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				body := map[string]any{}
				for k, v := range rb.body {
					body[k] = v
				}
				if stream {
					body["stream"] = true
				}
				boot := withBoot(body, "127.0.0.1", pair.p.BootstrapPort(), newRoom())
				pr, dr := parallel(t.Context(), pair.p.URL()+rb.path, boot, pair.d.URL()+rb.path, boot)
				require.NoError(t, pr.err)
				require.NoError(t, dr.err)
				require.Equal(t, http.StatusOK, pr.status, string(pr.body))
				require.Equal(t, http.StatusOK, dr.status, string(dr.body))
				assert.Equal(t, "transferred", dr.header.Get(sglang.HeaderFakeKV))
				assert.Empty(t, pr.header.Get(sglang.HeaderFakeKV))

				nr := post(t.Context(), null.URL()+rb.path, body)
				want := outputText(t, rb.path, stream, nr)
				got := outputText(t, rb.path, stream, dr)
				assert.Equal(t, want, got, "PD output must equal non-PD output")
				prefillText := outputText(t, rb.path, stream, pr)
				if rb.path != "/v1/rerank" {
					assert.Len(t, strings.Fields(got), 8)
					assert.Len(t, strings.Fields(prefillText), 1, "prefill answers exactly one token")
					assert.True(t, strings.HasPrefix(got, prefillText), "decode's first token is the prefill's")
				}
			})
		}
	}
}

func TestGenerateFinishReasonsAndLogprobs(t *testing.T) {
	t.Parallel()
	pair := newPair(t)
	null := start(t, fast(sglang.Null))
	body := map[string]any{"text": "a b c d e", "return_logprob": true, "sampling_params": map[string]any{"max_new_tokens": 5}}
	boot := withBoot(body, "127.0.0.1", pair.p.BootstrapPort(), newRoom())
	pr, dr := parallel(t.Context(), pair.p.URL()+"/generate", boot, pair.d.URL()+"/generate", boot)
	pm, dm := pr.json(t)["meta_info"].(map[string]any), dr.json(t)["meta_info"].(map[string]any)
	nm := post(t.Context(), null.URL()+"/generate", body).json(t)["meta_info"].(map[string]any)

	assert.Equal(t, map[string]any{"type": "length", "length": 0.0}, pm["finish_reason"])
	assert.EqualValues(t, 1, pm["completion_tokens"])
	assert.Equal(t, map[string]any{"type": "length", "length": 5.0}, dm["finish_reason"])
	assert.EqualValues(t, 5, dm["completion_tokens"])
	assert.EqualValues(t, 5, dm["prompt_tokens"])

	pIn := pm["input_token_logprobs"].([]any)
	dIn := dm["input_token_logprobs"].([]any)
	require.Len(t, pIn, 5, "prefill returns one prompt logprob per prompt token")
	assert.Nil(t, pIn[0].([]any)[0], "position 0 has no logprob")
	assert.Empty(t, dIn, "decode computes no prompt logprobs")
	assert.Equal(t, nm["input_token_logprobs"], append(pIn, dIn...), "merged logprobs equal the non-PD ones")
	assert.Equal(t, nm["output_token_logprobs"], dm["output_token_logprobs"])
	assert.Equal(t, pm["output_token_logprobs"].([]any)[0], dm["output_token_logprobs"].([]any)[0])
}

func TestBatchAndParallelSampling(t *testing.T) {
	t.Parallel()
	pair := newPair(t)
	null := start(t, fast(sglang.Null))
	host, port := "127.0.0.1", pair.p.BootstrapPort()
	r1, r2, r3 := newRoom(), newRoom(), newRoom()
	cases := []struct {
		name, path string
		body       map[string]any // without bootstrap fields
		boot       map[string]any // r1, r2, r3 are replaced by fresh rooms per case
		choices    int
	}{
		{"generate text batch list rooms", "/generate",
			map[string]any{"text": []any{"a b", "c d e"}, "sampling_params": map[string]any{"max_new_tokens": 4}},
			map[string]any{"bootstrap_host": []any{host, host}, "bootstrap_port": []any{port, port}, "bootstrap_room": []any{r1, r2}}, 2},
		{"generate input_ids batch scalar room", "/generate",
			map[string]any{"input_ids": []any{[]any{1, 2, 3}, []any{4, 5}}, "sampling_params": map[string]any{"max_new_tokens": 3}},
			map[string]any{"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": r1}, 2},
		{"chat n=3 list rooms", "/v1/chat/completions",
			map[string]any{"messages": []any{map[string]any{"role": "user", "content": "hi"}}, "n": 3, "max_tokens": 4},
			map[string]any{"bootstrap_host": []any{host, host, host}, "bootstrap_port": []any{port, port, port}, "bootstrap_room": []any{r1, r2, r3}}, 3},
		{"chat n=2 scalar room", "/v1/chat/completions",
			map[string]any{"messages": []any{map[string]any{"role": "user", "content": "hi"}}, "n": 2, "max_tokens": 4, "stream": true},
			map[string]any{"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": r1}, 2},
		{"completions batch x n=2 scalar room", "/v1/completions",
			map[string]any{"prompt": []any{"one two", "three"}, "n": 2, "max_tokens": 3},
			map[string]any{"bootstrap_host": host, "bootstrap_port": nil, "bootstrap_room": r1}, 4},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			fresh := map[uint64]uint64{r1: newRoom(), r2: newRoom(), r3: newRoom()}
			boot := map[string]any{}
			for k, v := range tc.body {
				boot[k] = v
			}
			for k, v := range tc.boot {
				if k == "bootstrap_room" {
					switch rv := v.(type) {
					case uint64:
						v = fresh[rv]
					case []any:
						list := make([]any, len(rv))
						for i, x := range rv {
							list[i] = fresh[x.(uint64)]
						}
						v = list
					}
				}
				boot[k] = v
			}
			d := pair.d
			if tc.boot["bootstrap_port"] == nil {
				// A null port means "the decode's own bootstrap port".
				dc := fast(sglang.Decode)
				dc.BootstrapPort = port
				d = start(t, dc)
			}
			pr, dr := parallel(t.Context(), pair.p.URL()+tc.path, boot, d.URL()+tc.path, boot)
			require.Equal(t, http.StatusOK, pr.status, string(pr.body))
			require.Equal(t, http.StatusOK, dr.status, string(dr.body))
			nr := post(t.Context(), null.URL()+tc.path, tc.body)
			require.Equal(t, http.StatusOK, nr.status, string(nr.body))
			stream, _ := tc.body["stream"].(bool)
			if stream {
				assert.Equal(t, collectChoices(t, nr), collectChoices(t, dr))
				assert.Len(t, collectChoices(t, dr), tc.choices)
				return
			}
			if tc.path == "/generate" {
				dl, nl := dr.list(t), nr.list(t)
				require.Len(t, dl, tc.choices)
				for i := range dl {
					assert.Equal(t, nl[i]["text"], dl[i]["text"])
					assert.Equal(t, nl[i]["output_ids"], dl[i]["output_ids"])
				}
				return
			}
			dc, nc := dr.json(t)["choices"].([]any), nr.json(t)["choices"].([]any)
			require.Len(t, dc, tc.choices)
			assert.Equal(t, nc, dc)
		})
	}
}

// collectChoices concatenates streamed chat/completions deltas per choice index.
func collectChoices(t *testing.T, r resp) map[float64]string {
	t.Helper()
	out := map[float64]string{}
	for _, e := range parseSSE(t, r.body) {
		if e.data == "[DONE]" {
			continue
		}
		for _, c := range decodeJSON(t, e.data)["choices"].([]any) {
			cm := c.(map[string]any)
			if d, ok := cm["delta"].(map[string]any); ok {
				out[cm["index"].(float64)] += d["content"].(string)
			}
		}
	}
	return out
}

func TestCountTokens(t *testing.T) {
	t.Parallel()
	p := start(t, fast(sglang.Prefill))
	body := map[string]any{"model": "m", "system": "sys prompt", "messages": []any{map[string]any{"role": "user", "content": "one two three"}}}
	r := post(t.Context(), p.URL()+"/v1/messages/count_tokens", body)
	require.Equal(t, http.StatusOK, r.status, string(r.body))
	assert.Equal(t, map[string]any{"input_tokens": 5.0}, r.json(t))

	r = post(t.Context(), p.URL()+"/v1/messages/count_tokens", withBoot(body, "127.0.0.1", p.BootstrapPort(), newRoom()))
	require.Equal(t, http.StatusBadRequest, r.status)
	assert.Contains(t, r.errMessage(t), "bootstrap fields are not accepted")

	p.UpdateConfig(func(c *sglang.Config) { c.Lax = true })
	r = post(t.Context(), p.URL()+"/v1/messages/count_tokens", withBoot(body, "127.0.0.1", p.BootstrapPort(), newRoom()))
	require.Equal(t, http.StatusOK, r.status, string(r.body))
}

// Room 0 with host 2.2.2.2 is SGLang's health-check form: no pairing.
func TestHealthCheckFormCompletesLocally(t *testing.T) {
	t.Parallel()
	pair := newPair(t)
	body := withBoot(map[string]any{"input_ids": []any{0}, "sampling_params": map[string]any{"max_new_tokens": 1}}, sglang.FakeBootstrapHost, 8998, 0)
	for _, s := range []*sglang.Server{pair.p, pair.d} {
		r := post(t.Context(), s.URL()+"/generate", body)
		require.Equal(t, http.StatusOK, r.status, string(r.body))
	}
	r := post(t.Context(), pair.d.URL()+"/generate", body)
	assert.Equal(t, "none", r.header.Get(sglang.HeaderFakeKV))
}

// A missing bootstrap_port means the worker's own bootstrap port.
func TestMissingPortUsesOwnBootstrapPort(t *testing.T) {
	t.Parallel()
	p := start(t, fast(sglang.Prefill))
	dc := fast(sglang.Decode)
	dc.BootstrapPort = p.BootstrapPort()
	d := start(t, dc)
	body := map[string]any{"text": "x y", "bootstrap_host": "127.0.0.1", "bootstrap_room": newRoom()}
	pr, dr := parallel(t.Context(), p.URL()+"/generate", body, d.URL()+"/generate", body)
	require.Equal(t, http.StatusOK, pr.status, string(pr.body))
	require.Equal(t, http.StatusOK, dr.status, string(dr.body))
}
