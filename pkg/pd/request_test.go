package pd

import (
	"errors"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/smg-project/smg-extproc/pkg/apierr"
)

func mustRoute(t testing.TB, path string) *Route {
	t.Helper()
	r, ok := LookupRoute(path)
	require.True(t, ok, path)
	return r
}

func TestLookupRoute(t *testing.T) {
	cases := []struct {
		path, upstream, endpoint, prefix string
		prefillOnly, neverStream         bool
	}{
		{"/generate", "/generate", "generate", "gnt-", false, false},
		{"/v1/chat/completions", "/v1/chat/completions", "chat", "chatcmpl-", false, false},
		{"/v1/completions", "/v1/completions", "completions", "cmpl-", false, false},
		{"/v1/messages", "/v1/messages", "messages", "msg_", false, false},
		{"/v1/responses", "/v1/responses", "responses", "resp-", false, false},
		{"/v1/rerank", "/v1/rerank", "rerank", "req-", false, true},
		{"/rerank", "/v1/rerank", "rerank", "req-", false, true},
		{"/v1/messages/count_tokens", "/v1/messages/count_tokens", "other", "msg_", true, true},
	}
	for _, c := range cases {
		t.Run(c.path, func(t *testing.T) {
			r := mustRoute(t, c.path)
			assert.Equal(t, c.path, r.ClientPath)
			assert.Equal(t, c.upstream, r.UpstreamPath)
			assert.Equal(t, c.endpoint, r.Endpoint)
			assert.Equal(t, c.prefix, r.IDPrefix)
			assert.Equal(t, c.prefillOnly, r.PrefillOnly)
			assert.Equal(t, c.neverStream, r.NeverStream)
		})
	}
	// Exact match only: query strings, trailing slashes and other paths miss.
	for _, p := range []string{"/generate?x=1", "/generate/", "/v1/embeddings", "", "/v1/chat/completions/x", "/GENERATE"} {
		_, ok := LookupRoute(p)
		assert.False(t, ok, p)
	}
	routes := Routes()
	assert.Len(t, routes, 8)
	routes[0] = nil // the caller's slice is a copy
	assert.NotNil(t, Routes()[0])
}

