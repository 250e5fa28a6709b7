package pd

import (
	"encoding/json"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestValidDocMatchesEncodingJSON(t *testing.T) {
	cases := []string{
		``, ` `, `{}`, `[]`, `""`, `0`, `-0`, `-`, `01`, `1.`, `1.5e`, `1.5e+3`, `1E-3`, `.5`,
		`true`, `tru`, `truex`, `null`, `nul`, `false `, ` {"a":1} `, `{"a":1,}`, `{"a" 1}`,
		`{,}`, `[1,]`, `[,1]`, `[1 2]`, `{"a":[1,{"b":null}],"c":"d"}`, `{"a":"\u00e9\n\"\\\/"}`,
		`"\x"`, `"\u12"`, `"\u12G4"`, "\"a\tb\"", "\"\x01\"", `{"a":1}}`, `[[[]]]`, `[[[]]`,
		`{"a":{"b":{"c":[1,2,{"d":"e"}]}}}`, `"0123456789abcdefghij\"klmnop"`, `[1e309]`,
		"\"\xff\"", "\"\xe2\x82\"", "\"日本語テキスト\"", `{"":""}`, `{"a":1 "b":2}`, `[}`, `{]`,
	}
	for _, c := range cases {
		want := json.Valid([]byte(c)) && utf8.ValidString(c)
		assert.Equal(t, want, validDoc([]byte(c)), "input %q", c)
	}
}

func TestSkipValueDepthLimit(t *testing.T) {
	deep := strings.Repeat("[", maxDepth) + strings.Repeat("]", maxDepth)
	assert.True(t, validDoc([]byte(deep)))
	tooDeep := strings.Repeat("[", maxDepth+1) + strings.Repeat("]", maxDepth+1)
	assert.False(t, validDoc([]byte(tooDeep)))
}

func TestUnescape(t *testing.T) {
	cases := []struct{ raw, want string }{
		{`plain`, "plain"},
		{`a\nb\tc\"d\\e\/f\bg\fh\ri`, "a\nb\tc\"d\\e/f\bg\fh\ri"},
		{`\u00e9\u65e5`, "é日"},
		{`\ud83d\ude00`, "😀"},
		{`\ud83d`, "\ufffd"},
		{`\ud83dx`, "\ufffdx"},
		{`\ude00\ud83d`, "\ufffd\ufffd"},
	}
	for _, c := range cases {
		var sb strings.Builder
		unescapeTo(&sb, []byte(c.raw))
		assert.Equal(t, c.want, sb.String(), c.raw)
		// Cross-check with encoding/json.
		var s string
		require.NoError(t, json.Unmarshal([]byte(`"`+c.raw+`"`), &s))
		assert.Equal(t, s, sb.String(), c.raw)
	}
}

func TestAppendJSONString(t *testing.T) {
	cases := []string{"", "p", "[::1]", "a\"b\\c", "tab\tnl\nctl\x01", "<&>", "é日😀", "bad\xffutf8"}
	for _, c := range cases {
		out := appendJSONString(nil, c)
		require.True(t, json.Valid(out), "%q -> %s", c, out)
		var s string
		require.NoError(t, json.Unmarshal(out, &s))
		assert.Equal(t, strings.ToValidUTF8(c, "\ufffd"), s)
	}
	assert.Equal(t, `"<&>"`, string(appendJSONString(nil, "<&>")), "no HTML escaping")
}

func TestAppendCompact(t *testing.T) {
	in := "{ \"a\" : [ 1 , 0.95 ,\n\t1e-5 ] , \"s\" : \" keep  spaces \" }"
	assert.Equal(t, `{"a":[1,0.95,1e-5],"s":" keep  spaces "}`, string(appendCompact(nil, []byte(in))))
}

func FuzzValidDoc(f *testing.F) {
	for _, s := range []string{`{"a":[1,2,{"b":"c\u00e9"}]}`, `[1e5,-0.5,true,false,null]`, `"\ud83d\ude00"`, `{"a":1,}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		want := json.Valid(b) && utf8.Valid(b)
		if got := validDoc(b); got != want {
			t.Fatalf("validDoc(%q) = %t, want %t", b, got, want)
		}
	})
}
