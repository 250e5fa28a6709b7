package pd

import (
	"crypto/rand"
	"strings"
)

// RequestID returns the client's request id (the first non-empty of
// x-request-id, x-correlation-id, x-trace-id, request-id, looked up through
// get with lower-case names), or a fresh OpenAI-style id: Route.IDPrefix
// ("req-" without a route) plus 24 random [A-Za-z0-9]. The generated id is
// for logs and the response header only; it is never sent on the legs.
func RequestID(route *Route, get func(lowerName string) string) string {
	if get != nil {
		for _, h := range [...]string{"x-request-id", "x-correlation-id", "x-trace-id", "request-id"} {
			if v := get(h); v != "" {
				return v
			}
		}
	}
	prefix := "req-"
	if route != nil && route.IDPrefix != "" {
		prefix = route.IDPrefix
	}
	return prefix + randomAlnum()
}

// randomAlnum returns 24 uniform [A-Za-z0-9] characters. Rejection sampling
// (bytes >= 248 are redrawn) keeps the 62 symbols equally likely.
func randomAlnum() string {
	const (
		alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
		n        = 24
		limit    = 256 - 256%len(alphabet) // 248
	)
	var out [n]byte
	var buf [32]byte
	for i := 0; i < n; {
		_, _ = rand.Read(buf[:]) // crypto/rand.Read never fails since Go 1.24
		for _, c := range buf {
			if int(c) < limit {
				out[i] = alphabet[int(c)%len(alphabet)]
				if i++; i == n {
					break
				}
			}
		}
	}
	return string(out[:])
}

// ForwardHeader reports whether a client request header is copied to both
// legs: SMG's allowlist authorization, x-request-id, x-correlation-id,
// traceparent, tracestate, x-smg-routing-key and any x-request-id-*.
// Matching is case-insensitive.
func ForwardHeader(lowerName string) bool {
	const idPrefix = "x-request-id-"
	for _, h := range [...]string{"authorization", "x-request-id", "x-correlation-id", "traceparent", "tracestate", "x-smg-routing-key"} {
		if len(h) == len(lowerName) && strings.EqualFold(h, lowerName) {
			return true
		}
	}
	return len(lowerName) >= len(idPrefix) && strings.EqualFold(lowerName[:len(idPrefix)], idPrefix)
}
