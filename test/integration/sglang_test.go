package integration

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/smg-project/smg-extproc/pkg/fake/common"
)

type routeCase struct {
	name     string
	path     string // client path
	upstream string
	body     string
	stream   bool
	batch    int // expected list length of bootstrap fields; 0 = scalars
	idPrefix string
}

var routeCases = []routeCase{
	{"generate", "/generate", "/generate", `{"text":"the quick brown fox","sampling_params":{"max_new_tokens":6,"temperature":0.7}}`, false, 0, "gnt-"},
	{"generate-stream", "/generate", "/generate", `{"text":"the quick brown fox","sampling_params":{"max_new_tokens":6},"stream":true}`, true, 0, "gnt-"},
	{"generate-batch", "/generate", "/generate", `{"input_ids":[[1,2],[3,4],[5,6]],"sampling_params":{"max_new_tokens":3}}`, false, 3, "gnt-"},
	{"chat", "/v1/chat/completions", "/v1/chat/completions", `{"model":"fake-model","messages":[{"role":"user","content":"hello there"}],"max_tokens":5,"temperature":0.7,"top_p":0.95}`, false, 0, "chatcmpl-"},
	{"chat-stream", "/v1/chat/completions", "/v1/chat/completions", `{"model":"fake-model","messages":[{"role":"user","content":"hello there"}],"max_tokens":5,"stream":true,"stream_options":{"include_usage":true,"engine_extra":1}}`, true, 0, "chatcmpl-"},
	{"chat-n3", "/v1/chat/completions", "/v1/chat/completions", `{"model":"fake-model","messages":[{"role":"user","content":"hello"}],"max_tokens":3,"n":3}`, false, 3, "chatcmpl-"},
	{"completions", "/v1/completions", "/v1/completions", `{"model":"fake-model","prompt":"once upon a time","max_tokens":4}`, false, 0, "cmpl-"},
	{"completions-stream", "/v1/completions", "/v1/completions", `{"model":"fake-model","prompt":"once upon a time","max_tokens":4,"stream":true}`, true, 0, "cmpl-"},
	{"completions-batch", "/v1/completions", "/v1/completions", `{"model":"fake-model","prompt":["a b","c d"],"max_tokens":2}`, false, 2, "cmpl-"},
	{"messages", "/v1/messages", "/v1/messages", `{"model":"fake-model","max_tokens":4,"messages":[{"role":"user","content":"hi claude"}]}`, false, 0, "msg_"},
	{"messages-stream", "/v1/messages", "/v1/messages", `{"model":"fake-model","max_tokens":4,"stream":true,"messages":[{"role":"user","content":"hi claude"}]}`, true, 0, "msg_"},
	{"responses", "/v1/responses", "/v1/responses", `{"model":"fake-model","input":"tell me","max_output_tokens":4}`, false, 0, "resp-"},
	{"responses-stream", "/v1/responses", "/v1/responses", `{"model":"fake-model","input":"tell me","max_output_tokens":4,"stream":true}`, true, 0, "resp-"},
	{"v1-rerank", "/v1/rerank", "/v1/rerank", `{"query":"apple","documents":["apple pie","banana"]}`, false, 0, "req-"},
	{"rerank", "/rerank", "/v1/rerank", `{"query":"apple","documents":["apple pie","banana"]}`, false, 0, "req-"},
}

