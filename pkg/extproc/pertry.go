package extproc

import (
	"context"
	"errors"
	"io"
	"math/rand/v2"
	"strconv"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/smg-project/smg-extproc/pkg/fleet"
	"github.com/smg-project/smg-extproc/pkg/pd"
)

// RoleHeader is the gRPC metadata Envoy's per-try (upstream) ext_proc sends.
const (
	RoleHeader   = "x-smg-role"
	RolePerTry   = "per-try"
	mdAttemptKey = "attempt_key"
	// MetadataNamespace is where the processor leaves per-request state for
	// the per-try processor (forwarded by Envoy).
	MetadataNamespace = "smg"
)

func isPerTry(md metadata.MD) bool {
	for _, v := range md.Get(RoleHeader) {
		if v == RolePerTry {
			return true
		}
	}
	return false
}

// processPerTry serves one try of the decode leg (upstream filter): it records
// the decode's outcome and, for a retryable status with attempts left, waits
// the backoff and answers with an internal redirect so Envoy runs a whole new
// attempt through the router-level processor.
func (s *Server) processPerTry(stream extprocv3.ExternalProcessor_ProcessServer) error {
	ctx := stream.Context()
	for {
		m, err := stream.Recv()
		if err != nil {
			if errors.Is(err, io.EOF) || status.Code(err) == codes.Canceled || ctx.Err() != nil {
				return nil
			}
			return nil
		}
		var resp *extprocv3.ProcessingResponse
		switch v := m.Request.(type) {
		case *extprocv3.ProcessingRequest_ResponseHeaders:
			r, err := s.perTryResponseHeaders(ctx, m, v.ResponseHeaders)
			if err != nil || r == nil {
				return err
			}
			resp = r
		case *extprocv3.ProcessingRequest_RequestHeaders:
			resp = &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{}}}
		case *extprocv3.ProcessingRequest_RequestBody:
			resp = &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{}}}
		case *extprocv3.ProcessingRequest_ResponseBody:
			resp = &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: &extprocv3.BodyResponse{}}}
		default:
			continue
		}
		if err := stream.Send(resp); err != nil {
			return err
		}
	}
}

func (s *Server) perTryResponseHeaders(ctx context.Context, m *extprocv3.ProcessingRequest, h *extprocv3.HttpHeaders) (*extprocv3.ProcessingResponse, error) {
	cont := &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{}}}
	key := ""
	if ns := m.GetMetadataContext().GetFilterMetadata()[MetadataNamespace]; ns != nil {
		key = ns.GetFields()[mdAttemptKey].GetStringValue()
	}
	code := 0
	for _, hv := range h.GetHeaders().GetHeaders() {
		if hv.Key == ":status" {
			v := string(hv.RawValue)
			if v == "" {
				v = hv.Value
			}
			code, _ = strconv.Atoi(v)
		}
	}
	if code >= 300 && code < 400 {
		// Only the gateway's own 307 may trigger an internal redirect: an
		// engine's redirect would re-enter Envoy's routes with its body.
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{
			Response: &extprocv3.CommonResponse{HeaderMutation: &extprocv3.HeaderMutation{
				SetHeaders: []*corev3.HeaderValueOption{hv(":status", "502")}, RemoveHeaders: []string{"location"},
			}},
		}}}, nil
	}
	st := s.attempts.get(key)
	if st == nil {
		return cont, nil
	}
	st.mu.Lock()
	decode, attempts, path, authority := st.decode, st.attempts, st.path, st.authority
	st.recorded = true
	st.mu.Unlock()
	if decode != nil {
		s.d.record(decode, "decode", code, false)
	}
	rc := s.d.Retry
	if rc.Disabled || !fleet.RetryableStatus(code) {
		return cont, nil
	}
	if attempts >= rc.Attempts() {
		s.d.FleetMetrics.RecordRetriesExhausted("decode", endpointOf(path))
		return cont, nil
	}
	backoff := rc.Backoff(attempts-1, rand.Float64)
	// Both legs are retried; the backoff is observed once per retry.
	s.d.FleetMetrics.RecordRetry("decode", endpointOf(path), attempts, backoff)
	s.d.FleetMetrics.Retries.WithLabelValues("prefill", endpointOf(path)).Inc()
	s.d.Log.Info().Int("status", code).Int("attempt", attempts).Dur("backoff", backoff).Str("path", path).
		Msg("retrying with a new prefill/decode pair")
	t := time.NewTimer(backoff)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
		return nil, nil // the client left during the backoff
	}
	st.mu.Lock()
	st.redirected = true
	st.mu.Unlock()
	loc := "http://" + authority + path + "?" + attemptParam + "=" + key
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{
		Response: &extprocv3.CommonResponse{HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{
			hv(":status", "307"), hv("location", loc),
		}}},
	}}}, nil
}

func endpointOf(path string) string {
	if r, ok := pd.LookupRoute(path); ok {
		return r.Endpoint
	}
	return "other"
}
