package pd

import (
	"bytes"
	"encoding/json"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestSetTopLevel(t *testing.T) {
	cases := []struct {
		name string
		body string
		kvs  []KV
		want string
	}{
		{"append to object", `{"a":1}`, []KV{{"b", []byte(`2`)}}, `{"a":1,"b":2}`},
		{"append to empty", `{}`, []KV{{"b", []byte(`2`)}, {"c", []byte(`"x"`)}}, `{"b":2,"c":"x"}`},
		{"append to empty with spaces", "{ \n }", []KV{{"b", []byte(`2`)}}, "{\"b\":2 \n }"},
		{"replace in place keeps order", `{"a":1,"b":2,"c":3}`, []KV{{"b", []byte(`[1,2]`)}}, `{"a":1,"b":[1,2],"c":3}`},
		{"whitespace preserved", "{ \"a\" : 1 ,\n \"b\" : 0.95 }", []KV{{"a", []byte(`7`)}}, "{ \"a\" : 7 ,\n \"b\" : 0.95 }"},
		{"append after last value before trailing space", "{\"a\":1\n}", []KV{{"z", []byte(`true`)}}, "{\"a\":1,\"z\":true\n}"},
		{"duplicate key: first replaced, later removed", `{"k":1,"a":2,"k":3}`, []KV{{"k", []byte(`9`)}}, `{"k":9,"a":2}`},
		{"duplicate key at start", `{"k":1,"k":2,"a":3}`, []KV{{"k", []byte(`9`)}}, `{"k":9,"a":3}`},
		{"escaped key matches", `{"\u006b":1,"a":2}`, []KV{{"k", []byte(`9`)}}, `{"\u006b":9,"a":2}`},
		{"nested key untouched", `{"o":{"k":1},"a":2}`, []KV{{"k", []byte(`9`)}}, `{"o":{"k":1},"a":2,"k":9}`},
		{"strings containing key text untouched", `{"a":"\"k\":1","b":"}"}`, []KV{{"k", []byte(`9`)}}, `{"a":"\"k\":1","b":"}","k":9}`},
		{"later kv wins", `{"a":1}`, []KV{{"k", []byte(`1`)}, {"k", []byte(`2`)}}, `{"a":1,"k":2}`},
		{"later kv wins on existing", `{"k":0}`, []KV{{"k", []byte(`1`)}, {"k", []byte(`2`)}}, `{"k":2}`},
		{"key needing escape", `{}`, []KV{{"a\"b", []byte(`1`)}}, `{"a\"b":1}`},
		{"leading and trailing document whitespace", " {\"a\":1} \n", []KV{{"b", []byte(`2`)}}, " {\"a\":1,\"b\":2} \n"},
		{"unicode values untouched", `{"t":"日本\u00e9","n":1e-7}`, []KV{{"x", []byte(`null`)}}, `{"t":"日本\u00e9","n":1e-7,"x":null}`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, err := SetTopLevel([]byte(c.body), c.kvs...)
			require.NoError(t, err)
			assert.Equal(t, c.want, string(got))
			assert.True(t, json.Valid(got))
		})
	}
}

func TestSetTopLevelErrors(t *testing.T) {
	cases := []struct {
		name string
		body string
		kvs  []KV
	}{
		{"not an object", `[1]`, []KV{{"a", []byte(`1`)}}},
		{"empty", ``, []KV{{"a", []byte(`1`)}}},
		{"malformed", `{"a":}`, []KV{{"a", []byte(`1`)}}},
		{"trailing garbage", `{"a":1} x`, []KV{{"a", []byte(`1`)}}},
		{"invalid value", `{}`, []KV{{"a", []byte(`nope`)}}},
		{"empty value", `{}`, []KV{{"a", nil}}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := SetTopLevel([]byte(c.body), c.kvs...)
			assert.Error(t, err)
		})
	}
}

func TestRemoveTopLevel(t *testing.T) {
	cases := []struct {
		name string
		body string
		keys []string
		want string
	}{
		{"middle", `{"a":1,"b":2,"c":3}`, []string{"b"}, `{"a":1,"c":3}`},
		{"first", `{"a":1,"b":2,"c":3}`, []string{"a"}, `{"b":2,"c":3}`},
		{"last", `{"a":1,"b":2,"c":3}`, []string{"c"}, `{"a":1,"b":2}`},
		{"only", `{"a":1}`, []string{"a"}, `{}`},
		{"all", `{"a":1,"b":2}`, []string{"a", "b"}, `{}`},
		{"first two", `{"a":1,"b":2,"c":3}`, []string{"a", "b"}, `{"c":3}`},
		{"last two", `{"a":1,"b":2,"c":3}`, []string{"b", "c"}, `{"a":1}`},
		{"alternating", `{"a":1,"b":2,"c":3,"d":4}`, []string{"a", "c"}, `{"b":2,"d":4}`},
		{"duplicates all removed", `{"s":1,"a":2,"s":3}`, []string{"s"}, `{"a":2}`},
		{"absent", `{"a":1}`, []string{"z"}, `{"a":1}`},
		{"whitespace kept", "{ \"a\" : 1 , \"b\" : 2 }", []string{"a"}, "{ \"b\" : 2 }"},
		{"nested untouched", `{"o":{"a":1},"a":2}`, []string{"a"}, `{"o":{"a":1}}`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, err := RemoveTopLevel([]byte(c.body), c.keys...)
			require.NoError(t, err)
			assert.Equal(t, c.want, string(got))
			assert.True(t, json.Valid(got))
		})
	}
}

