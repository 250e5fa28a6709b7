package sglang_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/smg-project/smg-extproc/pkg/fake/sglang"
)

// fast returns a config with short timeouts for tests.
func fast(mode sglang.Mode) sglang.Config {
	return sglang.Config{
		Mode:               mode,
		BootstrapTimeout:   3 * time.Second,
		WaitingTimeout:     3 * time.Second,
		FetchRetryInterval: 20 * time.Millisecond,
		FetchAttempts:      3,
	}
}

func start(t *testing.T, cfg sglang.Config) *sglang.Server {
	t.Helper()
	s := sglang.New(cfg)
	require.NoError(t, s.Start(t.Context()))
	t.Cleanup(func() { require.NoError(t, s.Close()) })
	return s
}

type pdPair struct {
	p, d *sglang.Server
}

func newPair(t *testing.T, mut ...func(p, d *sglang.Config)) pdPair {
	t.Helper()
	pc, dc := fast(sglang.Prefill), fast(sglang.Decode)
	for _, m := range mut {
		m(&pc, &dc)
	}
	return pdPair{p: start(t, pc), d: start(t, dc)}
}

func newRoom() uint64 { return rand.Uint64N(1<<63-2) + 1 }

// freePort returns a port nothing listens on (best effort).
func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := ln.Addr().(*net.TCPAddr).Port
	require.NoError(t, ln.Close())
	return port
}

// withBoot returns a copy of body with scalar bootstrap fields.
func withBoot(body map[string]any, host string, port int, room uint64) map[string]any {
	out := make(map[string]any, len(body)+3)
	for k, v := range body {
		out[k] = v
	}
	out["bootstrap_host"] = host
	out["bootstrap_port"] = port
	out["bootstrap_room"] = room
	return out
}

type resp struct {
	status  int
	header  http.Header
	body    []byte
	err     error
	elapsed time.Duration
}

func (r resp) json(t *testing.T) map[string]any {
	t.Helper()
	var m map[string]any
	require.NoError(t, json.Unmarshal(r.body, &m), string(r.body))
	return m
}

func (r resp) list(t *testing.T) []map[string]any {
	t.Helper()
	var m []map[string]any
	require.NoError(t, json.Unmarshal(r.body, &m), string(r.body))
	return m
}

// errMessage extracts the error message of any SGLang error envelope.
func (r resp) errMessage(t *testing.T) string {
	t.Helper()
	m := r.json(t)
	if msg, ok := m["message"].(string); ok {
		return msg
	}
	e, ok := m["error"].(map[string]any)
	require.True(t, ok, "no error in %s", r.body)
	return e["message"].(string)
}

func doRaw(ctx context.Context, method, url, contentType string, body []byte) resp {
	start := time.Now()
	req, err := http.NewRequestWithContext(ctx, method, url, bytes.NewReader(body))
	if err != nil {
		return resp{err: err}
	}
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		return resp{err: err, elapsed: time.Since(start)}
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	return resp{status: res.StatusCode, header: res.Header, body: b, err: err, elapsed: time.Since(start)}
}

func post(ctx context.Context, url string, body any) resp {
	b, err := json.Marshal(body)
	if err != nil {
		return resp{err: err}
	}
	return doRaw(ctx, http.MethodPost, url, "application/json", b)
}

// parallel posts pBody to the prefill and dBody to the decode concurrently.
func parallel(ctx context.Context, pURL string, pBody any, dURL string, dBody any) (resp, resp) {
	var wg sync.WaitGroup
	var pr, dr resp
	wg.Add(2)
	go func() { defer wg.Done(); pr = post(ctx, pURL, pBody) }()
	go func() { defer wg.Done(); dr = post(ctx, dURL, dBody) }()
	wg.Wait()
	return pr, dr
}

type sseEvent struct {
	event string
	data  string
}

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

// outputText extracts the generated text (or, for rerank, the scores) of a
// successful response on path.
func outputText(t *testing.T, path string, stream bool, r resp) string {
	t.Helper()
	require.Equal(t, http.StatusOK, r.status, "%s: %s", path, r.body)
	if !stream {
		m := map[string]any{}
		if path != "/v1/rerank" {
			m = r.json(t)
		}
		switch path {
		case "/generate":
			return m["text"].(string)
		case "/v1/chat/completions":
			return m["choices"].([]any)[0].(map[string]any)["message"].(map[string]any)["content"].(string)
		case "/v1/completions":
			return m["choices"].([]any)[0].(map[string]any)["text"].(string)
		case "/v1/messages":
			return m["content"].([]any)[0].(map[string]any)["text"].(string)
		case "/v1/responses":
			return m["output"].([]any)[0].(map[string]any)["content"].([]any)[0].(map[string]any)["text"].(string)
		case "/v1/rerank":
			var list []map[string]any
			require.NoError(t, json.Unmarshal(r.body, &list))
			var b strings.Builder
			for _, x := range list {
				b.WriteString(mustJSON(t, []any{x["index"], x["score"], x["document"]}))
			}
			return b.String()
		}
		t.Fatalf("unknown path %s", path)
	}
	require.Equal(t, "text/event-stream", r.header.Get("Content-Type"))
	events := parseSSE(t, r.body)
	require.NotEmpty(t, events)
	var b strings.Builder
	switch path {
	case "/generate":
		require.Equal(t, "[DONE]", events[len(events)-1].data)
		return decodeJSON(t, events[len(events)-2].data)["text"].(string)
	case "/v1/chat/completions", "/v1/completions":
		require.Equal(t, "[DONE]", events[len(events)-1].data)
		for _, e := range events[:len(events)-1] {
			for _, c := range decodeJSON(t, e.data)["choices"].([]any) {
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

func mustJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	require.NoError(t, err)
	return string(b)
}
