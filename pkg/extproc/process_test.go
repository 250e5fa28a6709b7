package extproc_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/smg-project/smg-extproc/pkg/workers"
)

// 1. Happy path, non-streamed chat.
func TestHappyPathChat(t *testing.T) {
	const body = `{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":0.95,"top_p":0.7,"extra":{"k":[1,2]}}`
	tests := []struct {
		name      string
		clientRID string // "" = the gateway mints one
	}{
		{name: "client request id", clientRID: "client-rid-1"},
		{name: "generated request id"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := newPD(t, 0, replyWith(200, `{"id":"p","choices":[]}`))
			s := e.open(t)

			hdrs := []string{
				"host", "gateway.local",
				"content-type", "application/json",
				"content-length", strconv.Itoa(len(body)),
				"x-custom", "1",
				"cookie", "a=b",
				"user-agent", "curl/8",
				"accept", "*/*",
				"authorization", "Bearer tok",
				"traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
				"x-request-id-extra", "e1",
				"x-smg-routing-key", "rk",
			}
			if tc.clientRID != "" {
				hdrs = append(hdrs, "x-request-id", tc.clientRID)
			}
			hdrAns, bodyAns := s.dispatch(t, "/v1/chat/completions?foo=bar&x=1", body, hdrs...)

			// Request headers: non-allowlisted client headers are removed.
			rm := hdrAns.GetRequestHeaders().GetResponse().GetHeaderMutation().GetRemoveHeaders()
			for _, h := range []string{"x-custom", "cookie", "user-agent", "accept"} {
				assert.Contains(t, rm, h)
			}
			for _, h := range []string{"authorization", "traceparent", "x-request-id-extra", "x-smg-routing-key", "x-request-id",
				":path", ":method", ":authority", "host", "content-length"} {
				assert.NotContains(t, rm, h)
			}
			assert.Nil(t, hdrAns.GetModeOverride())

			// Request body: decode leg body, headers and destination.
			rb := bodyAns.GetRequestBody()
			require.NotNil(t, rb, "request body answer: %v", bodyAns)
			dBody := rb.GetResponse().GetBodyMutation().GetBody()
			require.NotEmpty(t, dBody)
			m := decodeJSON(t, dBody)
			assert.Equal(t, "127.0.0.1", m["bootstrap_host"])
			assert.Equal(t, json.Number("8998"), m["bootstrap_port"])
			room, ok := m["bootstrap_room"].(json.Number)
			require.True(t, ok, "bootstrap_room must be a number: %s", dBody)
			r, err := strconv.ParseUint(room.String(), 10, 64)
			require.NoError(t, err)
			assert.NotZero(t, r)
			assert.LessOrEqual(t, r, uint64(1<<63-1))
			// The client's bytes survive (numbers, order, unknown fields).
			assert.True(t, bytes.HasPrefix(dBody, []byte(body[:len(body)-1])), "client bytes must be kept: %s", dBody)
			set := setHeaders(rb.GetResponse().GetHeaderMutation())
			assert.Equal(t, strconv.Itoa(len(dBody)), set["content-length"])
			assert.Equal(t, "/v1/chat/completions", set[":path"])
			assert.Equal(t, "application/json", set["content-type"])
			assert.Equal(t, e.dw.Addr, destination(bodyAns))
			assert.Equal(t, "10.0.0.2:8000", destination(bodyAns))

			// Prefill leg: same bytes, allowlisted headers only.
			got := e.prefill.request(t)
			assert.Equal(t, "/v1/chat/completions", got.Path)
			assert.Empty(t, got.Query, "query string must not be forwarded")
			assert.Equal(t, string(dBody), string(got.Body))
			want := http.Header{
				"Authorization":      {"Bearer tok"},
				"Traceparent":        {"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
				"X-Request-Id-Extra": {"e1"},
				"X-Smg-Routing-Key":  {"rk"},
				"Content-Type":       {"application/json"},
			}
			if tc.clientRID != "" {
				want["X-Request-Id"] = []string{tc.clientRID}
			}
			gotH := got.Header.Clone()
			gotH.Del("Content-Length") // framing, not a forwarded header
			assert.Equal(t, want, gotH)

			// Decode head 200: commit with the routing headers.
			s.send(respHeaders(200, false, "content-type", "application/json"))
			ans := s.recv(t)
			rh := ans.GetResponseHeaders()
			require.NotNil(t, rh, "response headers answer: %v", ans)
			assert.Nil(t, ans.GetModeOverride())
			hs := setHeaders(rh.GetResponse().GetHeaderMutation())
			assert.Equal(t, decodeURL, hs["x-smg-routed-worker-id"])
			if tc.clientRID != "" {
				assert.Equal(t, tc.clientRID, hs["x-request-id"])
			} else {
				assert.Regexp(t, `^chatcmpl-[A-Za-z0-9]{24}$`, hs["x-request-id"])
			}
			assert.NotContains(t, hs, "content-type", "non-streamed: the engine's content-type is kept")

			// The response body passes through untouched.
			s.send(respBody(`{"id":"d"}`, true))
			ans = s.recv(t)
			require.NotNil(t, ans.GetResponseBody())
			assert.Nil(t, ans.GetResponseBody().GetResponse().GetBodyMutation())

			require.NoError(t, s.end())
			requireIdle(t, e.pw, e.dw)
			// The prefill duration is observed after the in-flight release.
			assert.Eventually(t, func() bool { return e.histogramCount(t, "smg_pd_prefill_duration_seconds") == 1 }, wait, 2*time.Millisecond)
			assert.EqualValues(t, 1, e.histogramCount(t, "smg_router_request_duration_seconds"))
		})
	}
}