// TestSGLangEveryRoute drives every HTTP PD route through the real Envoy to
// strict fake SGLang engines: the decode fake only answers if it met the
// prefill over the bootstrap server with the same room and prompt.
func TestSGLangEveryRoute(t *testing.T) {
	s := newStack(t)
	for _, tc := range routeCases {
		t.Run(tc.name, func(t *testing.T) {
			s.reset()
			r := post(t, s.GW.URL+tc.path+"?debug=1", tc.body, nil)
			require.Equal(t, 200, r.Status, "body: %s", r.Body)
			assert.Equal(t, s.D.URL(), r.Header.Get("x-smg-routed-worker-id"))
			assert.True(t, strings.HasPrefix(r.Header.Get("x-request-id"), tc.idPrefix), "x-request-id %q", r.Header.Get("x-request-id"))
			assert.Equal(t, "transferred", r.Header.Get("X-Fake-KV"), "decode must have received the prefill's KV")
			if tc.stream {
				assert.Equal(t, "text/event-stream", r.Header.Get("Content-Type"))
				assert.True(t, bytes.HasSuffix(bytes.TrimSpace(r.Body), []byte("data: [DONE]")) || tc.path == "/v1/messages" || tc.path == "/v1/responses",
					"stream should end with [DONE]: %s", tail(string(r.Body), 300))
			} else {
				assert.True(t, json.Valid(r.Body), "non-stream body is JSON: %s", r.Body)
			}

			pr := onlyRequest(t, "prefill", s.P.Requests())
			dr := onlyRequest(t, "decode", s.D.Requests())
			assert.Equal(t, tc.upstream, pr.Path)
			assert.Equal(t, tc.upstream, dr.Path)
			assert.Empty(t, pr.RawQuery, "query string must not reach the prefill")
			assert.Empty(t, dr.RawQuery, "query string must not reach the decode")
			assert.Equal(t, "application/json", pr.Header.Get("Content-Type"))
			assert.Equal(t, "application/json", dr.Header.Get("Content-Type"))

			pb, db := legBody(t, pr), legBody(t, dr)
			for _, k := range []string{"bootstrap_host", "bootstrap_port", "bootstrap_room"} {
				assert.Equal(t, fmt.Sprint(pb[k]), fmt.Sprint(db[k]), "%s must be identical on both legs", k)
			}
			port := json.Number(strconv.Itoa(s.P.BootstrapPort()))
			if tc.batch == 0 {
				assert.Equal(t, "127.0.0.1", pb["bootstrap_host"])
				assert.Equal(t, port, pb["bootstrap_port"])
				room, err := strconv.ParseUint(string(pb["bootstrap_room"].(json.Number)), 10, 64)
				require.NoError(t, err)
				assert.True(t, room >= 1 && room <= 1<<63-1, "room %d in [1, 2^63-1]", room)
			} else {
				hosts, ports, rooms := pb["bootstrap_host"].([]any), pb["bootstrap_port"].([]any), pb["bootstrap_room"].([]any)
				require.Len(t, hosts, tc.batch)
				require.Len(t, ports, tc.batch)
				require.Len(t, rooms, tc.batch)
				seen := map[string]bool{}
				for i := range rooms {
					assert.Equal(t, "127.0.0.1", hosts[i])
					assert.Equal(t, port, ports[i])
					seen[fmt.Sprint(rooms[i])] = true
				}
				assert.Len(t, seen, tc.batch, "batch rooms must be distinct")
			}
			// Everything but the bootstrap keys is the client's bytes.
			assertClientBytesKept(t, tc.body, pr.Body)
			assertClientBytesKept(t, tc.body, dr.Body)
		})
	}

	t.Run("count_tokens-one-prefill-no-bootstrap", func(t *testing.T) {
		s.reset()
		body := `{"model":"fake-model","messages":[{"role":"user","content":"count these words"}],"context_management":{"x":1}}`
		r := post(t, s.GW.URL+"/v1/messages/count_tokens", body, map[string]string{"Authorization": "Bearer client"})
		require.Equal(t, 200, r.Status, "body: %s", r.Body)
		pr := onlyRequest(t, "prefill", s.P.Requests())
		assert.Equal(t, "/v1/messages/count_tokens", pr.Path)
		assert.Equal(t, body, string(pr.Body), "count_tokens body is relayed byte for byte")
		assert.Equal(t, "Bearer client", pr.Header.Get("Authorization"))
		assert.Empty(t, s.D.Requests(), "count_tokens never reaches a decode")
		assert.Contains(t, string(r.Body), "input_tokens")
		assert.Equal(t, s.P.URL(), r.Header.Get("x-smg-routed-worker-id"))
	})

	t.Run("headers-allowlist", func(t *testing.T) {
		s.reset()
		hdr := map[string]string{
			"Authorization": "Bearer k", "X-Request-Id": "rid-1", "X-Request-Id-Foo": "f", "X-Correlation-Id": "c",
			"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tracestate": "a=b",
			"x-smg-routing-key": "rk", "X-Custom": "no", "Cookie": "a=b", "User-Agent": "evil/1.0",
			"X-Gateway-Destination-Endpoint": "127.0.0.1:1",
		}
		r := post(t, s.GW.URL+"/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}],"max_tokens":2}`, hdr)
		require.Equal(t, 200, r.Status, "body: %s", r.Body)
		assert.Equal(t, "rid-1", r.Header.Get("x-request-id"), "the client's request id is echoed")
		for name, leg := range map[string]common.RecordedRequest{"prefill": onlyRequest(t, "prefill", s.P.Requests()), "decode": onlyRequest(t, "decode", s.D.Requests())} {
			for _, k := range []string{"Authorization", "X-Request-Id", "X-Request-Id-Foo", "X-Correlation-Id", "Traceparent", "Tracestate", "X-Smg-Routing-Key"} {
				assert.Equal(t, headerValue(hdr, k), leg.Header.Get(k), "%s must reach the %s leg", k, name)
			}
			for _, k := range []string{"X-Custom", "Cookie", "X-Gateway-Destination-Endpoint", "X-Forwarded-For", "X-Envoy-Expected-Rq-Timeout-Ms"} {
				assert.Empty(t, leg.Header.Get(k), "%s must not reach the %s leg", k, name)
			}
			assert.NotEqual(t, "evil/1.0", leg.Header.Get("User-Agent"), "client User-Agent must not reach the %s leg", name)
		}
	})

	t.Run("no-request-id-forwarded-when-client-sent-none", func(t *testing.T) {
		s.reset()
		r := post(t, s.GW.URL+"/generate", `{"text":"hi","sampling_params":{"max_new_tokens":2}}`, nil)
		require.Equal(t, 200, r.Status)
		id := r.Header.Get("x-request-id")
		require.Regexp(t, `^gnt-[A-Za-z0-9]{24}$`, id)
		assert.Empty(t, onlyRequest(t, "prefill", s.P.Requests()).Header.Get("X-Request-Id"))
		assert.Empty(t, onlyRequest(t, "decode", s.D.Requests()).Header.Get("X-Request-Id"))
	})

	t.Run("client-bootstrap-fields-overwritten", func(t *testing.T) {
		s.reset()
		r := post(t, s.GW.URL+"/generate", `{"text":"hi","bootstrap_room":7,"bootstrap_host":"10.9.9.9","bootstrap_port":1,"sampling_params":{"max_new_tokens":2}}`, nil)
		require.Equal(t, 200, r.Status, "body: %s", r.Body)
		pb := legBody(t, onlyRequest(t, "prefill", s.P.Requests()))
		assert.NotEqual(t, "7", fmtRoom(pb["bootstrap_room"]))
		assert.Equal(t, "127.0.0.1", pb["bootstrap_host"])
	})

	t.Run("generate-logprobs-merged", func(t *testing.T) {
		s.reset()
		prompt := "one two three four five"
		r := post(t, s.GW.URL+"/generate", `{"text":"`+prompt+`","return_logprob":true,"sampling_params":{"max_new_tokens":3}}`, nil)
		require.Equal(t, 200, r.Status, "body: %s", r.Body)
		assert.Equal(t, "application/json", r.Header.Get("Content-Type"))
		var out struct {
			MetaInfo struct {
				InputTokenLogprobs []any `json:"input_token_logprobs"`
			} `json:"meta_info"`
		}
		require.NoError(t, json.Unmarshal(r.Body, &out))
		assert.Len(t, out.MetaInfo.InputTokenLogprobs, len(strings.Fields(prompt)),
			"prompt logprobs come from the prefill and must be merged into the decode body")
	})

	t.Run("stream-is-relayed-event-by-event", func(t *testing.T) {
		s.reset()
		req, err := http.NewRequest("POST", s.GW.URL+"/v1/chat/completions",
			strings.NewReader(`{"messages":[{"role":"user","content":"stream please"}],"max_tokens":6,"stream":true}`))
		require.NoError(t, err)
		req.Header.Set("Content-Type", "application/json")
		resp, err := client.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		require.Equal(t, 200, resp.StatusCode)
		sc := bufio.NewScanner(resp.Body)
		var events []string
		for sc.Scan() {
			if l := sc.Text(); strings.HasPrefix(l, "data: ") {
				events = append(events, l)
			}
		}
		require.NoError(t, sc.Err())
		require.GreaterOrEqual(t, len(events), 3)
		assert.Equal(t, "data: [DONE]", events[len(events)-1])
	})
}

func headerValue(h map[string]string, k string) string {
	for kk, v := range h {
		if strings.EqualFold(kk, k) {
			return v
		}
	}
	return ""
}

// assertClientBytesKept checks that each top-level member of the client's body
// appears byte for byte in the leg body (bootstrap keys aside).
func assertClientBytesKept(t *testing.T, client string, leg []byte) {
	t.Helper()
	var m map[string]json.RawMessage
	require.NoError(t, json.Unmarshal([]byte(client), &m))
	for k, v := range m {
		if strings.HasPrefix(k, "bootstrap_") {
			continue
		}
		assert.Contains(t, string(leg), fmt.Sprintf("%q:%s", k, v), "client member %q must be kept byte for byte", k)
	}
}