func TestParseRequest(t *testing.T) {
	type want struct {
		stream    bool
		batch     int
		logprobs  bool
		n         int
		model     string
		text      string
		dupOwned  bool
		ownedSeen []int
	}
	cases := []struct {
		name  string
		route string
		body  string
		want  want
	}{
		// /generate
		{"generate text", "/generate", `{"text":"hi"}`, want{n: 1, text: "hi"}},
		{"generate input_ids batch", "/generate", `{"input_ids":[[1,2],[3,4],[5,6]]}`, want{n: 1, batch: 3}},
		{"generate input_ids single", "/generate", `{"input_ids":[1,2,3]}`, want{n: 1}},
		{"generate input_ids empty", "/generate", `{"input_ids":[]}`, want{n: 1}},
		{"generate input_ids null", "/generate", `{"input_ids":null,"text":"a"}`, want{n: 1, text: "a"}},
		{"generate text list is a batch (deviation)", "/generate", `{"text":["a","b"]}`, want{n: 1, batch: 2, text: "a"}},
		{"generate input_ids wins over text list", "/generate", `{"text":["a","b"],"input_ids":[[1],[2],[3]]}`, want{n: 1, batch: 3, text: "a"}},
		{"generate return_logprob", "/generate", `{"text":"x","return_logprob":true,"stream":true}`, want{n: 1, text: "x", logprobs: true, stream: true}},
		{"generate return_logprob null", "/generate", `{"text":"x","return_logprob":null}`, want{n: 1, text: "x"}},
		{"generate top-level n is not interpreted", "/generate", `{"text":"x","n":"many"}`, want{n: 1, text: "x"}},
		// chat
		{"chat n=3", "/v1/chat/completions", `{"model":"m","messages":[],"n":3}`, want{n: 3, batch: 3, model: "m"}},
		{"chat n=1", "/v1/chat/completions", `{"messages":[],"n":1}`, want{n: 1}},
		{"chat n absent", "/v1/chat/completions", `{"messages":[]}`, want{n: 1}},
		{"chat n null", "/v1/chat/completions", `{"messages":[],"n":null}`, want{n: 1}},
		{"chat logprobs never merged", "/v1/chat/completions", `{"messages":[],"logprobs":true,"stream":true}`, want{n: 1, stream: true}},
		{"chat text", "/v1/chat/completions", `{"messages":[
			{"role":"system","content":"sys"},
			{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"data:x"}},{"type":"text","text":"b\u00e9\n"}]},
			{"role":"assistant","content":"","reasoning_content":"r"},
			{"role":"tool","content":null},
			"junk"]}`, want{n: 1, text: "sys a bé\n r"}},
		// completions
		{"completions prompt list", "/v1/completions", `{"prompt":["a","b"]}`, want{n: 1, batch: 2, text: "a"}},
		{"completions n ignored for batch", "/v1/completions", `{"prompt":"a","n":4}`, want{n: 4, text: "a"}},
		{"completions token list is one prompt", "/v1/completions", `{"prompt":[1,2,-3]}`, want{n: 1}},
		{"completions token lists", "/v1/completions", `{"prompt":[[1],[2,3]]}`, want{n: 1, batch: 2}},
		{"completions empty list", "/v1/completions", `{"prompt":[]}`, want{n: 1}},
		// messages, responses, rerank, count_tokens
		{"messages", "/v1/messages", `{"model":"claude","stream":true,"messages":[{"role":"user","content":[{"type":"text","text":"hello"},{"type":"image"}]},{"role":"assistant","content":"yo"}]}`,
			want{n: 1, model: "claude", stream: true, text: "hello yo"}},
		{"messages n not interpreted", "/v1/messages", `{"messages":[],"n":"x"}`, want{n: 1}},
		{"responses string input", "/v1/responses", `{"input":"hi","stream":true}`, want{n: 1, text: "hi", stream: true}},
		{"responses items", "/v1/responses", `{"input":[{"role":"user","content":[{"type":"input_text","text":"a"},{"type":"input_image"}]},{"type":"message","role":"assistant","content":[{"type":"output_text","text":"b"}]},{"type":"function_call_output","output":"z"}]}`,
			want{n: 1, text: "a b"}},
		{"rerank query", "/v1/rerank", `{"query":"q","documents":["d"],"stream":true}`, want{n: 1, text: "q"}},
		{"rerank stream not interpreted", "/rerank", `{"query":"q","stream":"yes"}`, want{n: 1, text: "q"}},
		{"count_tokens", "/v1/messages/count_tokens", `{"model":"m","messages":[{"role":"user","content":"c"}]}`, want{n: 1, model: "m", text: "c"}},
		// common
		{"stream null", "/v1/chat/completions", `{"stream":null}`, want{n: 1}},
		{"duplicate key: last wins", "/v1/chat/completions", `{"stream":true,"stream":false,"n":2,"n":3}`, want{n: 3, batch: 3}},
		{"escaped key", "/v1/chat/completions", `{"\u0073tream":true}`, want{n: 1, stream: true}},
		{"whitespace", "/v1/chat/completions", " \n{ \"stream\" :\ttrue , \"model\" : \"a\\\"b\" }\n", want{n: 1, stream: true, model: `a"b`}},
		{"model null", "/v1/completions", `{"model":null}`, want{n: 1}},
		{"owned keys recorded", "/generate", `{"bootstrap_room":1,"bootstrap_host":"x","routed_dp_rank":0}`, want{n: 1, ownedSeen: []int{ownRoom, ownHost, ownRoutedRank}}},
		{"owned duplicate", "/generate", `{"bootstrap_room":1,"bootstrap_room":2}`, want{n: 1, dupOwned: true, ownedSeen: []int{ownRoom}}},
		{"nested owned key ignored", "/generate", `{"sampling_params":{"bootstrap_room":1}}`, want{n: 1}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			req, err := ParseRequest(mustRoute(t, c.route), []byte(c.body))
			require.NoError(t, err)
			assert.Equal(t, c.want.stream, req.Stream, "stream")
			assert.Equal(t, c.want.batch, req.BatchSize, "batch")
			assert.Equal(t, c.want.logprobs, req.Logprobs, "logprobs")
			assert.Equal(t, c.want.n, req.N, "n")
			assert.Equal(t, c.want.model, req.Model, "model")
			assert.Equal(t, c.want.text, req.Text, "text")
			assert.Equal(t, c.body, string(req.Raw), "raw untouched")
			assert.Equal(t, c.want.dupOwned, req.lay.dup, "dup")
			for o := range ownModel { // model is owned too but covered by its own cases
				seen := false
				for _, s := range c.want.ownedSeen {
					seen = seen || s == o
				}
				assert.Equal(t, seen, req.lay.own[o].set(), ownedNames[o])
			}
		})
	}
}