// Bootstrap fields and leg bodies for the route/body shapes that change them.
func TestLegBodies(t *testing.T) {
	tests := []struct {
		name         string
		prefillURL   func(base string) string
		decodeURL    string
		path         string
		body         string
		wantUpstream string
		check        func(t *testing.T, prefill, decode map[string]any)
	}{
		{
			name: "rerank maps to /v1/rerank", path: "/rerank", wantUpstream: "/v1/rerank",
			body: `{"query":"q","documents":["a","b"],"stream":true}`,
			check: func(t *testing.T, p, d map[string]any) {
				assert.Equal(t, "127.0.0.1", d["bootstrap_host"])
				assert.NotNil(t, d["bootstrap_room"])
				assert.Equal(t, true, d["stream"], "rerank's stream key is not interpreted but kept")
			},
		},
		{
			name: "v1 rerank", path: "/v1/rerank", wantUpstream: "/v1/rerank",
			body:  `{"query":"q","documents":["a"]}`,
			check: func(t *testing.T, p, d map[string]any) { assert.NotNil(t, d["bootstrap_room"]) },
		},
		{
			name: "chat n=3 gets list-valued bootstrap fields", path: "/v1/chat/completions", wantUpstream: "/v1/chat/completions",
			body: `{"messages":[{"role":"user","content":"x"}],"n":3,"bootstrap_room":5}`,
			check: func(t *testing.T, p, d map[string]any) {
				assert.Equal(t, []any{"127.0.0.1", "127.0.0.1", "127.0.0.1"}, d["bootstrap_host"])
				assert.Equal(t, []any{json.Number("8998"), json.Number("8998"), json.Number("8998")}, d["bootstrap_port"])
				rooms, ok := d["bootstrap_room"].([]any)
				require.True(t, ok)
				require.Len(t, rooms, 3)
				assert.NotEqual(t, rooms[0], rooms[1])
				assert.NotEqual(t, rooms[1], rooms[2])
				assert.NotEqual(t, json.Number("5"), rooms[0], "client room is overwritten")
			},
		},
		{
			name:       "DP ranks",
			prefillURL: func(base string) string { return base + "@1" },
			decodeURL:  decodeURL + "@3",
			path:       "/generate", wantUpstream: "/generate",
			body: `{"text":"hello","sampling_params":{"max_new_tokens":1}}`,
			check: func(t *testing.T, p, d map[string]any) {
				assert.Equal(t, json.Number("1"), p["routed_dp_rank"])
				assert.NotContains(t, p, "disagg_prefill_dp_rank")
				assert.Equal(t, json.Number("1"), d["disagg_prefill_dp_rank"])
				assert.Equal(t, json.Number("3"), d["routed_dp_rank"])
				assert.Equal(t, p["bootstrap_room"], d["bootstrap_room"])
			},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := newPrefill(t, replyWith(200, `{}`))
			purl := f.URL
			if tc.prefillURL != nil {
				purl = tc.prefillURL(f.URL)
			}
			durl := decodeURL
			if tc.decodeURL != "" {
				durl = tc.decodeURL
			}
			pw := newWorker(t, purl, workers.Prefill, intp(8998))
			dw := newWorker(t, durl, workers.Decode, nil)
			e := newEnv(t, 0, pw, dw)
			s := e.open(t)
			_, bodyAns := s.dispatch(t, tc.path, tc.body)
			rb := bodyAns.GetRequestBody()
			require.NotNil(t, rb, "request body answer: %v", bodyAns)
			dBody := rb.GetResponse().GetBodyMutation().GetBody()
			set := setHeaders(rb.GetResponse().GetHeaderMutation())
			assert.Equal(t, tc.wantUpstream, set[":path"])
			assert.Equal(t, strconv.Itoa(len(dBody)), set["content-length"])
			assert.Equal(t, "10.0.0.2:8000", destination(bodyAns))

			got := f.request(t)
			assert.Equal(t, tc.wantUpstream, got.Path)
			tc.check(t, decodeJSON(t, got.Body), decodeJSON(t, dBody))

			s.send(respHeaders(200, false))
			ans := s.recv(t)
			assert.Equal(t, durl, setHeaders(ans.GetResponseHeaders().GetResponse().GetHeaderMutation())["x-smg-routed-worker-id"])
			require.NoError(t, s.end())
			requireIdle(t, pw, dw)
		})
	}
}

// 2. count_tokens: one prefill POST, no bootstrap fields, answer relayed.
func TestCountTokens(t *testing.T) {
	const body = `{"model":"m","messages":[{"role":"user","content":"count me"}]}`
	tests := []struct {
		name       string
		status     int
		ctype      string
		respBody   string
		clientAuth string
		apiKey     string
		wantAuth   string
	}{
		{name: "ok, client auth wins", status: 200, ctype: "application/json", respBody: `{"input_tokens":7}`,
			clientAuth: "Bearer client", apiKey: "secret", wantAuth: "Bearer client"},
		{name: "error relayed as is, worker key used", status: 422, ctype: "text/plain", respBody: "nope",
			apiKey: "secret", wantAuth: "Bearer secret"},
		{name: "no auth at all", status: 200, ctype: "application/json", respBody: `{"input_tokens":1}`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := newPrefill(t, func(w http.ResponseWriter, _ *http.Request, _ *prefillFake) {
				w.Header().Set("Content-Type", tc.ctype)
				w.WriteHeader(tc.status)
				_, _ = io.WriteString(w, tc.respBody)
			})
			pw, err := workers.New(workers.Spec{URL: f.URL, Type: workers.Prefill, BootstrapPort: intp(8998), APIKey: tc.apiKey}, nil)
			require.NoError(t, err)
			pw.SetHealthy(true)
			dw := newWorker(t, decodeURL, workers.Decode, nil)
			e := newEnv(t, 0, pw, dw)
			s := e.open(t)
			hdrs := []string{"content-type", "application/json", "x-custom", "1"}
			if tc.clientAuth != "" {
				hdrs = append(hdrs, "authorization", tc.clientAuth)
			}
			_, ans := s.dispatch(t, "/v1/messages/count_tokens", body, hdrs...)
			im, h := requireImmediate(t, ans, tc.status)
			assert.Equal(t, tc.respBody, string(im.GetBody()))
			assert.Equal(t, tc.ctype, h["content-type"])
			assert.Equal(t, pw.URL, h["x-smg-routed-worker-id"])
			assert.Regexp(t, `^msg_[A-Za-z0-9]{24}$`, h["x-request-id"])
			assert.NotContains(t, h, "x-smg-error-code")

			got := f.request(t)
			assert.Equal(t, "/v1/messages/count_tokens", got.Path)
			assert.Equal(t, body, string(got.Body), "count_tokens gets the client's bytes, no bootstrap fields")
			assert.Equal(t, tc.wantAuth, got.Header.Get("Authorization"))
			assert.Empty(t, got.Header.Get("X-Custom"))
			assert.EqualValues(t, 1, f.hits.Load())
			require.NoError(t, s.end())
			requireIdle(t, pw, dw)
			assert.Zero(t, dw.Load())
		})
	}

	t.Run("prefill unreachable", func(t *testing.T) {
		pw := newWorker(t, closedURL(t), workers.Prefill, nil)
		e := newEnv(t, 0, pw, newWorker(t, decodeURL, workers.Decode, nil))
		s := e.open(t)
		_, ans := s.dispatch(t, "/v1/messages/count_tokens", body)
		msg := requireAPIError(t, ans, 502, "prefill_count_tokens_failed")
		assert.True(t, strings.HasPrefix(msg, "Failed to count tokens on prefill worker: "), msg)
	})
	t.Run("no prefill worker", func(t *testing.T) {
		e := newEnv(t, 0, newWorker(t, decodeURL, workers.Decode, nil))
		s := e.open(t)
		_, ans := s.dispatch(t, "/v1/messages/count_tokens", body)
		assert.Equal(t, "No available prefill servers to count tokens", requireAPIError(t, ans, 503, "no_prefill_servers"))
	})
}

