package integration

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/smg-project/smg-extproc/pkg/fake/sglang"
)

const chatBody = `{"model":"fake-model","messages":[{"role":"user","content":"hello"}],"max_tokens":3}`

// TestSGLangFailures checks every failure the gateway answers itself: SMG's
// JSON error body, the code header, and which legs were (not) contacted.
func TestSGLangFailures(t *testing.T) {
	// One attempt per request: these check each failure's mapping (retries have their own test).
	s := newStack(t, "--max-payload-size", "65536", "--disable-retries")
	ok := func() { // the stack still serves after each failure
		r := post(t, s.GW.URL+"/v1/chat/completions", chatBody, nil)
		require.Equal(t, 200, r.Status, "follow-up request: %s", r.Body)
	}
	bad := []struct {
		name, path, body, code string
		status                 int
	}{
		{"malformed", "/v1/chat/completions", `{"messages":[`, "json_parse_error", 400},
		{"empty", "/v1/chat/completions", ``, "json_parse_error", 400},
		{"array", "/generate", `[1,2]`, "invalid_request", 400},
		{"string", "/v1/completions", `"hi"`, "invalid_request", 400},
		{"stream-wrong-type", "/v1/chat/completions", `{"messages":[],"stream":"yes"}`, "invalid_request", 400},
		{"n-wrong-type", "/v1/chat/completions", `{"messages":[],"n":"three"}`, "invalid_request", 400},
		{"oversized", "/v1/completions", `{"prompt":"` + strings.Repeat("x", 70000) + `"}`, "payload_too_large", 413},
	}
	for _, tc := range bad {
		t.Run("bad-input/"+tc.name, func(t *testing.T) {
			s.reset()
			r := post(t, s.GW.URL+tc.path, tc.body, nil)
			require.Equal(t, tc.status, r.Status, "body: %s", r.Body)
			code, _, _ := errorBody(t, r)
			assert.Equal(t, tc.code, code)
			assert.Zero(t, len(s.P.Requests()), "no leg may be contacted")
			assert.Zero(t, len(s.D.Requests()), "no leg may be contacted")
		})
	}

	t.Run("unknown-route-and-method", func(t *testing.T) {
		r := post(t, s.GW.URL+"/v1/embeddings", `{}`, nil)
		require.Equal(t, 404, r.Status)
		code, _, _ := errorBody(t, r)
		assert.Equal(t, "not_found", code)
		r = do(t, "GET", s.GW.URL+"/v1/chat/completions", nil, nil)
		require.Equal(t, 405, r.Status)
		assert.Zero(t, len(s.D.Requests()))
	})

	t.Run("prefill-error-before-decode-commits", func(t *testing.T) {
		s.reset()
		s.P.UpdateConfig(func(c *sglang.Config) { c.FailStatus, c.FailBody = 400, "bad" })
		defer s.P.UpdateConfig(func(c *sglang.Config) { c.FailStatus, c.FailBody = 0, "" })
		start := time.Now()
		r := post(t, s.GW.URL+"/v1/chat/completions", chatBody, nil)
		require.Equal(t, 400, r.Status, "body: %s", r.Body)
		code, msg, typ := errorBody(t, r)
		assert.Equal(t, "prefill_bad_request", code)
		assert.Equal(t, "Bad Request", typ)
		assert.Equal(t, "Prefill server error (400 Bad Request): bad", msg)
		// The decode was waiting on its room; the gateway must cancel it rather
		// than leave the client waiting for the engine's own timeout (8 s here).
		assert.Less(t, time.Since(start), 5*time.Second, "prefill failure must answer without waiting for the decode")
		// Either Envoy had not sent the decode leg yet, or it was reset (the fake logs an abort).
		waitFor(t, 5*time.Second, func() bool {
			return len(s.D.Requests()) == 0 || len(eventsWith(s.D.Events(), "aborted")) == 1
		}, "decode leg should be cancelled (aborted), events: %+v", s.D.Events())
		assert.Empty(t, eventsWith(s.D.Events(), "transferred"))
	})
	ok()

	t.Run("decode-error-non-stream", func(t *testing.T) {
		for _, c := range []struct {
			status   int
			body     string
			want     int
			code     string
			wantText string
		}{
			{503, `{"error":{"message":"busy"}}`, 503, "decode_unavailable", "busy"},
			{400, `{"message":"top-level message"}`, 400, "decode_bad_request", "top-level message"},
			{429, `{"error":{"message":"slow down"}}`, 500, "decode_error", "slow down"},
			{422, `raw text`, 500, "decode_error", "raw text"},
		} {
			s.reset()
			s.D.UpdateConfig(func(cfg *sglang.Config) { cfg.FailStatus, cfg.FailBody = c.status, c.body })
			r := post(t, s.GW.URL+"/v1/chat/completions", chatBody, nil)
			require.Equal(t, c.want, r.Status, "decode %d: %s", c.status, r.Body)
			code, msg, _ := errorBody(t, r)
			assert.Equal(t, c.code, code)
			assert.Equal(t, c.wantText, msg)
			// The prefill, waiting for a decode that never joins, is cancelled.
			waitFor(t, 5*time.Second, func() bool { return len(eventsWith(s.P.Events(), "aborted")) == 1 },
				"prefill leg should be cancelled, events: %+v", s.P.Events())
		}
		s.D.UpdateConfig(func(cfg *sglang.Config) { cfg.FailStatus, cfg.FailBody = 0, "" })
	})
	ok()

	t.Run("decode-error-stream-is-one-sse-frame", func(t *testing.T) {
		s.reset()
		s.D.UpdateConfig(func(cfg *sglang.Config) { cfg.FailStatus, cfg.FailBody = 500, `{"error":{"message":"boom"}}` })
		defer s.D.UpdateConfig(func(cfg *sglang.Config) { cfg.FailStatus, cfg.FailBody = 0, "" })
		r := post(t, s.GW.URL+"/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],"stream":true}`, nil)
		require.Equal(t, 500, r.Status)
		assert.Equal(t, "text/event-stream", r.Header.Get("Content-Type"))
		assert.Equal(t, `data: {"error":{"message":{"error":{"message":"boom"}},"status":500}}`+"\n\n", string(r.Body))
	})
	ok()

	t.Run("stream-commits-on-heads-and-prefill-drains", func(t *testing.T) {
		s.reset()
		s.P.UpdateConfig(func(c *sglang.Config) { c.HoldBodyOpen = 1500 * time.Millisecond })
		defer s.P.UpdateConfig(func(c *sglang.Config) { c.HoldBodyOpen = 0 })
		start := time.Now()
		r := post(t, s.GW.URL+"/v1/chat/completions", `{"messages":[{"role":"user","content":"x y"}],"max_tokens":4,"stream":true}`, nil)
		require.Equal(t, 200, r.Status)
		assert.Less(t, time.Since(start), 1400*time.Millisecond, "the client stream must not wait for the prefill body")
		// The prefill body must still be read to its end: closing it early aborts the KV transfer.
		time.Sleep(1800 * time.Millisecond)
		assert.Empty(t, eventsWith(s.P.Events(), "client_closed_early"), "gateway closed the prefill body early: %+v", s.P.Events())
	})
}

func TestSGLangPrefillUnreachableAndHanging(t *testing.T) {
	d := startFake(t, fastFake(sglang.Decode))
	p := startFake(t, fastFake(sglang.Prefill))
	dead := "http://127.0.0.1:" + strconv.Itoa(freePort(t))
	t.Run("unreachable", func(t *testing.T) {
		// Health checks would keep a dead worker out of selection; this checks the transport error.
		gw := startGateway(t, gwOpts{Prefills: []prefillSpec{{URL: dead, Port: "8998"}}, Decodes: []string{d.URL()},
			Extra: []string{"--disable-health-check"}})
		start := time.Now()
		r := post(t, gw.URL+"/v1/chat/completions", chatBody, nil)
		require.Equal(t, 502, r.Status, "body: %s", r.Body)
		code, msg, _ := errorBody(t, r)
		assert.Equal(t, "PD disaggregation request failed", code)
		assert.True(t, strings.HasPrefix(msg, "Transport error:"), msg)
		assert.Less(t, time.Since(start), 5*time.Second)
	})
	t.Run("decode-unreachable", func(t *testing.T) {
		p.Reset()
		gw := startGateway(t, gwOpts{Prefills: []prefillSpec{{URL: p.URL(), Port: strconv.Itoa(p.BootstrapPort())}},
			Decodes: []string{dead}, Extra: []string{"--disable-health-check"}})
		r := post(t, gw.URL+"/v1/chat/completions", chatBody, nil)
		require.Equal(t, 502, r.Status, "body: %s", r.Body)
		code, msg, _ := errorBody(t, r)
		assert.Equal(t, "PD disaggregation request failed", code)
		assert.True(t, strings.HasPrefix(msg, "Transport error:"), msg)
		assert.NotEmpty(t, r.Header.Get("x-request-id"))
		assert.Empty(t, r.Header.Get("x-smg-envoy-reply"), "internal marker must not leak")
		// The prefill, waiting for a decode that will never join, is dropped.
		waitFor(t, 5*time.Second, func() bool { return len(eventsWith(p.Events(), "aborted")) == 1 },
			"prefill should be cancelled, events: %+v", p.Events())
	})
	t.Run("hanging-prefill-ends-within-request-timeout", func(t *testing.T) {
		p.UpdateConfig(func(c *sglang.Config) { c.Hang = true })
		d.UpdateConfig(func(c *sglang.Config) { c.WaitingTimeout = time.Minute })
		gw := startGateway(t, gwOpts{Prefills: []prefillSpec{{URL: p.URL(), Port: strconv.Itoa(p.BootstrapPort())}},
			Decodes: []string{d.URL()}, Extra: []string{"--request-timeout-secs", "2"}})
		start := time.Now()
		r := post(t, gw.URL+"/v1/chat/completions", chatBody, nil)
		el := time.Since(start)
		require.Equal(t, 502, r.Status, "body: %s", r.Body)
		code, msg, _ := errorBody(t, r)
		assert.Equal(t, "PD disaggregation request failed", code)
		assert.Contains(t, msg, "timed out")
		assert.Less(t, el, 6*time.Second)
		assert.GreaterOrEqual(t, el, 1900*time.Millisecond)
	})
}

func TestNoWorkersAndProbes(t *testing.T) {
	p := startFake(t, fastFake(sglang.Prefill))
	d := startFake(t, fastFake(sglang.Decode))
	t.Run("no-decode", func(t *testing.T) {
		gw := startGateway(t, gwOpts{Prefills: []prefillSpec{{URL: p.URL(), Port: "none"}}})
		r := post(t, gw.URL+"/v1/chat/completions", chatBody, nil)
		require.Equal(t, 503, r.Status)
		code, msg, _ := errorBody(t, r)
		assert.Equal(t, "no_available_workers", code)
		assert.Contains(t, msg, "No decode workers available")
		r = do(t, "GET", gw.URL+"/readiness", nil, nil)
		assert.Equal(t, 503, r.Status)
		assert.JSONEq(t, `{"status":"not ready","reason":"insufficient healthy workers"}`, string(r.Body))
		assert.Empty(t, p.Requests())
	})
	t.Run("no-prefill", func(t *testing.T) {
		gw := startGateway(t, gwOpts{Decodes: []string{d.URL()}})
		r := post(t, gw.URL+"/generate", `{"text":"x"}`, nil)
		require.Equal(t, 503, r.Status)
		code, msg, _ := errorBody(t, r)
		assert.Equal(t, "no_available_workers", code)
		assert.Contains(t, msg, "No prefill workers available")
		r = post(t, gw.URL+"/v1/messages/count_tokens", `{"messages":[]}`, nil)
		require.Equal(t, 503, r.Status)
		code, _, _ = errorBody(t, r)
		assert.Equal(t, "no_prefill_servers", code)
		assert.Empty(t, d.Requests())
	})
	t.Run("probes-and-workers", func(t *testing.T) {
		gw := startGateway(t, gwOpts{Prefills: []prefillSpec{{URL: p.URL(), Port: strconv.Itoa(p.BootstrapPort())}}, Decodes: []string{d.URL()}})
		for _, path := range []string{"/liveness", "/health"} {
			r := do(t, "GET", gw.URL+path, nil, nil)
			assert.Equal(t, 200, r.Status)
			assert.Equal(t, "OK", string(r.Body))
		}
		r := do(t, "GET", gw.URL+"/readiness", nil, nil)
		assert.Equal(t, 200, r.Status)
		assert.JSONEq(t, `{"status":"ready","healthy_workers":2,"total_workers":2}`, string(r.Body))
		r = do(t, "GET", gw.URL+"/workers", nil, nil)
		require.Equal(t, 200, r.Status)
		assert.Contains(t, string(r.Body), `"total":2`)
		for _, k := range []string{`"prefill_count":1`, `"decode_count":1`, `"regular_count":0`} {
			assert.Contains(t, string(r.Body), k)
		}
		assert.Contains(t, string(r.Body), `"url":"`+p.URL()+`"`)
		assert.NotContains(t, string(r.Body), "api_key")
	})
}

// TestUpstreamCannotBeChosenByClient: a header naming another address must not
// move the decode leg; only registered workers are contacted.
func TestUpstreamCannotBeChosenByClient(t *testing.T) {
	var rogueHits atomic.Int64
	rogue := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { rogueHits.Add(1) }))
	defer rogue.Close()
	s := newStack(t)
	rogueAddr := strings.TrimPrefix(rogue.URL, "http://")
	for _, h := range []string{"x-gateway-destination-endpoint", "x-envoy-original-dst-host", "x-smg-target-worker"} {
		r := post(t, s.GW.URL+"/v1/chat/completions", chatBody, map[string]string{h: rogueAddr})
		require.Equal(t, 200, r.Status, "header %s: %s", h, r.Body)
		assert.Equal(t, s.D.URL(), r.Header.Get("x-smg-routed-worker-id"))
	}
	assert.Zero(t, rogueHits.Load(), "a client header reached an unregistered address")
	_ = context.Background
}

// TestDestinationHeader: with --destination-header (for Envoy Gateway) the
// decode's x-gateway-destination-endpoint is the processor's choice, never
// the client's.
func TestDestinationHeader(t *testing.T) {
	s := newStack(t, "--destination-header")
	r := post(t, s.GW.URL+"/v1/chat/completions", chatBody, map[string]string{"X-Gateway-Destination-Endpoint": "10.9.9.9:1"})
	require.Equal(t, 200, r.Status, "%s", r.Body)
	got := onlyRequest(t, "decode", s.D.Requests()).Header.Values("X-Gateway-Destination-Endpoint")
	require.Len(t, got, 1)
	assert.Equal(t, strings.TrimPrefix(s.D.URL(), "http://"), got[0])
	assert.Empty(t, onlyRequest(t, "prefill", s.P.Requests()).Header.Get("X-Gateway-Destination-Endpoint"))
}
