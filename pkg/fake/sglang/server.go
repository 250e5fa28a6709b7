package sglang

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"

	"github.com/smg-project/smg-extproc/pkg/fake/common"
)

// Server is one fake SGLang worker: the engine API on URL() and, in prefill
// mode, a bootstrap server on BootstrapPort().
type Server struct {
	log zerolog.Logger

	settings *common.Settings[Config]
	life     *common.Lifecycle

	requests *common.RequestLog
	events   *common.EventLog
	rooms    *roomTable
	dRooms   *decodeRooms
	client   *http.Client
	tr       *http.Transport

	url      string
	bootPort int

	seq             atomic.Uint64
	inFlight        atomic.Int64
	bootstrapFailed atomic.Int64
	transferFailed  atomic.Int64
	genTokens       atomic.Int64
}

// New returns a server for cfg; call Start to listen.
func New(cfg Config) *Server {
	cfg = cfg.withDefaults()
	log := zerolog.Nop()
	if cfg.Logger != nil {
		log = cfg.Logger.With().Str("fake", "sglang").Str("mode", string(cfg.Mode)).Logger()
	}
	cfg.Logger = nil
	tr := &http.Transport{
		Proxy:               nil,
		DialContext:         (&net.Dialer{Timeout: 2 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:        512,
		MaxIdleConnsPerHost: 256,
		IdleConnTimeout:     30 * time.Second,
	}
	return &Server{
		log:      log,
		settings: common.NewSettings(cfg, func(c Config) time.Duration { return c.StartupWindow }),
		life:     common.NewLifecycle("sglang fake", tr.CloseIdleConnections),
		requests: common.NewRequestLog(cfg.MaxRecorded),
		events:   common.NewEventLog(cfg.MaxRecorded),
		rooms:    newRoomTable(4096),
		dRooms:   newDecodeRooms(4096),
		tr:       tr,
		client:   &http.Client{Transport: tr},
	}
}

// Start binds the listeners and serves in the background. The server runs
// until Close is called or ctx is done.
func (s *Server) Start(ctx context.Context) error {
	if err := s.life.Begin(); err != nil {
		return err
	}
	cfg := s.Config()
	if err := cfg.validate(); err != nil {
		return err
	}
	ln, httpPort, err := common.ListenTCP(ctx, cfg.Host, cfg.HTTPPort)
	if err != nil {
		return fmt.Errorf("sglang fake: listen http: %w", err)
	}
	lns := []common.Listener{{Ln: ln, Handler: s.engineMux()}}
	s.url = common.HTTPURL(cfg.Host, httpPort)
	s.bootPort = cfg.BootstrapPort
	if cfg.Mode == Prefill {
		bln, bootPort, err := common.ListenTCP(ctx, cfg.Host, cfg.BootstrapPort)
		if err != nil {
			_ = ln.Close()
			return fmt.Errorf("sglang fake: listen bootstrap: %w", err)
		}
		lns = append(lns, common.Listener{Ln: bln, Handler: s.bootstrapMux()})
		s.bootPort = bootPort
	}
	s.settings.Started(func(c *Config) { c.HTTPPort, c.BootstrapPort = httpPort, s.bootPort })
	s.life.Serve(ctx, s.log, lns...)
	s.log.Info().Str("url", s.url).Int("bootstrap_port", s.bootPort).Msg("fake sglang listening")
	return nil
}

// Close stops both listeners, cancels every in-flight request (its client
// sees the connection close) and waits for the server's goroutines. It is
// safe to call more than once.
func (s *Server) Close() error { return s.life.Close() }

// URL is the engine API base URL, e.g. "http://127.0.0.1:31000".
func (s *Server) URL() string { return s.url }

// BootstrapPort is the prefill's bootstrap server port (a decode: the port it
// uses for requests without bootstrap_port).
func (s *Server) BootstrapPort() int { return s.bootPort }

// Mode is the server's disaggregation mode.
func (s *Server) Mode() Mode { return s.Config().Mode }

// Config returns the effective configuration.
func (s *Server) Config() Config { return s.settings.Get() }

// UpdateConfig changes the runtime knobs (the fields after "Runtime knobs" in
// Config); changes to the other fields are ignored. It returns the result.
func (s *Server) UpdateConfig(fn func(*Config)) Config {
	c, _ := s.settings.Update(func(old Config) (Config, error) {
		c := old
		fn(&c)
		c = c.knobDefaults()
		c.Mode, c.Host, c.HTTPPort, c.BootstrapPort, c.Model = old.Mode, old.Host, old.HTTPPort, old.BootstrapPort, old.Model
		c.TPSize, c.DPSize, c.TransferBackend = old.TPSize, old.DPSize, old.TransferBackend
		c.MaxRunningRequests, c.ContextLength, c.MaxRecorded, c.Logger = old.MaxRunningRequests, old.ContextLength, old.MaxRecorded, nil
		return c, nil
	}, func(old, c Config) bool { return c.StartupWindow != old.StartupWindow })
	return c
}

func (s *Server) patchConfig(p ConfigPatch) (Config, error) {
	return s.settings.Update(p.apply, func(_, _ Config) bool { return p.StartupMS != nil })
}

func (s *Server) starting() bool { return s.settings.Starting() }

// Requests returns every request received on engine routes (oldest first;
// bounded by Config.MaxRecorded).
func (s *Server) Requests() []common.RecordedRequest { return s.requests.Snapshot() }

// Events returns the ordered event log.
func (s *Server) Events() []common.Event { return s.events.Snapshot() }

// Reset clears the request and event logs and the memory of used rooms, and restores the configuration given to New. In-flight requests are
// not touched.
func (s *Server) Reset() {
	s.requests.Reset()
	s.events.Reset()
	s.rooms.resetMemory()
	s.dRooms.resetMemory()
	s.settings.Reset()
}

func (s *Server) event(leg, rid string, room *uint64, outcome, detail string) {
	s.events.Add(common.Event{Leg: leg, RID: rid, Room: room, Outcome: outcome, Detail: detail})
}

func (s *Server) newRID() string {
	return fmt.Sprintf("%016x%016x", rand.Uint64(), s.seq.Add(1))
}