// 3 + 4. The prefill fails while Envoy waits for the decode head: the
// processor answers spontaneously.
func TestPrefillFailsBeforeDecodeHead(t *testing.T) {
	tests := []struct {
		name     string
		status   int    // prefill status; 0 = unreachable
		body     string // prefill body
		wantCode string
		wantSt   int
		wantMsg  func(t *testing.T, msg string)
	}{
		{name: "400", status: 400, body: "bad", wantSt: 400, wantCode: "prefill_bad_request",
			wantMsg: func(t *testing.T, msg string) { assert.Equal(t, "Prefill server error (400 Bad Request): bad", msg) }},
		{name: "503", status: 503, body: `{"error":"overloaded"}`, wantSt: 503, wantCode: "prefill_unavailable",
			wantMsg: func(t *testing.T, msg string) {
				assert.Equal(t, `Prefill server error (503 Service Unavailable): {"error":"overloaded"}`, msg)
			}},
		{name: "429 becomes 500", status: 429, body: "slow", wantSt: 500, wantCode: "prefill_error",
			wantMsg: func(t *testing.T, msg string) {
				assert.Equal(t, "Prefill server error (429 Too Many Requests): slow", msg)
			}},
		{name: "unreachable", status: 0, wantSt: 502, wantCode: "PD disaggregation request failed",
			wantMsg: func(t *testing.T, msg string) { assert.True(t, strings.HasPrefix(msg, "Transport error: "), msg) }},
	}
	for _, tc := range tests {
		for _, stream := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/stream=%v", tc.name, stream), func(t *testing.T) {
				var url string
				var f *prefillFake
				if tc.status == 0 {
					url = closedURL(t)
				} else {
					f = newPrefill(t, replyWith(tc.status, tc.body))
					url = f.URL
				}
				pw := newWorker(t, url, workers.Prefill, nil)
				dw := newWorker(t, decodeURL, workers.Decode, nil)
				e := newEnv(t, 0, pw, dw)
				s := e.open(t)
				_, bodyAns := s.dispatch(t, "/v1/chat/completions",
					fmt.Sprintf(`{"messages":[{"role":"user","content":"x"}],"stream":%v}`, stream))
				require.NotNil(t, bodyAns.GetRequestBody(), "the body is answered before the prefill outcome: %v", bodyAns)

				// No response headers sent: the answer is spontaneous.
				ans := s.recv(t)
				tc.wantMsg(t, requireAPIError(t, ans, tc.wantSt, tc.wantCode))

				// Envoy may still deliver the decode head it raced with; it is passed through.
				s.send(respHeaders(200, false))
				ans = s.recv(t)
				require.NotNil(t, ans.GetResponseHeaders(), "%v", ans)
				assert.Empty(t, ans.GetResponseHeaders().GetResponse().GetHeaderMutation().GetSetHeaders())

				require.NoError(t, s.end())
				requireIdle(t, pw, dw)
			})
		}
	}
}

// The prefill fails after the decode head arrived: the processor was waiting
// on the prefill and answers with the prefill error (not committed).
func TestPrefillFailsAfterDecodeHead(t *testing.T) {
	for _, stream := range []bool{false, true} {
		t.Run(fmt.Sprintf("stream=%v", stream), func(t *testing.T) {
			release := make(chan struct{})
			e := newPD(t, 0, func(w http.ResponseWriter, r *http.Request, f *prefillFake) {
				select {
				case <-release:
				case <-f.stop:
					return
				}
				w.WriteHeader(503)
				_, _ = io.WriteString(w, "overloaded")
			})
			s := e.open(t)
			_, bodyAns := s.dispatch(t, "/v1/chat/completions",
				fmt.Sprintf(`{"messages":[{"role":"user","content":"x"}],"stream":%v}`, stream))
			require.NotNil(t, bodyAns.GetRequestBody())
			e.prefill.request(t)
			s.send(respHeaders(200, false))
			close(release)
			// Whether the processor saw the decode head first or not, the
			// first answer is the prefill error.
			ans := s.recv(t)
			msg := requireAPIError(t, ans, 503, "prefill_unavailable")
			assert.Equal(t, "Prefill server error (503 Service Unavailable): overloaded", msg)
			require.NoError(t, s.end())
			requireIdle(t, e.pw, e.dw)
		})
	}
}