func TestParseRequestErrors(t *testing.T) {
	cases := []struct {
		name, route, body, code, msg string
	}{
		{"empty", "/generate", ``, apierr.CodeInvalidJSON, "Failed to parse the request body as JSON: empty body at offset 0"},
		{"whitespace", "/generate", "  \n", apierr.CodeInvalidJSON, "Failed to parse the request body as JSON: unexpected end of JSON input"},
		{"truncated", "/generate", `{"text":"hi"`, apierr.CodeInvalidJSON, "Failed to parse the request body as JSON: "},
		{"trailing comma", "/generate", `{"text":"hi",}`, apierr.CodeInvalidJSON, "invalid character '}'"},
		{"trailing data", "/generate", `{"text":"hi"} {}`, apierr.CodeInvalidJSON, "after top-level value"},
		{"invalid utf8", "/generate", "{\"text\":\"\xff\"}", apierr.CodeInvalidJSON, "invalid UTF-8"},
		{"bad nested value", "/v1/chat/completions", `{"x":{"y":[1,2,}}`, apierr.CodeInvalidJSON, "Failed to parse"},
		{"array body", "/generate", `[{"text":"hi"}]`, apierr.CodeInvalidRequest, "Request body must be a JSON object"},
		{"string body", "/generate", `"hi"`, apierr.CodeInvalidRequest, "Request body must be a JSON object"},
		{"malformed non-object", "/generate", `[1,`, apierr.CodeInvalidJSON, "Failed to parse"},
		{"stream string", "/v1/chat/completions", `{"stream":"true"}`, apierr.CodeInvalidRequest, "stream must be a boolean"},
		{"stream number", "/generate", `{"stream":1}`, apierr.CodeInvalidRequest, "stream must be a boolean"},
		{"n zero", "/v1/chat/completions", `{"n":0}`, apierr.CodeInvalidRequest, "n must be a positive integer"},
		{"n negative", "/v1/chat/completions", `{"n":-1}`, apierr.CodeInvalidRequest, "n must be a positive integer"},
		{"n float", "/v1/completions", `{"n":2.0}`, apierr.CodeInvalidRequest, "n must be a positive integer"},
		{"n exponent", "/v1/completions", `{"n":1e2}`, apierr.CodeInvalidRequest, "n must be a positive integer"},
		{"n string", "/v1/chat/completions", `{"n":"2"}`, apierr.CodeInvalidRequest, "n must be a positive integer"},
		{"n huge", "/v1/chat/completions", `{"n":99999999999}`, apierr.CodeInvalidRequest, "n must be a positive integer"},
		{"n over batch cap", "/v1/chat/completions", `{"n":65537}`, apierr.CodeInvalidRequest, "batch size 65537 exceeds the maximum of 65536"},
		{"return_logprob string", "/generate", `{"return_logprob":"yes"}`, apierr.CodeInvalidRequest, "return_logprob must be a boolean"},
		{"return_logprob list", "/generate", `{"return_logprob":[true]}`, apierr.CodeInvalidRequest, "return_logprob must be a boolean"},
		{"messages object", "/v1/chat/completions", `{"messages":{"role":"user"}}`, apierr.CodeInvalidRequest, "messages must be an array"},
		{"messages null", "/v1/messages", `{"messages":null}`, apierr.CodeInvalidRequest, "messages must be an array"},
		{"input_ids string", "/generate", `{"input_ids":"1 2"}`, apierr.CodeInvalidRequest, "input_ids must be an array"},
		{"input_ids mixed", "/generate", `{"input_ids":[[1],2]}`, apierr.CodeInvalidRequest, "input_ids must be"},
		{"text number", "/generate", `{"text":5}`, apierr.CodeInvalidRequest, "text must be a string or an array of strings"},
		{"text mixed list", "/generate", `{"text":["a",1]}`, apierr.CodeInvalidRequest, "text must be a string or an array of strings"},
		{"prompt number", "/v1/completions", `{"prompt":5}`, apierr.CodeInvalidRequest, "prompt must be"},
		{"prompt mixed", "/v1/completions", `{"prompt":["a",1]}`, apierr.CodeInvalidRequest, "prompt must be"},
		{"prompt objects", "/v1/completions", `{"prompt":[{}]}`, apierr.CodeInvalidRequest, "prompt must be"},
		{"model number", "/v1/chat/completions", `{"model":5}`, apierr.CodeInvalidRequest, "model must be a string"},
		{"input number", "/v1/responses", `{"input":5}`, apierr.CodeInvalidRequest, "input must be a string or an array"},
		{"query number", "/v1/rerank", `{"query":5}`, apierr.CodeInvalidRequest, "query must be a string"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			req, err := ParseRequest(mustRoute(t, c.route), []byte(c.body))
			require.Error(t, err)
			assert.Nil(t, req)
			var ae *apierr.Error
			require.True(t, errors.As(err, &ae))
			assert.Equal(t, http.StatusBadRequest, ae.Status)
			assert.Equal(t, c.code, ae.Code)
			assert.Contains(t, ae.Message, c.msg)
			if c.code == apierr.CodeInvalidJSON {
				assert.True(t, strings.HasPrefix(ae.Message, "Failed to parse the request body as JSON: "), ae.Message)
			}
		})
	}
	_, err := ParseRequest(nil, []byte(`{}`))
	assert.Error(t, err)
}

// Handing Envoy's 10 MiB bodies to ParseRequest must stay linear.
func TestParseRequestLargeBody(t *testing.T) {
	big := strings.Repeat("lorem ipsum \\n dolor ", 500_000) // ~10 MiB
	body := `{"model":"m","messages":[{"role":"user","content":"` + big + `"}],"stream":true}`
	req, err := ParseRequest(mustRoute(t, "/v1/chat/completions"), []byte(body))
	require.NoError(t, err)
	assert.True(t, req.Stream)
	assert.Equal(t, len(big)-500_000, len(req.Text)) // each "\n" escape decodes to one byte
}
