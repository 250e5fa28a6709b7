package pd

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestMergeLogprobs(t *testing.T) {
	cases := []struct {
		name            string
		prefill, decode string
		want            string
		ok              bool
	}{
		{"item 21", `{"meta_info":{"input_token_logprobs":[[-0.1,1,null]]}}`,
			`{"text":"x","meta_info":{"id":"r","input_token_logprobs":[[-0.25,2,null]],"output_token_logprobs":[[-1e-7,3,null]]},"n":0.95}`,
			`{"text":"x","meta_info":{"id":"r","input_token_logprobs":[[-0.1,1,null],[-0.25,2,null]],"output_token_logprobs":[[-1e-7,3,null]]},"n":0.95}`, true},
		{"pretty decode compacted, numbers kept", `{"meta_info":{"input_token_logprobs":[ [0.123456789012345678, 7, "a b"] ]}}`,
			"{\n \"meta_info\" : {\n  \"input_token_logprobs\" : [ [ -2.5E-3 , 8 , null ] ]\n },\n \"text\" : \"x y\"\n}",
			`{"meta_info":{"input_token_logprobs":[[0.123456789012345678,7,"a b"],[-2.5E-3,8,null]]},"text":"x y"}`, true},
		{"empty prefill array", `{"meta_info":{"input_token_logprobs":[]}}`, `{"meta_info":{"input_token_logprobs":[[1]]}}`,
			`{"meta_info":{"input_token_logprobs":[[1]]}}`, true},
		{"empty decode array", `{"meta_info":{"input_token_logprobs":[[1]]}}`, `{"meta_info":{"input_token_logprobs":[]}}`,
			`{"meta_info":{"input_token_logprobs":[[1]]}}`, true},
		{"prefill not JSON (item 22)", `oops`, `{"meta_info":{"input_token_logprobs":[[1]]}}`,
			`{"meta_info":{"input_token_logprobs":[[1]]}}`, false},
		{"prefill SSE (item 22)", "data: {\"meta_info\":{}}\n\n", `{"meta_info":{"input_token_logprobs":[[1]]}}`,
			`{"meta_info":{"input_token_logprobs":[[1]]}}`, false},
		{"prefill lacks array (item 22)", `{"meta_info":{}}`, "{\"meta_info\": {\"input_token_logprobs\": [[1]]}}",
			"{\"meta_info\": {\"input_token_logprobs\": [[1]]}}", false},
		{"decode lacks array (item 22)", `{"meta_info":{"input_token_logprobs":[[1]]}}`, "{ \"meta_info\": {\"x\":1} }",
			"{ \"meta_info\": {\"x\":1} }", false},
		{"decode not JSON", `{"meta_info":{"input_token_logprobs":[[1]]}}`, `{"meta_info":`, `{"meta_info":`, false},
		{"chat-shaped body untouched (item 23)", `{"choices":[{"logprobs":{"content":[]}}]}`,
			`{"choices":[{"logprobs":{"content":[{"token":"a","logprob":-0.5}]}}]}`,
			`{"choices":[{"logprobs":{"content":[{"token":"a","logprob":-0.5}]}}]}`, false},
		{"array not list", `{"meta_info":{"input_token_logprobs":{"a":1}}}`, `{"meta_info":{"input_token_logprobs":[[1]]}}`,
			`{"meta_info":{"input_token_logprobs":[[1]]}}`, false},
		{"batched lists element-wise",
			`[{"meta_info":{"input_token_logprobs":[[1]]}},{"meta_info":{"input_token_logprobs":[[2]]}}]`,
			`[ {"meta_info":{"input_token_logprobs":[[3]]},"text":"a"} , {"meta_info":{"input_token_logprobs":[[4]]},"text":"b"} ]`,
			`[{"meta_info":{"input_token_logprobs":[[1],[3]]},"text":"a"},{"meta_info":{"input_token_logprobs":[[2],[4]]},"text":"b"}]`, true},
		{"batched partial", `[{"meta_info":{}},{"meta_info":{"input_token_logprobs":[[2]]}}]`,
			`[{"text":"a"},{"meta_info":{"input_token_logprobs":[[4]]}}]`,
			`[{"text":"a"},{"meta_info":{"input_token_logprobs":[[2],[4]]}}]`, true},
		{"batched length mismatch", `[{"meta_info":{"input_token_logprobs":[[1]]}}]`,
			`[{"meta_info":{"input_token_logprobs":[[3]]}},{"text":"b"}]`,
			`[{"meta_info":{"input_token_logprobs":[[3]]}},{"text":"b"}]`, false},
		{"list vs object", `[{"meta_info":{"input_token_logprobs":[[1]]}}]`, `{"meta_info":{"input_token_logprobs":[[3]]}}`,
			`{"meta_info":{"input_token_logprobs":[[3]]}}`, false},
		{"duplicate meta_info in decode: last one merged, one left", `{"meta_info":{"input_token_logprobs":[[1]]}}`,
			`{"meta_info":{"input_token_logprobs":[[0]]},"meta_info":{"input_token_logprobs":[[3]]}}`,
			`{"meta_info":{"input_token_logprobs":[[1],[3]]}}`, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, ok := MergeLogprobs([]byte(c.prefill), []byte(c.decode))
			assert.Equal(t, c.ok, ok)
			assert.Equal(t, c.want, string(got))
		})
	}
}