// 5. Decode non-2xx heads.
func TestDecodeErrors(t *testing.T) {
	tests := []struct {
		name       string
		stream     bool
		status     int
		body       string // "" with headEOS
		headEOS    bool
		wantStatus int
		wantCode   string // "" for the stream SSE frame
		wantMsg    string
		wantFrame  string
	}{
		{name: "503 busy", status: 503, body: `{"error":{"message":"busy"}}`, wantStatus: 503, wantCode: "decode_unavailable", wantMsg: "busy"},
		{name: "429 becomes 500", status: 429, body: `{"message":"slow down"}`, wantStatus: 500, wantCode: "decode_error", wantMsg: "slow down"},
		{name: "400 raw text", status: 400, body: "plain text", wantStatus: 400, wantCode: "decode_bad_request", wantMsg: "plain text"},
		{name: "404", status: 404, body: `{"detail":"x"}`, wantStatus: 404, wantCode: "decode_not_found", wantMsg: `{"detail":"x"}`},
		{name: "502 no body", status: 502, headEOS: true, wantStatus: 502, wantCode: "decode_bad_gateway", wantMsg: ""},
		{name: "stream 500 json", stream: true, status: 500, body: "{\"error\": {\"message\": \"boom\"}}\n", wantStatus: 500,
			wantFrame: "data: {\"error\":{\"message\":{\"error\":{\"message\":\"boom\"}},\"status\":500}}\n\n"},
		{name: "stream 429 text", stream: true, status: 429, body: "too \"many\"", wantStatus: 429,
			wantFrame: "data: {\"error\":{\"message\":\"too \\\"many\\\"\",\"status\":429}}\n\n"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := newPD(t, 0, replyWith(200, `{}`))
			s := e.open(t)
			_, bodyAns := s.dispatch(t, "/v1/chat/completions",
				fmt.Sprintf(`{"messages":[{"role":"user","content":"x"}],"stream":%v}`, tc.stream))
			require.NotNil(t, bodyAns.GetRequestBody())
			e.prefill.request(t)

			s.send(respHeaders(tc.status, tc.headEOS, "content-type", "application/json"))
			ans := s.recv(t)
			if !tc.headEOS {
				require.NotNil(t, ans.GetResponseHeaders(), "%v", ans)
				mo := ans.GetModeOverride()
				require.NotNil(t, mo, "a decode error needs the body buffered")
				assert.Equal(t, filterv3.ProcessingMode_BUFFERED, mo.GetResponseBodyMode())
				s.send(respBody(tc.body, true))
				ans = s.recv(t)
			}
			if tc.wantFrame != "" {
				im, h := requireImmediate(t, ans, tc.wantStatus)
				assert.Equal(t, "text/event-stream", h["content-type"])
				assert.Equal(t, tc.wantFrame, string(im.GetBody()))
				assert.NotEmpty(t, h["x-request-id"])
				assert.NotContains(t, h, "x-smg-error-code")
				line := strings.TrimSuffix(strings.TrimPrefix(string(im.GetBody()), "data: "), "\n\n")
				assert.True(t, json.Valid([]byte(line)), "the SSE frame carries one JSON document: %q", line)
			} else {
				assert.Equal(t, tc.wantMsg, requireAPIError(t, ans, tc.wantStatus, tc.wantCode))
			}
			require.NoError(t, s.end())
			requireIdle(t, e.pw, e.dw)
		})
	}
}

