package vllm_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/smg-project/smg-extproc/pkg/fake/vllm"
)

func start(t *testing.T, cfg vllm.Config) *vllm.Server {
	t.Helper()
	s := vllm.New(cfg)
	require.NoError(t, s.Start(t.Context()))
	t.Cleanup(func() { require.NoError(t, s.Close()) })
	return s
}

// pair starts a prefill (Producer) and a decode (Consumer) for connector.
func pair(t *testing.T, connector vllm.Connector, mut ...func(p, d *vllm.Config)) (p, d *vllm.Server) {
	t.Helper()
	pc := vllm.Config{Role: vllm.Producer, Connector: connector, TransferTimeout: 3 * time.Second}
	dc := vllm.Config{Role: vllm.Consumer, Connector: connector, TransferTimeout: 3 * time.Second}
	for _, m := range mut {
		m(&pc, &dc)
	}
	return start(t, pc), start(t, dc)
}

func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := ln.Addr().(*net.TCPAddr).Port
	require.NoError(t, ln.Close())
	return port
}

type resp struct {
	status int
	header http.Header
	body   []byte
	err    error
}

func (r resp) json(t *testing.T) map[string]any {
	t.Helper()
	var m map[string]any
	require.NoError(t, json.Unmarshal(r.body, &m), string(r.body))
	return m
}

// errMessage is the message of vLLM's (or Anthropic's) error envelope.
func (r resp) errMessage(t *testing.T) string {
	t.Helper()
	e, ok := r.json(t)["error"].(map[string]any)
	require.True(t, ok, "no error in %s", r.body)
	return e["message"].(string)
}

// kv is the top-level kv_transfer_params of a non-stream response.
func (r resp) kv(t *testing.T) map[string]any {
	t.Helper()
	m := r.json(t)
	require.Contains(t, m, "kv_transfer_params")
	if m["kv_transfer_params"] == nil {
		return nil
	}
	return m["kv_transfer_params"].(map[string]any)
}

func doRaw(ctx context.Context, url string, body []byte, header http.Header) resp {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return resp{err: err}
	}
	req.Header.Set("Content-Type", "application/json")
	for k, v := range header {
		req.Header[k] = v
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		return resp{err: err}
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	return resp{status: res.StatusCode, header: res.Header, body: b, err: err}
}

func post(ctx context.Context, url string, body any, kv ...string) resp {
	b, err := json.Marshal(body)
	if err != nil {
		return resp{err: err}
	}
	h := http.Header{}
	for i := 0; i+1 < len(kv); i += 2 {
		h.Set(kv[i], kv[i+1])
	}
	return doRaw(ctx, url, b, h)
}

func get(t *testing.T, url string) resp {
	t.Helper()
	res, err := http.Get(url)
	require.NoError(t, err)
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	return resp{status: res.StatusCode, header: res.Header, body: b}
}

func clone(m map[string]any) map[string]any {
	out := make(map[string]any, len(m))
	for k, v := range m {
		out[k] = v
	}
	return out
}

// with returns a copy of body with the given key/value pairs set (a nil
// value deletes the key).
func with(body map[string]any, kv ...any) map[string]any {
	out := clone(body)
	for i := 0; i+1 < len(kv); i += 2 {
		if kv[i+1] == nil {
			delete(out, kv[i].(string))
			continue
		}
		out[kv[i].(string)] = kv[i+1]
	}
	return out
}

// prefillLeg is what SMG sends the prefill: stream false, no
// stream_options / min_tokens, n 1 if present, the route's cap at 1, and
// kv_transfer_params.
func prefillLeg(path string, body map[string]any, kv map[string]any) map[string]any {
	p := with(body, "stream", false, "stream_options", nil, "min_tokens", nil, "kv_transfer_params", kv)
	if _, ok := p["n"]; ok {
		p["n"] = 1
	}
	switch {
	case path == "/v1/chat/completions" && p["max_completion_tokens"] != nil:
		p["max_completion_tokens"] = 1
		delete(p, "max_tokens")
	case path == "/v1/responses":
		p["max_output_tokens"] = 1
	default:
		p["max_tokens"] = 1
	}
	return p
}

// moriPrefillLeg adds MoRI-IO's ignore_eos and drops stop conditions.
func moriPrefillLeg(path string, body, kv map[string]any) map[string]any {
	return with(prefillLeg(path, body, kv), "ignore_eos", true, "stop", nil, "stop_token_ids", nil)
}

type sseEvent struct{ event, data string }

