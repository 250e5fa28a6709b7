package pd

import (
	"encoding/json"
	"errors"
	"net/http"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/smg-project/smg-extproc/pkg/apierr"
)

func TestPrefillError(t *testing.T) {
	cases := []struct {
		status     int
		body       string
		wantStatus int
		code, msg  string
	}{
		{400, "bad", 400, CodePrefillBadRequest, "Prefill server error (400 Bad Request): bad"}, // item 28
		{404, "", 404, CodePrefillNotFound, "Prefill server error (404 Not Found): "},
		{500, `{"error":"x"}`, 500, CodePrefillInternalError, `Prefill server error (500 Internal Server Error): {"error":"x"}`},
		{502, "gw", 502, CodePrefillBadGateway, "Prefill server error (502 Bad Gateway): gw"},
		{503, "busy", 503, CodePrefillUnavailable, "Prefill server error (503 Service Unavailable): busy"},
		{429, "slow down", 500, CodePrefillError, "Prefill server error (429 Too Many Requests): slow down"},
		{504, "t", 500, CodePrefillError, "Prefill server error (504 Gateway Timeout): t"},
		{418, "\xff", 500, CodePrefillError, "Prefill server error (418 I'm a teapot): \ufffd"},
	}
	for _, c := range cases {
		e := PrefillError(c.status, []byte(c.body))
		assert.Equal(t, c.wantStatus, e.Status, c.msg)
		assert.Equal(t, c.code, e.Code)
		assert.Equal(t, c.msg, e.Message)
	}
}

func TestDecodeError(t *testing.T) {
	cases := []struct {
		name       string
		status     int
		body       string
		wantStatus int
		code, msg  string
	}{
		{"503 error.message (item 25)", 503, `{"error":{"message":"busy"}}`, 503, CodeDecodeUnavailable, "busy"},
		{"429 -> 500 (item 26)", 429, `{"error":{"message":"full"}}`, 500, CodeDecodeError, "full"},
		{"422 -> 500 (item 26)", 422, `{"detail":"x"}`, 500, CodeDecodeError, `{"detail":"x"}`},
		{"400", 400, `{"object":"error","message":"bad input","code":400}`, 400, CodeDecodeBadRequest, "bad input"},
		{"404 raw text", 404, "not here", 404, CodeDecodeNotFound, "not here"},
		{"500 error wins over message", 500, `{"message":"outer","error":{"message":"inner"}}`, 500, CodeDecodeInternalError, "inner"},
		{"502 error is a string", 502, `{"error":"boom"}`, 502, CodeDecodeBadGateway, `{"error":"boom"}`},
		{"message not a string", 500, `{"message":5}`, 500, CodeDecodeInternalError, `{"message":5}`},
		{"escaped message", 503, `{"error":{"message":"a\"b\u00e9"}}`, 503, CodeDecodeUnavailable, `a"bé`},
		{"empty body", 500, ``, 500, CodeDecodeInternalError, ``},
		{"not an object", 500, `["x"]`, 500, CodeDecodeInternalError, `["x"]`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			e := DecodeError(c.status, []byte(c.body))
			assert.Equal(t, c.wantStatus, e.Status)
			assert.Equal(t, c.code, e.Code)
			assert.Equal(t, c.msg, e.Message)
		})
	}
	// The full client body of item 25.
	assert.JSONEq(t, `{"error":{"type":"Service Unavailable","code":"decode_unavailable","message":"busy","param":null}}`,
		string(DecodeError(503, []byte(`{"error":{"message":"busy"}}`)).Body()))
}

func TestDecodeReadError(t *testing.T) {
	cause := errors.New("connection reset")
	e := DecodeReadError(429, cause)
	assert.Equal(t, 500, e.Status)
	assert.Equal(t, CodeDecodeReadFailed, e.Code)
	assert.Equal(t, "Decode server error: connection reset", e.Message)
	assert.ErrorIs(t, e, cause)
	assert.Equal(t, 503, DecodeReadError(503, cause).Status)
}

func TestDecodeStreamErrorFrame(t *testing.T) {
	cases := []struct {
		name   string
		status int
		body   string
		want   string
	}{
		{"json body embedded (item 27)", 500, `{"error":{"message":"boom"}}`, `data: {"error":{"message":{"error":{"message":"boom"}},"status":500}}` + "\n\n"},
		{"pretty json compacted onto one line", 503, "{\n  \"detail\" : [1, 0.95]\n}", `data: {"error":{"message":{"detail":[1,0.95]},"status":503}}` + "\n\n"},
		{"text body as string", 502, "Bad \"Gateway\"\n", `data: {"error":{"message":"Bad \"Gateway\"\n","status":502}}` + "\n\n"},
		{"empty body", 500, "", `data: {"error":{"message":"","status":500}}` + "\n\n"},
		{"scalar json", 429, "42", `data: {"error":{"message":42,"status":429}}` + "\n\n"},
		{"invalid utf8 text", 500, "\xff", "data: {\"error\":{\"message\":\"\ufffd\",\"status\":500}}\n\n"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got := DecodeStreamErrorFrame(c.status, []byte(c.body))
			assert.Equal(t, c.want, string(got))
			payload := got[len("data: ") : len(got)-2]
			assert.True(t, json.Valid(payload))
			assert.NotContains(t, string(payload), "\n")
		})
	}
}

func TestTransportError(t *testing.T) {
	cause := syscall.ECONNREFUSED
	e := TransportError(cause)
	assert.Equal(t, http.StatusBadGateway, e.Status)
	assert.Equal(t, apierr.CodeTransportFailed, e.Code)
	assert.Equal(t, "Transport error: "+cause.Error(), e.Message)
	assert.ErrorIs(t, e, cause)
	require.NotNil(t, TransportError(nil))
}