// A decode error wins over a prefill that has not answered, and the prefill
// leg is cancelled.
func TestDecodeErrorWinsAndAbortsPrefill(t *testing.T) {
	cancelled := make(chan struct{})
	e := newPD(t, 0, func(w http.ResponseWriter, r *http.Request, f *prefillFake) {
		select {
		case <-r.Context().Done():
			close(cancelled)
		case <-f.stop:
		}
	})
	s := e.open(t)
	_, bodyAns := s.dispatch(t, "/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}]}`)
	require.NotNil(t, bodyAns.GetRequestBody())
	e.prefill.request(t)
	s.send(respHeaders(503, false))
	ans := s.recv(t)
	require.NotNil(t, ans.GetModeOverride(), "%v", ans)
	s.send(respBody(`{"error":{"message":"busy"}}`, true))
	assert.Equal(t, "busy", requireAPIError(t, s.recv(t), 503, "decode_unavailable"))
	select {
	case <-cancelled:
	case <-time.After(wait):
		t.Fatal("the prefill leg was not cancelled after the decode error")
	}
	require.NoError(t, s.end())
	requireIdle(t, e.pw, e.dw)
}

// 6. A streamed request commits on the prefill head, and the prefill body is
// still drained to EOF after the client stream ended.
func TestStreamCommitsOnPrefillHeadAndDrains(t *testing.T) {
	release := make(chan struct{})
	drained := make(chan error, 1)
	const tail = 8 << 20 // more than socket buffers: only a reading client lets this finish
	e := newPD(t, 0, func(w http.ResponseWriter, r *http.Request, f *prefillFake) {
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(200)
		_, _ = io.WriteString(w, "data: {\"text\":\"a\"}\n\n")
		w.(http.Flusher).Flush()
		select {
		case <-release:
		case <-r.Context().Done():
			drained <- fmt.Errorf("prefill request cancelled before its body was finished: %w", r.Context().Err())
			return
		case <-f.stop:
			drained <- fmt.Errorf("test ended")
			return
		}
		chunk := bytes.Repeat([]byte("x"), 64<<10)
		for n := 0; n < tail; n += len(chunk) {
			if _, err := w.Write(chunk); err != nil {
				drained <- fmt.Errorf("write after %d bytes: %w", n, err)
				return
			}
		}
		_, err := io.WriteString(w, "data: [DONE]\n\n")
		drained <- err
	})
	s := e.open(t)
	_, bodyAns := s.dispatch(t, "/generate", `{"text":"hi","stream":true}`)
	require.NotNil(t, bodyAns.GetRequestBody())
	e.prefill.request(t)

	s.send(respHeaders(200, false, "content-type", "text/event-stream"))
	ans := s.recv(t) // must not wait for the prefill body
	rh := ans.GetResponseHeaders()
	require.NotNil(t, rh, "%v", ans)
	hs := setHeaders(rh.GetResponse().GetHeaderMutation())
	assert.Equal(t, "text/event-stream", hs["content-type"])
	assert.Equal(t, decodeURL, hs["x-smg-routed-worker-id"])
	assert.Regexp(t, `^gnt-[A-Za-z0-9]{24}$`, hs["x-request-id"])
	assert.Nil(t, ans.GetModeOverride())
	select {
	case err := <-drained:
		t.Fatalf("the prefill handler ended before the commit was checked: %v", err)
	default:
	}
	assert.EqualValues(t, 1, e.pw.Load(), "the prefill stays in flight while its body drains")

	// The decode stream completes and Envoy closes the ext_proc stream
	// (and gRPC cancels its context) while the prefill body is still open.
	s.send(respBody("data: {\"text\":\"b\"}\n\n", false))
	require.NotNil(t, s.recv(t).GetResponseBody())
	require.NoError(t, s.end())
	assert.Zero(t, e.dw.Load())

	close(release)
	select {
	case err := <-drained:
		require.NoError(t, err, "the prefill body must be read to EOF")
	case <-time.After(wait):
		t.Fatal("the prefill body was not drained within 5s")
	}
	requireIdle(t, e.pw)
	require.Eventually(t, func() bool { return e.histogramCount(t, "smg_pd_prefill_duration_seconds") == 1 }, wait, 2*time.Millisecond)
}

// Regression: on the streamed early commit the processor reads the prefill's
// body error while the drain goroutine may still be writing it. The prefill
// below finishes its body shortly after its head, with no happens-before edge
// from the processor's commit to the drain's end, so `go test -race` reports
// the unsynchronised access (exchange.go onResponseHeaders reads
// x.prefill.bodyErr without x.prefill.mu; prefill.go run writes it under mu).
// The short delay in the handler only shapes timing (the body ends after the
// commit); nothing waits on it. The test deliberately creates no timers
// between the commit and the end of the drain: the race detector joins the
// clocks of timers firing on one P, which would hide the race.
func TestStreamCommitDoesNotRaceTheDrain(t *testing.T) {
	handlerDone := make(chan struct{})
	e := newPD(t, 0, func(w http.ResponseWriter, r *http.Request, f *prefillFake) {
		defer close(handlerDone)
		w.WriteHeader(200)
		w.(http.Flusher).Flush()
		select {
		case <-time.After(50 * time.Millisecond):
		case <-f.stop:
		}
		_, _ = io.WriteString(w, "data: [DONE]\n\n")
	})
	s := e.open(t)
	_, bodyAns := s.dispatch(t, "/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],"stream":true}`)
	require.NotNil(t, bodyAns.GetRequestBody())
	s.send(respHeaders(200, false))
	require.NotNil(t, s.recv(t).GetResponseHeaders())
	select {
	case <-handlerDone:
	case <-time.After(wait):
		t.Fatal("the prefill handler did not finish")
	}
	// The drain has finished once the prefill's in-flight count is released.
	for deadline := time.Now().Add(wait); e.pw.Load() != 0; runtime.Gosched() {
		require.False(t, time.Now().After(deadline), "the prefill drain did not finish")
	}
	require.NoError(t, s.end())
}

// 7. Non-streamed /generate with return_logprob: the decode body is buffered
// and gets the prefill's input_token_logprobs prepended.
func TestGenerateLogprobMerge(t *testing.T) {
	const prefillBody = `{"text":"","meta_info":{"id":"p","input_token_logprobs":[[-0.1,11,null],[-0.25,12,null]]}}`
	tests := []struct {
		name       string
		decodeBody string
		want       string // exact merged body
	}{
		{
			name:       "merged",
			decodeBody: `{"text":"out", "meta_info": {"id":"d","input_token_logprobs":[[-0.5, 13, null]],"completion_tokens":2}}`,
			want:       `{"text":"out","meta_info":{"id":"d","input_token_logprobs":[[-0.1,11,null],[-0.25,12,null],[-0.5,13,null]],"completion_tokens":2}}`,
		},
		{
			name:       "decode has no array: body unchanged",
			decodeBody: `{"text":"out","meta_info":{"id":"d"}}`,
			want:       `{"text":"out","meta_info":{"id":"d"}}`,
		},
		{
			name:       "decode not JSON: raw body",
			decodeBody: `not json`,
			want:       `not json`,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := newPD(t, 0, replyWith(200, prefillBody))
			s := e.open(t)
			_, bodyAns := s.dispatch(t, "/generate", `{"text":"hi","return_logprob":true,"sampling_params":{"max_new_tokens":2}}`)
			require.NotNil(t, bodyAns.GetRequestBody())
			e.prefill.request(t)

			s.send(respHeaders(200, false, "content-type", "application/json", "content-length", strconv.Itoa(len(tc.decodeBody))))
			ans := s.recv(t)
			require.NotNil(t, ans.GetResponseHeaders(), "%v", ans)
			require.NotNil(t, ans.GetModeOverride())
			assert.Equal(t, filterv3.ProcessingMode_BUFFERED, ans.GetModeOverride().GetResponseBodyMode())
			hs := setHeaders(ans.GetResponseHeaders().GetResponse().GetHeaderMutation())
			assert.Equal(t, decodeURL, hs["x-smg-routed-worker-id"])

			s.send(respBody(tc.decodeBody, true))
			ans = s.recv(t)
			rb := ans.GetResponseBody()
			require.NotNil(t, rb, "%v", ans)
			out := rb.GetResponse().GetBodyMutation().GetBody()
			assert.Equal(t, tc.want, string(out))
			set := setHeaders(rb.GetResponse().GetHeaderMutation())
			assert.Equal(t, "application/json", set["content-type"])
			assert.Equal(t, strconv.Itoa(len(out)), set["content-length"])
			require.NoError(t, s.end())
			requireIdle(t, e.pw, e.dw)
		})
	}
}

// Streamed /generate with return_logprob: a prefill that answered one JSON
// document has its logprobs prepended to each decode SSE chunk; an SSE prefill
// (what a streamed request normally gets) has nothing to merge.
func TestGenerateStreamLogprobMerge(t *testing.T) {
	chunk := "data: {\"text\":\"a\",\"meta_info\":{\"input_token_logprobs\":[[-0.2,12,null]]}}\n\n"
	tests := []struct {
		name        string
		prefillBody string
		wantMode    bool // STREAMED override and rewritten chunks
		wantChunk   string
	}{
		{name: "JSON prefill", prefillBody: `{"meta_info":{"input_token_logprobs":[[-0.1,11,null]]}}`, wantMode: true,
			wantChunk: "data: {\"text\":\"a\",\"meta_info\":{\"input_token_logprobs\":[[-0.1,11,null],[-0.2,12,null]]}}\n\n"},
		{name: "SSE prefill", prefillBody: "data: {\"meta_info\":{\"input_token_logprobs\":[[-0.1,11,null]]}}\n\ndata: [DONE]\n\n"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := newPD(t, 0, replyWith(200, tc.prefillBody))
			s := e.open(t)
			_, bodyAns := s.dispatch(t, "/generate", `{"text":"hi","return_logprob":true,"stream":true}`)
			require.NotNil(t, bodyAns.GetRequestBody())
			s.send(respHeaders(200, false, "content-type", "text/event-stream"))
			ans := s.recv(t)
			require.NotNil(t, ans.GetResponseHeaders(), "%v", ans)
			assert.Equal(t, "text/event-stream", setHeaders(ans.GetResponseHeaders().GetResponse().GetHeaderMutation())["content-type"])
			if !tc.wantMode {
				assert.Nil(t, ans.GetModeOverride())
				require.NoError(t, s.end())
				requireIdle(t, e.pw, e.dw)
				return
			}
			require.NotNil(t, ans.GetModeOverride())
			assert.Equal(t, filterv3.ProcessingMode_STREAMED, ans.GetModeOverride().GetResponseBodyMode())

			s.send(respBody(chunk, false))
			ans = s.recv(t)
			assert.Equal(t, tc.wantChunk, string(ans.GetResponseBody().GetResponse().GetBodyMutation().GetBody()))
			s.send(respBody("data: [DONE]\n\n", true))
			ans = s.recv(t)
			assert.Equal(t, "data: [DONE]\n\n", string(ans.GetResponseBody().GetResponse().GetBodyMutation().GetBody()))
			require.NoError(t, s.end())
			requireIdle(t, e.pw, e.dw)
		})
	}
}

