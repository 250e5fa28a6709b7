package common

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"sync"
	"time"
)

// MaxBodyBytes caps the request bodies a fake reads.
const MaxBodyBytes = 64 << 20

// RecordedRequest is one request received on an engine route.
type RecordedRequest struct {
	Method   string
	Path     string
	RawQuery string
	Header   http.Header
	Body     []byte
	Time     time.Time
}

type recordedRequestJSON struct {
	Method   string          `json:"method"`
	Path     string          `json:"path"`
	RawQuery string          `json:"raw_query"`
	Header   http.Header     `json:"headers"`
	Body     string          `json:"body"`
	BodyJSON json.RawMessage `json:"body_json,omitempty"`
	Time     time.Time       `json:"time"`
}

// MarshalJSON renders the body both as raw text ("body") and, when it is
// valid JSON, as embedded JSON ("body_json").
func (r RecordedRequest) MarshalJSON() ([]byte, error) {
	j := recordedRequestJSON{
		Method: r.Method, Path: r.Path, RawQuery: r.RawQuery,
		Header: r.Header, Body: string(r.Body), Time: r.Time,
	}
	if len(r.Body) > 0 && json.Valid(r.Body) {
		j.BodyJSON = json.RawMessage(r.Body)
	}
	return json.Marshal(j)
}

// UnmarshalJSON is the inverse of MarshalJSON.
func (r *RecordedRequest) UnmarshalJSON(b []byte) error {
	var j recordedRequestJSON
	if err := json.Unmarshal(b, &j); err != nil {
		return err
	}
	*r = RecordedRequest{
		Method: j.Method, Path: j.Path, RawQuery: j.RawQuery,
		Header: j.Header, Body: []byte(j.Body), Time: j.Time,
	}
	return nil
}

// ErrBodyTooLarge is returned by ReadBody for bodies over MaxBodyBytes.
var ErrBodyTooLarge = errors.New("request body too large")

// ReadBody reads the whole request body (at most MaxBodyBytes).
func ReadBody(r *http.Request) ([]byte, error) {
	if r.Body == nil {
		return nil, nil
	}
	b, err := io.ReadAll(io.LimitReader(r.Body, MaxBodyBytes+1))
	if err != nil {
		return nil, fmt.Errorf("read body: %w", err)
	}
	if len(b) > MaxBodyBytes {
		return nil, ErrBodyTooLarge
	}
	return b, nil
}

// RequestLog is a bounded, concurrency-safe list of received requests. When
// full, the oldest entries are dropped (and counted).
type RequestLog struct {
	mu      sync.Mutex
	reqs    ring[RecordedRequest]
	total   uint64
	dropped uint64
}

// NewRequestLog returns a log keeping at most limit requests (limit <= 0: 10000).
func NewRequestLog(limit int) *RequestLog {
	if limit <= 0 {
		limit = 10000
	}
	return &RequestLog{reqs: newRing[RecordedRequest](limit)}
}

// Record stores a request; body is kept as given (callers pass a fresh slice).
func (l *RequestLog) Record(r *http.Request, body []byte, at time.Time) {
	rec := RecordedRequest{
		Method: r.Method, Path: r.URL.Path, RawQuery: r.URL.RawQuery,
		Header: r.Header.Clone(), Body: body, Time: at,
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.total++
	if l.reqs.add(rec) {
		l.dropped++
	}
}

// Snapshot returns a copy of the recorded requests in arrival order.
func (l *RequestLog) Snapshot() []RecordedRequest {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.reqs.snapshot()
}

// Total is the number of requests recorded since the last Reset, including dropped ones.
func (l *RequestLog) Total() uint64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.total
}

// Dropped is how many requests were evicted since the last Reset.
func (l *RequestLog) Dropped() uint64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.dropped
}

// Reset empties the log.
func (l *RequestLog) Reset() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.reqs.reset()
	l.total = 0
	l.dropped = 0
}

// ReadRecord reads r's body (as ReadBody does) and records the request,
// stamped with the time ReadRecord was called. The request is recorded even
// when reading its body fails (with a nil body).
func (l *RequestLog) ReadRecord(r *http.Request) ([]byte, error) {
	now := time.Now()
	body, err := ReadBody(r)
	l.Record(r, body, now)
	return body, err
}
