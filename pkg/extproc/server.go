// Package extproc is Envoy's external processor for the PD routes. One gRPC
// stream is one client request; exchange (exchange.go) is its state machine.
package extproc

import (
	"context"
	"errors"
	"io"
	"net/http"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/rs/zerolog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/smg-project/smg-extproc/pkg/fleet"
	"github.com/smg-project/smg-extproc/pkg/metrics"
	"github.com/smg-project/smg-extproc/pkg/pairing"
	"github.com/smg-project/smg-extproc/pkg/workers"
)

// Deps are the processor's collaborators.
type Deps struct {
	Log            zerolog.Logger
	Registry       *workers.Registry
	Selector       *pairing.Selector
	Client         *http.Client
	Metrics        *metrics.Metrics
	RequestTimeout time.Duration
	// MaxPayloadSize is checked here as well as by Envoy's buffer limit, which
	// may round up to the connection's buffer size.
	MaxPayloadSize int64
	// DestinationHeader also names the decode in the x-gateway-destination-endpoint
	// request header; the client's own value never survives (the allowlist
	// removes it first), so a client still cannot pick the upstream.
	DestinationHeader bool
	// Retry drives whole-attempt retries through the per-try processor.
	Retry        fleet.RetryConfig
	FleetMetrics *fleet.Metrics
}

// Server implements envoy.service.ext_proc.v3.ExternalProcessor.
type Server struct {
	extprocv3.UnimplementedExternalProcessorServer
	d        Deps
	attempts *attemptTable
}

// New returns a processor.
func New(d Deps) *Server { return &Server{d: d, attempts: newAttemptTable()} }

// Run sweeps abandoned retry state until ctx ends.
func (s *Server) Run(ctx context.Context) {
	t := time.NewTicker(30 * time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			s.attempts.sweep(now)
		}
	}
}

// Register adds the service to g.
func (s *Server) Register(g *grpc.Server) { extprocv3.RegisterExternalProcessorServer(g, s) }

// Process runs one request's exchange.
func (s *Server) Process(stream extprocv3.ExternalProcessor_ProcessServer) error {
	ctx := stream.Context()
	if md, ok := metadata.FromIncomingContext(ctx); ok && isPerTry(md) {
		return s.processPerTry(stream)
	}
	x := newExchange(s, ctx, stream)
	defer x.finish()
	// Messages are handled on the gRPC handler goroutine itself (no hand-off:
	// three fewer goroutine switches per request). The only other sender is
	// the prefill watcher (watchPrefill), serialised by x.mu.
	for {
		m, err := stream.Recv()
		if err != nil {
			if !errors.Is(err, io.EOF) && status.Code(err) != codes.Canceled && ctx.Err() == nil {
				x.log.Debug().Err(err).Msg("ext_proc stream receive failed")
			}
			return nil // Envoy ends every stream this way, success or client abort
		}
		x.mu.Lock()
		t0 := time.Now()
		err = x.handle(m)
		x.busy += time.Since(t0)
		x.mu.Unlock()
		if err != nil {
			if ctx.Err() != nil {
				return nil // the answer raced the client going away
			}
			return err
		}
	}
}