// 8. Bodies rejected before any leg is sent.
func TestInvalidRequests(t *testing.T) {
	tests := []struct {
		name      string
		path      string
		headerEOS bool   // request headers end the stream: no body
		body      string // used unless headerEOS
		bodyEOS   bool
		status    int
		code      string
		msgPrefix string
	}{
		{name: "empty body (headers end_of_stream)", path: "/v1/chat/completions", headerEOS: true, status: 400, code: "json_parse_error",
			msgPrefix: "Failed to parse the request body as JSON: empty body"},
		{name: "empty body message", path: "/v1/chat/completions", body: "", bodyEOS: true, status: 400, code: "json_parse_error",
			msgPrefix: "Failed to parse the request body as JSON: "},
		{name: "whitespace", path: "/generate", body: " \n ", bodyEOS: true, status: 400, code: "json_parse_error",
			msgPrefix: "Failed to parse the request body as JSON: "},
		{name: "malformed", path: "/v1/chat/completions", body: `{"model":`, bodyEOS: true, status: 400, code: "json_parse_error",
			msgPrefix: "Failed to parse the request body as JSON: "},
		{name: "trailing garbage", path: "/v1/completions", body: `{"prompt":"x"} x`, bodyEOS: true, status: 400, code: "json_parse_error",
			msgPrefix: "Failed to parse the request body as JSON: "},
		{name: "array", path: "/v1/chat/completions", body: `[1,2]`, bodyEOS: true, status: 400, code: "invalid_request",
			msgPrefix: "Request body must be a JSON object"},
		{name: "string", path: "/generate", body: `"text"`, bodyEOS: true, status: 400, code: "invalid_request",
			msgPrefix: "Request body must be a JSON object"},
		{name: "stream not bool", path: "/v1/chat/completions", body: `{"stream":"yes"}`, bodyEOS: true, status: 400, code: "invalid_request",
			msgPrefix: "stream must be a boolean"},
		{name: "partial body (not BUFFERED)", path: "/v1/chat/completions", body: `{"a":`, bodyEOS: false, status: 500, code: "internal_error",
			msgPrefix: "ext_proc received a partial request body"},
		{name: "unknown route", path: "/v1/embeddings?x=1", headerEOS: true, status: 404, code: "not_found",
			msgPrefix: "No route for /v1/embeddings"},
		{name: "unknown route with body", path: "/nope", status: 404, code: "not_found", msgPrefix: "No route for /nope"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := newPD(t, 0, replyWith(200, `{}`))
			s := e.open(t)
			s.send(reqHeaders(tc.path, tc.headerEOS, stdHeaders...))
			ans := s.recv(t)
			if ans.GetImmediateResponse() == nil {
				require.False(t, tc.headerEOS, "a body-less request must be answered at the headers")
				require.NotNil(t, ans.GetRequestHeaders())
				s.send(reqBody(tc.body, tc.bodyEOS))
				ans = s.recv(t)
			}
			msg := requireAPIError(t, ans, tc.status, tc.code)
			assert.True(t, strings.HasPrefix(msg, tc.msgPrefix), "message %q", msg)
			require.NoError(t, s.end())
			assert.Zero(t, e.prefill.hits.Load(), "no prefill request for a rejected body")
			assert.Zero(t, e.pw.Load())
			assert.Zero(t, e.dw.Load())
		})
	}
}