func parseSSE(t *testing.T, body []byte) []sseEvent {
	t.Helper()
	var out []sseEvent
	var cur sseEvent
	sc := bufio.NewScanner(bytes.NewReader(body))
	sc.Buffer(make([]byte, 1<<20), 1<<24)
	for sc.Scan() {
		line := sc.Text()
		switch {
		case line == "":
			if cur.data != "" || cur.event != "" {
				out = append(out, cur)
			}
			cur = sseEvent{}
		case strings.HasPrefix(line, "event: "):
			cur.event = strings.TrimPrefix(line, "event: ")
		case strings.HasPrefix(line, "data: "):
			cur.data = strings.TrimPrefix(line, "data: ")
		default:
			t.Fatalf("unexpected SSE line %q", line)
		}
	}
	return out
}

func decodeJSON(t *testing.T, s string) map[string]any {
	t.Helper()
	var m map[string]any
	require.NoError(t, json.Unmarshal([]byte(s), &m), s)
	return m
}

// outputText extracts the generated text of a successful response.
func outputText(t *testing.T, path string, stream bool, r resp) string {
	t.Helper()
	require.NoError(t, r.err)
	require.Equal(t, http.StatusOK, r.status, "%s: %s", path, r.body)
	if !stream {
		m := r.json(t)
		switch path {
		case "/v1/chat/completions":
			return m["choices"].([]any)[0].(map[string]any)["message"].(map[string]any)["content"].(string)
		case "/v1/completions":
			return m["choices"].([]any)[0].(map[string]any)["text"].(string)
		case "/v1/messages":
			return m["content"].([]any)[0].(map[string]any)["text"].(string)
		case "/v1/responses":
			return m["output"].([]any)[0].(map[string]any)["content"].([]any)[0].(map[string]any)["text"].(string)
		}
		t.Fatalf("unknown path %s", path)
	}
	require.Equal(t, "text/event-stream", r.header.Get("Content-Type"))
	events := parseSSE(t, r.body)
	require.NotEmpty(t, events)
	var b strings.Builder
	switch path {
	case "/v1/chat/completions", "/v1/completions":
		require.Equal(t, "[DONE]", events[len(events)-1].data)
		for _, e := range events[:len(events)-1] {
			m := decodeJSON(t, e.data)
			assert.NotContains(t, m, "kv_transfer_params", "stream chunks never carry kv_transfer_params")
			for _, c := range m["choices"].([]any) {
				cm := c.(map[string]any)
				if d, ok := cm["delta"].(map[string]any); ok {
					b.WriteString(d["content"].(string))
				} else {
					b.WriteString(cm["text"].(string))
				}
			}
		}
	case "/v1/messages":
		require.Equal(t, "message_stop", events[len(events)-1].event)
		for _, e := range events {
			if e.event == "content_block_delta" {
				b.WriteString(decodeJSON(t, e.data)["delta"].(map[string]any)["text"].(string))
			}
		}
	case "/v1/responses":
		require.Equal(t, "response.completed", events[len(events)-1].event)
		for _, e := range events {
			if e.event == "response.output_text.delta" {
				b.WriteString(decodeJSON(t, e.data)["delta"].(string))
			}
		}
	default:
		t.Fatalf("unknown path %s", path)
	}
	return b.String()
}

// outcomes lists the event outcomes of s (optionally only for one leg).
func outcomes(s *vllm.Server, leg string) []string {
	var out []string
	for _, e := range s.Events() {
		if leg == "" || e.Leg == leg {
			out = append(out, e.Outcome)
		}
	}
	return out
}

func hasEvent(s *vllm.Server, outcome string) bool {
	for _, e := range s.Events() {
		if e.Outcome == outcome {
			return true
		}
	}
	return false
}

// concurrently runs fns at once and waits for all.
func concurrently(fns ...func()) {
	var wg sync.WaitGroup
	for _, fn := range fns {
		wg.Add(1)
		go func() { defer wg.Done(); fn() }()
	}
	wg.Wait()
}

var chatBody = map[string]any{
	"model": "m", "messages": []any{
		map[string]any{"role": "system", "content": "be brief"},
		map[string]any{"role": "user", "content": "tell me about the quick brown fox"},
	},
	"max_tokens": 8, "top_p": 0.95,
}

var completionBody = map[string]any{"model": "m", "prompt": "once upon a time there was", "max_tokens": 8}

var messagesBody = map[string]any{
	"model": "m", "system": "be nice",
	"messages":   []any{map[string]any{"role": "user", "content": "hi there friend"}},
	"max_tokens": 8,
}

func jsonUnmarshal(b []byte, v any) error { return json.Unmarshal(b, v) }
