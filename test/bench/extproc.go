package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// extprocClient drives smg-extproc's ext_proc service the way Envoy does,
// without Envoy: the "ext_proc only" mode isolates the Go processor and its
// gRPC round trips from Envoy's proxying.
type extprocClient struct {
	conn *grpc.ClientConn
	cli  extprocv3.ExternalProcessorClient
	auth string
}

func dialExtProc(addr, authority string) (*extprocClient, error) {
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(64<<20), grpc.MaxCallSendMsgSize(64<<20)))
	if err != nil {
		return nil, err
	}
	return &extprocClient{conn: conn, cli: extprocv3.NewExternalProcessorClient(conn), auth: authority}, nil
}

func (e *extprocClient) Close() { _ = e.conn.Close() }

func rawHV(k, v string) *corev3.HeaderValue { return &corev3.HeaderValue{Key: k, RawValue: []byte(v)} }

// viaExtProc: request headers and the buffered body go to the processor, the
// bench sends the decode leg with the processor's body (as Envoy's router
// would), and the decode's response head goes to the processor before the
// body is read.
func (t *target) viaExtProc(ctx context.Context, w *workload) (sample, error) {
	start := time.Now()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st, err := t.ep.cli.Process(ctx)
	if err != nil {
		return sample{}, err
	}
	hdrs := &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
		rawHV(":authority", t.ep.auth), rawHV(":path", w.path), rawHV(":method", "POST"), rawHV(":scheme", "http"),
		rawHV("user-agent", "Go-http-client/1.1"), rawHV("content-type", "application/json"),
		rawHV("content-length", strconv.Itoa(len(w.body))), rawHV("x-forwarded-proto", "http"),
	}}
	var ph [nPhases]time.Duration
	mark := time.Now()
	lap := func(i int) {
		now := time.Now()
		ph[i] = now.Sub(mark)
		mark = now
	}
	if err := st.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{
		RequestHeaders: &extprocv3.HttpHeaders{Headers: hdrs}}}); err != nil {
		return sample{}, err
	}
	if _, err := recvKind[*extprocv3.ProcessingResponse_RequestHeaders](st); err != nil {
		return sample{}, fmt.Errorf("request headers: %w", err)
	}
	lap(0)
	if err := st.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
		RequestBody: &extprocv3.HttpBody{Body: w.body, EndOfStream: true}}}); err != nil {
		return sample{}, err
	}
	rb, err := recvKind[*extprocv3.ProcessingResponse_RequestBody](st)
	if err != nil {
		return sample{}, fmt.Errorf("request body: %w", err)
	}
	lap(1)
	common := rb.RequestBody.GetResponse()
	body := common.GetBodyMutation().GetBody()
	path := w.path
	for _, h := range common.GetHeaderMutation().GetSetHeaders() {
		if h.GetHeader().GetKey() == ":path" {
			path = string(h.GetHeader().GetRawValue())
		}
	}
	if len(body) == 0 {
		return sample{}, errors.New("request body answer carries no body mutation")
	}
	req, err := newPost(ctx, t.decode+path, body)
	if err != nil {
		return sample{}, err
	}
	resp, err := t.client.Do(req)
	if err != nil {
		return sample{}, fmt.Errorf("decode: %w", err)
	}
	defer resp.Body.Close()
	lap(2)
	rh := &corev3.HeaderMap{Headers: []*corev3.HeaderValue{rawHV(":status", strconv.Itoa(resp.StatusCode))}}
	for k, vs := range resp.Header {
		for _, v := range vs {
			rh.Headers = append(rh.Headers, rawHV(strings.ToLower(k), v))
		}
	}
	if err := st.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{
		ResponseHeaders: &extprocv3.HttpHeaders{Headers: rh}}}); err != nil {
		return sample{}, err
	}
	if _, err := recvKind[*extprocv3.ProcessingResponse_ResponseHeaders](st); err != nil {
		return sample{}, fmt.Errorf("response headers: %w", err)
	}
	lap(3)
	_ = st.CloseSend() // nothing more to process: Envoy ends the stream here too
	s, err := readAnswer(resp, w, start)
	s.phases = ph
	if err != nil {
		return s, err
	}
	if _, err := st.Recv(); !errors.Is(err, io.EOF) {
		return s, fmt.Errorf("stream end: %v", err)
	}
	return s, nil
}

func recvKind[T any](st extprocv3.ExternalProcessor_ProcessClient) (T, error) {
	var zero T
	m, err := st.Recv()
	if err != nil {
		return zero, err
	}
	if v, ok := m.Response.(T); ok {
		return v, nil
	}
	if ir := m.GetImmediateResponse(); ir != nil {
		return zero, fmt.Errorf("immediate response %d: %.200s", ir.GetStatus().GetCode(), ir.GetBody())
	}
	return zero, fmt.Errorf("unexpected answer %T", m.Response)
}
