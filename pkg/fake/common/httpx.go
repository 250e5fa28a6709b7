package common

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"strconv"
	"time"
)

// WriteJSON writes v as a JSON response with a Content-Length.
func WriteJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		status = http.StatusInternalServerError
		b = []byte(`{"error":{"message":"fake: marshal response failed"}}`)
	}
	WriteRaw(w, status, "application/json", b)
}

// WriteRaw writes body with the given content type and a Content-Length.
func WriteRaw(w http.ResponseWriter, status int, contentType string, body []byte) {
	h := w.Header()
	if contentType != "" {
		h.Set("Content-Type", contentType)
	}
	h.Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

// ObjectError is the SGLang/vLLM ErrorResponse envelope:
// {"object":"error","message":…,"type":…,"param":null,"code":status}.
func ObjectError(status int, typ, msg string) map[string]any {
	return map[string]any{"object": "error", "message": msg, "type": typ, "param": nil, "code": status}
}

// NestedError is the OpenAI envelope {"error":{"message","type","param":null,"code"}}.
func NestedError(status int, typ, msg string) map[string]any {
	return map[string]any{"error": map[string]any{"message": msg, "type": typ, "param": nil, "code": status}}
}

// MessageError is the bare {"error":{"message":…}} envelope (SGLang /generate ValueError).
func MessageError(msg string) map[string]any {
	return map[string]any{"error": map[string]any{"message": msg}}
}

// Sleep waits d or until ctx is done; it returns ctx.Err() in the latter case.
func Sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// SSE writes a text/event-stream response.
type SSE struct {
	w         http.ResponseWriter
	rc        *http.ResponseController
	flushEach bool
	started   bool
	buf       []byte
}

// NewSSE wraps w. With flushEach, every event is flushed as soon as it is
// written; otherwise events are flushed only by Flush (or when the handler
// returns), which is cheaper when there is no delay between events.
func NewSSE(w http.ResponseWriter, flushEach bool) *SSE {
	return &SSE{w: w, rc: http.NewResponseController(w), flushEach: flushEach}
}

// Started reports whether the response head has been written.
func (s *SSE) Started() bool { return s.started }

// Start writes the response head (200, text/event-stream) once.
func (s *SSE) Start() {
	if s.started {
		return
	}
	s.started = true
	h := s.w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	s.w.WriteHeader(http.StatusOK)
}

// Data writes one "data: <json>\n\n" event.
func (s *SSE) Data(v any) error { return s.Event("", v) }

// Event writes one event with an optional "event: <name>" line.
func (s *SSE) Event(name string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	s.Start()
	s.buf = s.buf[:0]
	if name != "" {
		s.buf = append(s.buf, "event: "...)
		s.buf = append(s.buf, name...)
		s.buf = append(s.buf, '\n')
	}
	s.buf = append(s.buf, "data: "...)
	s.buf = append(s.buf, b...)
	s.buf = append(s.buf, "\n\n"...)
	return s.write()
}

// Done writes "data: [DONE]\n\n".
func (s *SSE) Done() error {
	s.Start()
	s.buf = append(s.buf[:0], "data: [DONE]\n\n"...)
	return s.write()
}

// Flush pushes buffered bytes to the client.
func (s *SSE) Flush() error { return s.rc.Flush() }

func (s *SSE) write() error {
	if _, err := s.w.Write(s.buf); err != nil {
		return err
	}
	if s.flushEach {
		return s.rc.Flush()
	}
	return nil
}

// WriteMethodNotAllowed answers 405 {"detail":"Method Not Allowed"} with
// "Allow: POST" (FastAPI's answer on a POST-only route).
func WriteMethodNotAllowed(w http.ResponseWriter) {
	w.Header().Set("Allow", http.MethodPost)
	WriteJSON(w, http.StatusMethodNotAllowed, map[string]any{"detail": "Method Not Allowed"})
}

// BodyErrorStatus is the status for a ReadBody error: 413 for a body over
// MaxBodyBytes, else 400.
func BodyErrorStatus(err error) int {
	if errors.Is(err, ErrBodyTooLarge) {
		return http.StatusRequestEntityTooLarge
	}
	return http.StatusBadRequest
}

// WriteFailBody answers an injected failure: status with body, typed
// application/json when body is valid JSON and text/plain otherwise.
func WriteFailBody(w http.ResponseWriter, status int, body string) {
	ct := "text/plain; charset=utf-8"
	if json.Valid([]byte(body)) {
		ct = "application/json"
	}
	WriteRaw(w, status, ct, []byte(body))
}