func TestPrefillLogprobs(t *testing.T) {
	cases := []struct {
		name, body, want string
	}{
		{"object", `{"meta_info":{"input_token_logprobs":[[-0.1,1,null]]},"text":""}`, `[[-0.1,1,null]]`},
		{"whitespace around", " {\"meta_info\":{\"input_token_logprobs\": [ ] }}\n", `[ ]`},
		{"SSE body", "data: {\"meta_info\":{\"input_token_logprobs\":[[1]]}}\n\ndata: [DONE]\n\n", ``},
		{"no array", `{"meta_info":{"input_token_logprobs":null}}`, ``},
		{"no meta_info", `{"text":"x"}`, ``},
		{"list body", `[{"meta_info":{"input_token_logprobs":[[1]]}}]`, ``},
		{"empty", ``, ``},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got := PrefillLogprobs([]byte(c.body))
			assert.Equal(t, c.want, string(got))
			if c.want == "" {
				assert.Nil(t, got)
			}
		})
	}
}

func TestMergeLogprobsChunk(t *testing.T) {
	arr := []byte(`[[-0.1,1,null]]`)
	cases := []struct {
		name  string
		arr   []byte
		chunk string
		want  string
	}{
		{"merged (item 24)", arr, "data: {\"text\":\"a\",\"meta_info\":{\"input_token_logprobs\":[[-0.2,2,null]],\"x\":0.95}}\n\n",
			"data: {\"text\":\"a\",\"meta_info\":{\"input_token_logprobs\":[[-0.1,1,null],[-0.2,2,null]],\"x\":0.95}}\n\n"},
		{"trailing CRLF and spaces trimmed", arr, "data:  {\"meta_info\" : {\"input_token_logprobs\":[]}} \r\n\r\n",
			"data: {\"meta_info\":{\"input_token_logprobs\":[[-0.1,1,null]]}}\n\n"},
		{"DONE untouched", arr, "data: [DONE]\n\n", "data: [DONE]\n\n"},
		{"DONE text inside payload still merged", arr, "data: {\"text\":\"data: [DONE]\",\"meta_info\":{\"input_token_logprobs\":[]}}\n\n",
			"data: {\"text\":\"data: [DONE]\",\"meta_info\":{\"input_token_logprobs\":[[-0.1,1,null]]}}\n\n"},
		{"no array untouched", arr, "data: {\"meta_info\":{}}\n\n", "data: {\"meta_info\":{}}\n\n"},
		{"two events untouched", arr, "data: {\"meta_info\":{\"input_token_logprobs\":[]}}\n\ndata: {\"meta_info\":{\"input_token_logprobs\":[]}}\n\n",
			"data: {\"meta_info\":{\"input_token_logprobs\":[]}}\n\ndata: {\"meta_info\":{\"input_token_logprobs\":[]}}\n\n"},
		{"split event untouched", arr, "data: {\"meta_info\":{\"input_to", "data: {\"meta_info\":{\"input_to"},
		{"no data prefix untouched", arr, "event: x\ndata: {\"meta_info\":{\"input_token_logprobs\":[]}}\n\n",
			"event: x\ndata: {\"meta_info\":{\"input_token_logprobs\":[]}}\n\n"},
		{"invalid utf8 untouched", arr, "data: {\"t\":\"\xff\"}\n\n", "data: {\"t\":\"\xff\"}\n\n"},
		{"no prefill array untouched", nil, "data: {\"meta_info\":{\"input_token_logprobs\":[]}}\n\n",
			"data: {\"meta_info\":{\"input_token_logprobs\":[]}}\n\n"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			assert.Equal(t, c.want, string(MergeLogprobsChunk(c.arr, []byte(c.chunk))))
		})
	}
}
