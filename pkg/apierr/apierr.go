// Package apierr defines the gateway's error values and SMG's JSON error body.
//
// Every error the gateway mints on the request path is rendered the same way:
// status, `Content-Type: application/json`, `X-SMG-Error-Code: <code>` and
// {"error":{"type":<reason phrase>,"code":<code>,"message":<text>,"param":null}}.
package apierr

import (
	"encoding/json"
	"fmt"
	"net/http"
)

// HeaderErrorCode carries error.code so clients can branch without parsing the body.
const HeaderErrorCode = "x-smg-error-code"

// Error is a gateway error with its HTTP status and stable code.
type Error struct {
	Status  int
	Code    string
	Message string
	// RetryAfter, when > 0, is sent as a Retry-After header (seconds).
	RetryAfter int
	// Cause is the underlying error, kept for logs and errors.Is/As.
	Cause error
}

// New returns an error with the given status, code and message.
func New(status int, code, msg string) *Error {
	return &Error{Status: status, Code: code, Message: msg}
}

// Newf is New with a formatted message.
func Newf(status int, code, format string, args ...any) *Error {
	return &Error{Status: status, Code: code, Message: fmt.Sprintf(format, args...)}
}

// Wrap returns an error that keeps cause for logs.
func Wrap(cause error, status int, code, msg string) *Error {
	return &Error{Status: status, Code: code, Message: msg, Cause: cause}
}

func (e *Error) Error() string {
	if e.Cause != nil {
		return fmt.Sprintf("%d %s: %s: %v", e.Status, e.Code, e.Message, e.Cause)
	}
	return fmt.Sprintf("%d %s: %s", e.Status, e.Code, e.Message)
}

func (e *Error) Unwrap() error { return e.Cause }

type body struct {
	Error inner `json:"error"`
}

type inner struct {
	Type    string  `json:"type"`
	Code    string  `json:"code"`
	Message string  `json:"message"`
	Param   *string `json:"param"`
}

// Body renders SMG's four-key OpenAI-style error body.
func (e *Error) Body() []byte {
	b, err := json.Marshal(body{Error: inner{Type: ReasonPhrase(e.Status), Code: e.Code, Message: e.Message}})
	if err != nil { // cannot happen for strings; keep a valid body anyway
		return []byte(`{"error":{"type":"Internal Server Error","code":"internal_error","message":"error encoding failed","param":null}}`)
	}
	return b
}

// ReasonPhrase is the canonical reason phrase for status ("Service Unavailable").
func ReasonPhrase(status int) string {
	if t := http.StatusText(status); t != "" {
		return t
	}
	return "Unknown Status"
}

// HeaderSafe reports whether code can be sent as a header value.
func HeaderSafe(code string) bool {
	for i := 0; i < len(code); i++ {
		c := code[i]
		if c < 0x20 || c == 0x7f {
			return false
		}
	}
	return code != ""
}

// WriteHTTP writes e to w with SMG's headers.
func (e *Error) WriteHTTP(w http.ResponseWriter) {
	h := w.Header()
	h.Set("Content-Type", "application/json")
	if HeaderSafe(e.Code) {
		h.Set(HeaderErrorCode, e.Code)
	}
	if e.RetryAfter > 0 {
		h.Set("Retry-After", fmt.Sprint(e.RetryAfter))
	}
	w.WriteHeader(e.Status)
	_, _ = w.Write(e.Body())
}

// Stable codes used across packages.
const (
	CodeNoAvailableWorkers  = "no_available_workers"
	CodeNoCompatiblePair    = "no_compatible_pd_pair"
	CodeInvalidJSON         = "json_parse_error"
	CodeInvalidRequest      = "invalid_request"
	CodePayloadTooLarge     = "payload_too_large"
	CodeNotFound            = "not_found"
	CodeMethodNotAllowed    = "method_not_allowed"
	CodeTransportFailed     = "PD disaggregation request failed"
	CodeSerializationFailed = "serialization_failed"
	CodeNoPrefillServers    = "no_prefill_servers"
	CodeCountTokensFailed   = "prefill_count_tokens_failed"
	CodeReadResponseFailed  = "read_response_failed"
	CodeUnauthorized        = "unauthorized"
	CodeInternal            = "internal_error"
	CodeUpstreamTimeout     = "request_timeout"
)