// Bodies over MaxPayloadSize are rejected with 413, by content-length or by size.
func TestPayloadTooLarge(t *testing.T) {
	const limit = 64
	small := `{"messages":[{"role":"user","content":"x"}]}`
	big := `{"messages":[{"role":"user","content":"` + strings.Repeat("x", limit) + `"}]}`
	tests := []struct {
		name   string
		cl     string // content-length request header
		body   string
		atHead bool // rejected at the request headers
		ok     bool
	}{
		{name: "content-length over the limit", cl: strconv.Itoa(len(big)), body: big, atHead: true},
		{name: "body over the limit, no content-length (chunked)", body: big},
		{name: "body over the limit, lying content-length", cl: "10", body: big},
		{name: "exactly at the limit is accepted", cl: strconv.Itoa(limit), body: small + strings.Repeat(" ", limit-len(small)), ok: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := newPrefill(t, replyWith(200, `{}`))
			pw := newWorker(t, f.URL, workers.Prefill, nil)
			dw := newWorker(t, decodeURL, workers.Decode, nil)
			e := newEnvLimit(t, 0, limit, pw, dw)
			s := e.open(t)
			hdrs := []string{"content-type", "application/json"}
			if tc.cl != "" {
				hdrs = append(hdrs, "content-length", tc.cl)
			}
			s.send(reqHeaders("/v1/chat/completions", false, hdrs...))
			ans := s.recv(t)
			if !tc.atHead {
				require.NotNil(t, ans.GetRequestHeaders(), "%v", ans)
				s.send(reqBody(tc.body, true))
				ans = s.recv(t)
			}
			if tc.ok {
				require.NotNil(t, ans.GetRequestBody(), "%v", ans)
				f.request(t)
				return
			}
			assert.Equal(t, "Request body exceeds the maximum payload size of 64 bytes", requireAPIError(t, ans, 413, "payload_too_large"))
			require.NoError(t, s.end())
			assert.Zero(t, f.hits.Load())
		})
	}
}

// 9. Selection failures.
func TestNoWorkers(t *testing.T) {
	unhealthy := func(w *workers.Worker) *workers.Worker { w.SetHealthy(false); return w }
	tests := []struct {
		name    string
		workers func(t *testing.T, prefillURL string) []*workers.Worker
		msg     string
	}{
		{name: "no prefill", msg: "No available servers: No prefill workers available. Please check if prefill servers are configured and healthy.",
			workers: func(t *testing.T, _ string) []*workers.Worker {
				return []*workers.Worker{newWorker(t, decodeURL, workers.Decode, nil)}
			}},
		{name: "no decode", msg: "No available servers: No decode workers available. Please check if decode servers are configured and healthy.",
			workers: func(t *testing.T, p string) []*workers.Worker {
				return []*workers.Worker{newWorker(t, p, workers.Prefill, nil)}
			}},
		{name: "no workers at all", msg: "No available servers: No prefill workers available. Please check if prefill servers are configured and healthy.",
			workers: func(t *testing.T, _ string) []*workers.Worker { return nil }},
		{name: "prefill unhealthy", msg: "No available prefill workers (all circuits open or unhealthy)",
			workers: func(t *testing.T, p string) []*workers.Worker {
				return []*workers.Worker{unhealthy(newWorker(t, p, workers.Prefill, nil)), newWorker(t, decodeURL, workers.Decode, nil)}
			}},
		{name: "decode unhealthy", msg: "No available decode workers (all circuits open or unhealthy)",
			workers: func(t *testing.T, p string) []*workers.Worker {
				return []*workers.Worker{newWorker(t, p, workers.Prefill, nil), unhealthy(newWorker(t, decodeURL, workers.Decode, nil))}
			}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := newPrefill(t, replyWith(200, `{}`))
			e := newEnv(t, 0, tc.workers(t, f.URL)...)
			s := e.open(t)
			_, ans := s.dispatch(t, "/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}]}`)
			assert.Equal(t, tc.msg, requireAPIError(t, ans, 503, "no_available_workers"))
			require.NoError(t, s.end())
			assert.Zero(t, f.hits.Load())
			for _, w := range e.reg.Snapshot() {
				assert.Zero(t, w.Load())
			}
		})
	}
}

