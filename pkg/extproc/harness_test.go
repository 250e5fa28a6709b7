package extproc_test

// Test harness: drives (*extproc.Server).Process through an in-memory
// ExternalProcessor_ProcessServer, standing in for Envoy, with httptest
// servers as prefill workers. No decode traffic exists in these tests: the
// harness plays Envoy's decode leg by sending response headers/bodies.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/smg-project/smg-extproc/pkg/extproc"
	"github.com/smg-project/smg-extproc/pkg/metrics"
	"github.com/smg-project/smg-extproc/pkg/pairing"
	"github.com/smg-project/smg-extproc/pkg/policy"
	"github.com/smg-project/smg-extproc/pkg/workers"
)

// wait is the generous upper bound for anything the tests wait on.
const wait = 5 * time.Second

// ---------------------------------------------------------------------------
// In-memory ext_proc stream.

type fakeStream struct {
	grpc.ServerStream // nil: only the methods below are used
	ctx               context.Context
	in                chan *extprocv3.ProcessingRequest
	out               chan *extprocv3.ProcessingResponse
}

var _ extprocv3.ExternalProcessor_ProcessServer = (*fakeStream)(nil)

func (s *fakeStream) Context() context.Context     { return s.ctx }
func (s *fakeStream) SetHeader(metadata.MD) error  { return nil }
func (s *fakeStream) SendHeader(metadata.MD) error { return nil }
func (s *fakeStream) SetTrailer(metadata.MD)       {}
func (s *fakeStream) SendMsg(m any) error {
	r, ok := m.(*extprocv3.ProcessingResponse)
	if !ok {
		return fmt.Errorf("unexpected message type %T", m)
	}
	return s.Send(r)
}

func (s *fakeStream) RecvMsg(m any) error {
	r, err := s.Recv()
	if err != nil {
		return err
	}
	dst, ok := m.(*extprocv3.ProcessingRequest)
	if !ok {
		return fmt.Errorf("unexpected message type %T", m)
	}
	proto.Reset(dst)
	proto.Merge(dst, r)
	return nil
}

func (s *fakeStream) Send(r *extprocv3.ProcessingResponse) error {
	select {
	case s.out <- r:
		return nil
	case <-s.ctx.Done():
		return status.FromContextError(s.ctx.Err()).Err()
	}
}

func (s *fakeStream) Recv() (*extprocv3.ProcessingRequest, error) {
	select {
	case m, ok := <-s.in:
		if !ok {
			return nil, io.EOF
		}
		return m, nil
	case <-s.ctx.Done():
		return nil, status.FromContextError(s.ctx.Err()).Err()
	}
}

// session is one client request: one Process call.
type session struct {
	st        *fakeStream
	cancel    context.CancelFunc
	done      chan error
	closeOnce sync.Once
	result    error
	ended     bool
	mu        sync.Mutex
	timeout   time.Duration // per answer
}

func openSession(srv *extproc.Server) *session {
	ctx, cancel := context.WithCancel(context.Background())
	st := &fakeStream{ctx: ctx, in: make(chan *extprocv3.ProcessingRequest, 16), out: make(chan *extprocv3.ProcessingResponse, 16)}
	s := &session{st: st, cancel: cancel, done: make(chan error, 1), timeout: wait}
	go func() { s.done <- srv.Process(st) }()
	return s
}

// open starts a session that is torn down at the end of the test.
func (e *env) open(t *testing.T) *session {
	t.Helper()
	s := openSession(e.srv)
	t.Cleanup(func() { _ = s.end() })
	return s
}

func (s *session) send(m *extprocv3.ProcessingRequest) { s.st.in <- m }

// next waits for the processor's next message.
func (s *session) next() (*extprocv3.ProcessingResponse, error) {
	select {
	case r := <-s.st.out:
		return r, nil
	case err := <-s.done:
		s.finished(err)
		return nil, fmt.Errorf("Process returned (%v) instead of answering", err)
	case <-time.After(s.timeout):
		return nil, fmt.Errorf("no answer from the processor within %s", s.timeout)
	}
}

func (s *session) recv(t *testing.T) *extprocv3.ProcessingResponse {
	t.Helper()
	r, err := s.next()
	require.NoError(t, err)
	return r
}

func (s *session) finished(err error) {
	s.mu.Lock()
	s.ended, s.result = true, err
	s.mu.Unlock()
}

// waitDone waits for Process to return.
func (s *session) waitDone() error {
	s.mu.Lock()
	if s.ended {
		defer s.mu.Unlock()
		return s.result
	}
	s.mu.Unlock()
	select {
	case err := <-s.done:
		s.finished(err)
		return err
	case <-time.After(s.timeout):
		return fmt.Errorf("Process did not return within %s", s.timeout)
	}
}

// end is Envoy closing the stream normally (EOF), then gRPC cancelling the
// stream context once the handler returned.
func (s *session) end() error {
	var err error
	s.closeOnce.Do(func() {
		close(s.st.in)
		err = s.waitDone()
		s.cancel()
	})
	return err
}

