package pd

import (
	"regexp"
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestRequestID(t *testing.T) {
	headers := func(h map[string]string) func(string) string {
		return func(name string) string { return h[name] }
	}
	chat := mustRoute(t, "/v1/chat/completions")
	cases := []struct {
		name string
		h    map[string]string
		want string
	}{
		{"x-request-id first", map[string]string{"x-request-id": "a", "x-correlation-id": "b", "x-trace-id": "c", "request-id": "d"}, "a"},
		{"x-correlation-id second", map[string]string{"x-correlation-id": "b", "x-trace-id": "c", "request-id": "d"}, "b"},
		{"x-trace-id third", map[string]string{"x-trace-id": "c", "request-id": "d"}, "c"},
		{"request-id last", map[string]string{"request-id": "d"}, "d"},
		{"empty values skipped", map[string]string{"x-request-id": "", "request-id": "d"}, "d"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			assert.Equal(t, c.want, RequestID(chat, headers(c.h)))
		})
	}

	// Generated ids (item 17): route prefix + 24 alphanumerics, fresh each time.
	for _, r := range Routes() {
		re := regexp.MustCompile("^" + regexp.QuoteMeta(r.IDPrefix) + "[A-Za-z0-9]{24}$")
		a := RequestID(r, headers(nil))
		b := RequestID(r, nil)
		assert.Regexp(t, re, a, r.ClientPath)
		assert.Regexp(t, re, b, r.ClientPath)
		assert.NotEqual(t, a, b)
	}
	assert.Regexp(t, `^gnt-[A-Za-z0-9]{24}$`, RequestID(mustRoute(t, "/generate"), headers(nil)))
	assert.Regexp(t, `^chatcmpl-[A-Za-z0-9]{24}$`, RequestID(chat, headers(nil)))
	assert.Regexp(t, `^req-[A-Za-z0-9]{24}$`, RequestID(nil, nil))
}

func TestRandomAlnumUsesWholeAlphabet(t *testing.T) {
	seen := map[rune]bool{}
	for range 200 {
		for _, c := range randomAlnum() {
			seen[c] = true
		}
	}
	assert.Len(t, seen, 62) // 4800 draws miss a symbol with negligible probability
}

func TestForwardHeader(t *testing.T) {
	cases := []struct {
		name string
		want bool
	}{
		{"authorization", true},
		{"Authorization", true},
		{"x-request-id", true},
		{"X-Request-Id", true},
		{"x-request-id-foo", true},
		{"X-Request-Id-Foo", true},
		{"x-request-id-", true},
		{"x-correlation-id", true},
		{"traceparent", true},
		{"tracestate", true},
		{"x-smg-routing-key", true},
		{"x-request-idx", false},
		{"x-request", false},
		{"x-custom", false},
		{"cookie", false},
		{"user-agent", false},
		{"content-type", false},
		{"content-length", false},
		{"host", false},
		{"x-trace-id", false},
		{"x-smg-target-worker", false},
		{"", false},
	}
	for _, c := range cases {
		assert.Equal(t, c.want, ForwardHeader(c.name), c.name)
	}
}