// 10. A prefill that never answers is bounded by RequestTimeout.
func TestPrefillTimeout(t *testing.T) {
	cancelled := make(chan struct{})
	e := newPD(t, 300*time.Millisecond, func(w http.ResponseWriter, r *http.Request, f *prefillFake) {
		select {
		case <-r.Context().Done():
			close(cancelled)
		case <-f.stop:
		}
	})
	s := e.open(t)
	start := time.Now()
	_, bodyAns := s.dispatch(t, "/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}]}`)
	require.NotNil(t, bodyAns.GetRequestBody())
	ans := s.recv(t) // spontaneous, no decode head
	msg := requireAPIError(t, ans, 502, "PD disaggregation request failed")
	assert.True(t, strings.HasPrefix(msg, "Transport error: "), msg)
	assert.Contains(t, msg, "timed out")
	assert.Less(t, time.Since(start), wait)
	select {
	case <-cancelled:
	case <-time.After(wait):
		t.Fatal("the prefill request was not cancelled")
	}
	require.NoError(t, s.end())
	requireIdle(t, e.pw, e.dw)
}

// Non-streamed: the decode head arrived, the prefill head is 200 but its body
// hangs; RequestTimeout bounds the wait and the request proceeds (SMG only
// logs a prefill body error).
func TestPrefillBodyTimeoutAfterDecodeHead(t *testing.T) {
	e := newPD(t, 300*time.Millisecond, func(w http.ResponseWriter, r *http.Request, f *prefillFake) {
		w.WriteHeader(200)
		_, _ = io.WriteString(w, `{"partial":`)
		w.(http.Flusher).Flush()
		select {
		case <-r.Context().Done():
		case <-f.stop:
		}
	})
	s := e.open(t)
	_, bodyAns := s.dispatch(t, "/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}]}`)
	require.NotNil(t, bodyAns.GetRequestBody())
	s.send(respHeaders(200, false))
	ans := s.recv(t)
	require.NotNil(t, ans.GetResponseHeaders(), "%v", ans)
	assert.Equal(t, decodeURL, setHeaders(ans.GetResponseHeaders().GetResponse().GetHeaderMutation())["x-smg-routed-worker-id"])
	require.NoError(t, s.end())
	requireIdle(t, e.pw, e.dw)
}

// 11. The client goes away while the prefill is in flight: the prefill
// request is cancelled.
func TestClientGoneCancelsPrefill(t *testing.T) {
	tests := []struct {
		name       string
		prefillHdr bool // the prefill sends its head (200) before hanging
		decodeHead bool // Envoy delivered the decode head (processor waits on the prefill body)
		how        func(s *session) error
	}{
		{name: "context cancelled while waiting for the decode head", how: (*session).abort},
		{name: "stream closed while waiting for the decode head", how: (*session).end},
		{name: "context cancelled while waiting for the prefill body", prefillHdr: true, decodeHead: true, how: (*session).abort},
		{name: "context cancelled while waiting for the prefill head", decodeHead: true, how: (*session).abort},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cancelled := make(chan struct{})
			e := newPD(t, 0, func(w http.ResponseWriter, r *http.Request, f *prefillFake) {
				if tc.prefillHdr {
					w.WriteHeader(200)
					w.(http.Flusher).Flush()
				}
				select {
				case <-r.Context().Done():
					close(cancelled)
				case <-f.stop:
				}
			})
			s := e.open(t)
			_, bodyAns := s.dispatch(t, "/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}]}`)
			require.NotNil(t, bodyAns.GetRequestBody())
			e.prefill.request(t)
			if tc.decodeHead {
				s.send(respHeaders(200, false))
			}
			require.NoError(t, tc.how(s))
			select {
			case <-cancelled:
			case <-time.After(wait):
				t.Fatal("the prefill request was not cancelled after the client went away")
			}
			requireIdle(t, e.pw, e.dw)
		})
	}
}

// Trailers are acknowledged.
func TestTrailers(t *testing.T) {
	e := newPD(t, 0, replyWith(200, `{}`))
	s := e.open(t)
	s.send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestTrailers{RequestTrailers: &extprocv3.HttpTrailers{}}})
	require.NotNil(t, s.recv(t).GetRequestTrailers())
	s.send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseTrailers{ResponseTrailers: &extprocv3.HttpTrailers{}}})
	require.NotNil(t, s.recv(t).GetResponseTrailers())
	require.NoError(t, s.end())
}

// 12. Many concurrent streams: distinct rooms, round-robin spread, no leaks.
func TestConcurrentStreams(t *testing.T) {
	const n = 200
	f1 := newPrefill(t, replyWith(200, `{}`))
	f2 := newPrefill(t, replyWith(200, `{}`))
	p1 := newWorker(t, f1.URL, workers.Prefill, intp(8998))
	p2 := newWorker(t, f2.URL, workers.Prefill, intp(8999))
	d1 := newWorker(t, "http://10.0.0.2:8000", workers.Decode, nil)
	d2 := newWorker(t, "http://10.0.0.3:8000", workers.Decode, nil)
	e := newEnv(t, 0, p1, p2, d1, d2)

	type result struct {
		room string
		dest string
		err  error
	}
	results := make([]result, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i] = runOne(e, i)
		}()
	}
	wg.Wait()

	rooms := map[string]bool{}
	dests := map[string]int{}
	for i, r := range results {
		require.NoError(t, r.err, "stream %d", i)
		require.False(t, rooms[r.room], "room %s minted twice", r.room)
		rooms[r.room] = true
		dests[r.dest]++
	}
	assert.Len(t, rooms, n)
	assert.Equal(t, map[string]int{"10.0.0.2:8000": n / 2, "10.0.0.3:8000": n / 2}, dests)
	assert.EqualValues(t, n/2, f1.hits.Load())
	assert.EqualValues(t, n/2, f2.hits.Load())

	// Every prefill request carried the room its decode leg got.
	prefillRooms := map[string]bool{}
	for _, f := range []*prefillFake{f1, f2} {
		for range f.hits.Load() {
			c := f.request(t)
			prefillRooms[decodeJSON(t, c.Body)["bootstrap_room"].(json.Number).String()] = true
		}
	}
	assert.Equal(t, rooms, prefillRooms)
	requireIdle(t, p1, p2, d1, d2)
}

func runOne(e *env, i int) (res struct {
	room string
	dest string
	err  error
}) {
	s := openSession(e.srv)
	s.timeout = 15 * time.Second // 200 streams under -race on a small, busy machine
	defer func() {
		if err := s.end(); err != nil && res.err == nil {
			res.err = err
		}
	}()
	stream := i%2 == 0
	s.send(reqHeaders("/v1/chat/completions", false, stdHeaders...))
	ans, err := s.next()
	if err != nil {
		res.err = fmt.Errorf("request headers: %w", err)
		return res
	}
	if ans.GetRequestHeaders() == nil {
		res.err = fmt.Errorf("headers answer %v", ans)
		return res
	}
	s.send(reqBody(fmt.Sprintf(`{"messages":[{"role":"user","content":"req %d"}],"stream":%v}`, i, stream), true))
	if ans, err = s.next(); err != nil {
		res.err = fmt.Errorf("request body: %w", err)
		return res
	}
	b := ans.GetRequestBody().GetResponse().GetBodyMutation().GetBody()
	var m map[string]json.RawMessage
	if err := json.Unmarshal(b, &m); err != nil {
		res.err = fmt.Errorf("decode body %q: %w", b, err)
		return res
	}
	res.room, res.dest = string(m["bootstrap_room"]), destination(ans)
	s.send(respHeaders(200, false))
	if ans, err = s.next(); err != nil {
		res.err = fmt.Errorf("response headers (stream=%v): %w", stream, err)
		return res
	}
	hs := setHeaders(ans.GetResponseHeaders().GetResponse().GetHeaderMutation())
	if !slices.Contains([]string{"http://10.0.0.2:8000", "http://10.0.0.3:8000"}, hs["x-smg-routed-worker-id"]) {
		res.err = fmt.Errorf("response headers answer %v", ans)
	}
	return res
}