// abort is the client (or Envoy) resetting the stream: the context is cancelled.
func (s *session) abort() error {
	s.cancel()
	var err error
	s.closeOnce.Do(func() { err = s.waitDone() })
	return err
}

// ---------------------------------------------------------------------------
// ext_proc message builders.

func headerMap(kv ...string) *corev3.HeaderMap {
	hm := &corev3.HeaderMap{}
	for i := 0; i+1 < len(kv); i += 2 {
		hm.Headers = append(hm.Headers, &corev3.HeaderValue{Key: kv[i], RawValue: []byte(kv[i+1])})
	}
	return hm
}

// reqHeaders is what Envoy sends for a client POST to path.
func reqHeaders(path string, eos bool, kv ...string) *extprocv3.ProcessingRequest {
	all := append([]string{":method", "POST", ":path", path, ":authority", "gateway.local", ":scheme", "http"}, kv...)
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{
		RequestHeaders: &extprocv3.HttpHeaders{Headers: headerMap(all...), EndOfStream: eos}}}
}

func reqBody(body string, eos bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
		RequestBody: &extprocv3.HttpBody{Body: []byte(body), EndOfStream: eos}}}
}

func respHeaders(status int, eos bool, kv ...string) *extprocv3.ProcessingRequest {
	all := append([]string{":status", fmt.Sprint(status)}, kv...)
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{
		ResponseHeaders: &extprocv3.HttpHeaders{Headers: headerMap(all...), EndOfStream: eos}}}
}

func respBody(body string, eos bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
		ResponseBody: &extprocv3.HttpBody{Body: []byte(body), EndOfStream: eos}}}
}

// stdHeaders are the client headers most tests send.
var stdHeaders = []string{"content-type", "application/json", "content-length", "100", "authorization", "Bearer tok"}

// dispatch sends request headers and body and returns both answers. The
// headers answer must be a plain continue.
func (s *session) dispatch(t *testing.T, path, body string, hdrs ...string) (hdrAns, bodyAns *extprocv3.ProcessingResponse) {
	t.Helper()
	if hdrs == nil {
		hdrs = stdHeaders
	}
	s.send(reqHeaders(path, false, hdrs...))
	hdrAns = s.recv(t)
	require.NotNil(t, hdrAns.GetRequestHeaders(), "request headers answer: %v", hdrAns)
	s.send(reqBody(body, true))
	bodyAns = s.recv(t)
	return hdrAns, bodyAns
}

// ---------------------------------------------------------------------------
// Answer inspection.

func setHeaders(m *extprocv3.HeaderMutation) map[string]string {
	out := map[string]string{}
	for _, h := range m.GetSetHeaders() {
		v := string(h.GetHeader().GetRawValue())
		if v == "" {
			v = h.GetHeader().GetValue()
		}
		out[h.GetHeader().GetKey()] = v
	}
	return out
}

func decodeJSON(t *testing.T, b []byte) map[string]any {
	t.Helper()
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var m map[string]any
	require.NoError(t, dec.Decode(&m), "body %q", b)
	return m
}

// requireImmediate checks an ImmediateResponse and returns it with its headers.
func requireImmediate(t *testing.T, r *extprocv3.ProcessingResponse, status int) (*extprocv3.ImmediateResponse, map[string]string) {
	t.Helper()
	im := r.GetImmediateResponse()
	require.NotNil(t, im, "expected an ImmediateResponse, got %v", r)
	require.EqualValues(t, status, im.GetStatus().GetCode(), "status; body %q", im.GetBody())
	return im, setHeaders(im.GetHeaders())
}

// requireAPIError checks an SMG error answer (§6.2) and returns error.message.
func requireAPIError(t *testing.T, r *extprocv3.ProcessingResponse, status int, code string) string {
	t.Helper()
	im, h := requireImmediate(t, r, status)
	require.Equal(t, "application/json", h["content-type"])
	require.Equal(t, code, h["x-smg-error-code"])
	require.NotEmpty(t, h["x-request-id"], "every answer carries x-request-id")
	var top map[string]json.RawMessage
	require.NoError(t, json.Unmarshal(im.GetBody(), &top), "body %q", im.GetBody())
	require.Len(t, top, 1, "body %s", im.GetBody())
	var inner map[string]any
	require.NoError(t, json.Unmarshal(top["error"], &inner))
	require.Len(t, inner, 4, "error object must have exactly type/code/message/param: %s", im.GetBody())
	require.Equal(t, http.StatusText(status), inner["type"])
	require.Equal(t, code, inner["code"])
	require.Contains(t, inner, "param")
	require.Nil(t, inner["param"])
	msg, ok := inner["message"].(string)
	require.True(t, ok, "message must be a string: %s", im.GetBody())
	return msg
}

func destination(r *extprocv3.ProcessingResponse) string {
	return r.GetDynamicMetadata().GetFields()["envoy.lb"].GetStructValue().GetFields()["x-gateway-destination-endpoint"].GetStringValue()
}