func TestEditTopLevel(t *testing.T) {
	// The vLLM prefill edit: cap tokens, force non-streaming, drop stream options.
	body := `{"model":"m","max_tokens":50,"stream":true,"stream_options":{"include_usage":true},"top_p":0.95,"min_tokens":3}`
	got, err := EditTopLevel([]byte(body),
		[]KV{{"max_tokens", []byte(`1`)}, {"stream", []byte(`false`)}, {"kv_transfer_params", []byte(`{"do_remote_decode":true}`)}},
		[]string{"stream_options", "min_tokens"})
	require.NoError(t, err)
	assert.Equal(t, `{"model":"m","max_tokens":1,"stream":false,"top_p":0.95,"kv_transfer_params":{"do_remote_decode":true}}`, string(got))
}

func TestTopLevel(t *testing.T) {
	cases := []struct {
		name, body, key, want string
		ok                    bool
	}{
		{"number", `{"a":0.95}`, "a", `0.95`, true},
		{"object", `{"a": {"b" : 1} }`, "a", `{"b" : 1}`, true},
		{"absent", `{"a":1}`, "b", ``, false},
		{"nested not top level", `{"o":{"b":1}}`, "b", ``, false},
		{"duplicate: last wins", `{"a":1,"a":2}`, "a", `2`, true},
		{"escaped key", `{"\u0061":"x"}`, "a", `"x"`, true},
		{"invalid body", `{"a":1`, "a", ``, false},
		{"not object", `[{"a":1}]`, "a", ``, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			raw, ok := TopLevel([]byte(c.body), c.key)
			assert.Equal(t, c.ok, ok)
			assert.Equal(t, c.want, string(raw))
		})
	}
}

func FuzzSetTopLevel(f *testing.F) {
	seeds := []string{
		`{}`, `{"a":1}`, `{"a":1,"a":2}`, ` { "k" : [1,{"k":2}] , "b":"\"k\"" } `,
		`{"bootstrap_room":1,"text":"hi"}`, `{"\u006b":true}`, `[1]`, `{"a":`,
	}
	for _, s := range seeds {
		f.Add([]byte(s), "k", uint8(0))
		f.Add([]byte(s), "bootstrap_room", uint8(1))
	}
	values := [][]byte{[]byte(`1`), []byte(`"x\u00e9"`), []byte(`[1,{"a":null}]`), []byte(`{}`), []byte(`-0.95e+2`)}
	f.Fuzz(func(t *testing.T, body []byte, key string, vi uint8) {
		value := values[int(vi)%len(values)]
		out, err := SetTopLevel(body, KV{Key: key, Value: value})
		var in map[string]json.RawMessage
		if !utf8.Valid(body) || !utf8.ValidString(key) || json.Unmarshal(body, &in) != nil || in == nil {
			return // only valid objects have a contract; the call must just not panic
		}
		if err != nil {
			t.Fatalf("SetTopLevel(%q, %q): %v", body, key, err)
		}
		if !json.Valid(out) {
			t.Fatalf("invalid output %q from %q", out, body)
		}
		var got map[string]json.RawMessage
		if err := json.Unmarshal(out, &got); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got[key], value) {
			t.Fatalf("key %q = %q, want %q (out %q)", key, got[key], value, out)
		}
		delete(in, key)
		delete(got, key)
		if len(in) != len(got) {
			t.Fatalf("other keys changed: in %v got %v", in, got)
		}
		for k, v := range in {
			if !bytes.Equal(got[k], v) {
				t.Fatalf("key %q changed: %q -> %q", k, v, got[k])
			}
		}
		// Exactly one occurrence of key remains.
		open, _ := objectStart(out)
		it := newObjIter(out, open)
		n := 0
		for it.next() {
			if keyEquals(out, it.m, key) {
				n++
			}
		}
		if n != 1 {
			t.Fatalf("key %q occurs %d times in %q", key, n, out)
		}
	})
}