// ---------------------------------------------------------------------------
// Fake prefill workers.

type captured struct {
	Path   string
	Query  string
	Header http.Header
	Body   []byte
}

type prefillFake struct {
	*httptest.Server
	reqs chan captured // every request, buffered
	hits atomic.Int64
	stop chan struct{} // closed at cleanup so blocked handlers return
}

// newPrefill starts a fake prefill; h runs after the request body was read.
func newPrefill(t *testing.T, h func(w http.ResponseWriter, r *http.Request, f *prefillFake)) *prefillFake {
	t.Helper()
	f := &prefillFake{reqs: make(chan captured, 1024), stop: make(chan struct{})}
	f.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		f.hits.Add(1)
		f.reqs <- captured{Path: r.URL.Path, Query: r.URL.RawQuery, Header: r.Header.Clone(), Body: body}
		h(w, r, f)
	}))
	t.Cleanup(f.Close)
	t.Cleanup(func() { close(f.stop) }) // runs before Close
	return f
}

// replyWith answers every prefill request with status and body.
func replyWith(status int, body string) func(http.ResponseWriter, *http.Request, *prefillFake) {
	return func(w http.ResponseWriter, _ *http.Request, _ *prefillFake) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		_, _ = io.WriteString(w, body)
	}
}

func (f *prefillFake) request(t *testing.T) captured {
	t.Helper()
	select {
	case c := <-f.reqs:
		return c
	case <-time.After(wait):
		t.Fatal("the prefill received no request within 5s")
		return captured{}
	}
}

// closedURL is an http URL nobody listens on.
func closedURL(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := l.Addr().String()
	require.NoError(t, l.Close())
	return "http://" + addr
}

// ---------------------------------------------------------------------------
// Processor environment.

const decodeURL = "http://10.0.0.2:8000"

type env struct {
	srv  *extproc.Server
	reg  *workers.Registry
	prom *prometheus.Registry
}

func newWorker(t *testing.T, url string, typ workers.Type, port *int) *workers.Worker {
	t.Helper()
	w, err := workers.New(workers.Spec{URL: url, Type: typ, BootstrapPort: port}, nil)
	require.NoError(t, err)
	w.SetHealthy(true)
	return w
}

func newEnv(t *testing.T, timeout time.Duration, ws ...*workers.Worker) *env {
	t.Helper()
	return newEnvLimit(t, timeout, 1<<20, ws...)
}

func newEnvLimit(t *testing.T, timeout time.Duration, maxPayload int64, ws ...*workers.Worker) *env {
	t.Helper()
	reg := workers.NewRegistry()
	for _, w := range ws {
		require.NoError(t, reg.Add(w))
	}
	pp, _, err := policy.New("round_robin")
	require.NoError(t, err)
	dp, _, err := policy.New("round_robin")
	require.NoError(t, err)
	prom := prometheus.NewRegistry()
	if timeout == 0 {
		timeout = 30 * time.Second
	}
	client := extproc.NewHTTPClient(2 * time.Second)
	t.Cleanup(client.CloseIdleConnections)
	srv := extproc.New(extproc.Deps{
		Log:            zerolog.Nop(),
		Registry:       reg,
		Selector:       &pairing.Selector{Prefill: pp, Decode: dp},
		Client:         client,
		Metrics:        metrics.New(prom),
		RequestTimeout: timeout,
		MaxPayloadSize: maxPayload,
	})
	return &env{srv: srv, reg: reg, prom: prom}
}

// pdEnv is the common one-prefill/one-decode setup.
type pdEnv struct {
	*env
	prefill *prefillFake
	pw, dw  *workers.Worker
}

func intp(v int) *int { return &v }

func newPD(t *testing.T, timeout time.Duration, h func(http.ResponseWriter, *http.Request, *prefillFake)) *pdEnv {
	t.Helper()
	f := newPrefill(t, h)
	pw := newWorker(t, f.URL, workers.Prefill, intp(8998))
	dw := newWorker(t, decodeURL, workers.Decode, nil)
	return &pdEnv{env: newEnv(t, timeout, pw, dw), prefill: f, pw: pw, dw: dw}
}

// requireIdle waits until every worker's in-flight count is back to zero.
func requireIdle(t *testing.T, ws ...*workers.Worker) {
	t.Helper()
	for _, w := range ws {
		require.Eventually(t, func() bool { return w.Load() == 0 }, wait, 2*time.Millisecond, "worker %s load stuck at %d", w.URL, w.Load())
	}
}

// histogramCount returns the sample count of a histogram family (all labels).
func (e *env) histogramCount(t *testing.T, name string) uint64 {
	t.Helper()
	mfs, err := e.prom.Gather()
	if err != nil { // not require: this runs inside Eventually's goroutine
		t.Errorf("gather: %v", err)
		return 0
	}
	var n uint64
	for _, mf := range mfs {
		if mf.GetName() == name {
			for _, m := range mf.GetMetric() {
				n += m.GetHistogram().GetSampleCount()
			}
		}
	}
	return n
}
