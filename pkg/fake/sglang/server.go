package sglang

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"

	"github.com/smg-project/smg-extproc/pkg/fake/common"
)

// Server is one fake SGLang worker: the engine API on URL() and, in prefill
// mode, a bootstrap server on BootstrapPort().
type Server struct {
	log zerolog.Logger

	cfgMu        sync.RWMutex
	cfg          Config
	initial      Config
	startupUntil time.Time

	requests *common.RequestLog
	events   *common.EventLog
	rooms    *roomTable
	dRooms   *decodeRooms
	client   *http.Client
	tr       *http.Transport

	engineSrv *http.Server
	bootSrv   *http.Server
	engineLn  net.Listener
	bootLn    net.Listener
	url       string
	bootPort  int

	baseCtx   context.Context
	cancel    context.CancelFunc
	wg        sync.WaitGroup // serve loops and the ctx watcher
	hmu       sync.Mutex
	closing   bool
	handlers  sync.WaitGroup // in-flight handlers
	started   atomic.Bool
	closeOnce sync.Once
	closeErr  error
	closed    chan struct{}

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
		cfg:      cfg,
		initial:  cfg,
		requests: common.NewRequestLog(cfg.MaxRecorded),
		events:   common.NewEventLog(cfg.MaxRecorded),
		rooms:    newRoomTable(4096),
		dRooms:   newDecodeRooms(4096),
		tr:       tr,
		client:   &http.Client{Transport: tr},
		closed:   make(chan struct{}),
	}
}

// Start binds the listeners and serves in the background. The server runs
// until Close is called or ctx is done.
func (s *Server) Start(ctx context.Context) error {
	if !s.started.CompareAndSwap(false, true) {
		return errors.New("sglang fake: already started")
	}
	cfg := s.Config()
	if err := cfg.validate(); err != nil {
		return err
	}
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", net.JoinHostPort(cfg.Host, strconv.Itoa(cfg.HTTPPort)))
	if err != nil {
		return fmt.Errorf("sglang fake: listen http: %w", err)
	}
	s.engineLn = ln
	httpPort := ln.Addr().(*net.TCPAddr).Port
	s.url = "http://" + net.JoinHostPort(cfg.Host, strconv.Itoa(httpPort))
	s.bootPort = cfg.BootstrapPort
	if cfg.Mode == Prefill {
		bln, err := lc.Listen(ctx, "tcp", net.JoinHostPort(cfg.Host, strconv.Itoa(cfg.BootstrapPort)))
		if err != nil {
			_ = ln.Close()
			return fmt.Errorf("sglang fake: listen bootstrap: %w", err)
		}
		s.bootLn = bln
		s.bootPort = bln.Addr().(*net.TCPAddr).Port
	}
	s.cfgMu.Lock()
	s.cfg.HTTPPort, s.cfg.BootstrapPort = httpPort, s.bootPort
	s.initial.HTTPPort, s.initial.BootstrapPort = httpPort, s.bootPort
	s.startupUntil = time.Now().Add(s.cfg.StartupWindow)
	s.cfgMu.Unlock()

	s.baseCtx, s.cancel = context.WithCancel(context.WithoutCancel(ctx))
	base := func(net.Listener) context.Context { return s.baseCtx }
	s.engineSrv = &http.Server{Handler: s.track(s.engineMux()), BaseContext: base, ReadHeaderTimeout: 10 * time.Second}
	s.serve(s.engineSrv, s.engineLn)
	if s.bootLn != nil {
		s.bootSrv = &http.Server{Handler: s.track(s.bootstrapMux()), BaseContext: base, ReadHeaderTimeout: 10 * time.Second}
		s.serve(s.bootSrv, s.bootLn)
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		select {
		case <-ctx.Done():
			go func() { _ = s.Close() }()
		case <-s.closed:
		}
	}()
	s.log.Info().Str("url", s.url).Int("bootstrap_port", s.bootPort).Msg("fake sglang listening")
	return nil
}

func (s *Server) serve(srv *http.Server, ln net.Listener) {
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			s.log.Error().Err(err).Msg("serve")
		}
	}()
}

// track counts in-flight handlers so Close can wait for them.
func (s *Server) track(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.hmu.Lock()
		if s.closing {
			s.hmu.Unlock()
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		s.handlers.Add(1)
		s.hmu.Unlock()
		defer s.handlers.Done()
		h.ServeHTTP(w, r)
	})
}

// Close stops both listeners, cancels every in-flight request (its client
// sees the connection close) and waits for the server's goroutines. It is
// safe to call more than once.
func (s *Server) Close() error {
	s.closeOnce.Do(func() {
		close(s.closed)
		if !s.started.Load() || s.cancel == nil {
			return
		}
		s.hmu.Lock()
		s.closing = true
		s.hmu.Unlock()
		s.cancel()
		// Handlers wake up on the cancelled base context; give them a moment
		// to finish their answers, then close whatever is left (including
		// connections that never sent a request, which Shutdown would wait
		// 5 s for).
		ctx, cancel := context.WithTimeout(context.Background(), 250*time.Millisecond)
		defer cancel()
		for _, srv := range []*http.Server{s.engineSrv, s.bootSrv} {
			if srv == nil {
				continue
			}
			if err := srv.Shutdown(ctx); err != nil && !errors.Is(err, context.DeadlineExceeded) {
				s.closeErr = errors.Join(s.closeErr, err)
			}
			if err := srv.Close(); err != nil {
				s.closeErr = errors.Join(s.closeErr, err)
			}
		}
		s.handlers.Wait()
		s.tr.CloseIdleConnections()
		s.wg.Wait()
	})
	return s.closeErr
}

// URL is the engine API base URL, e.g. "http://127.0.0.1:31000".
func (s *Server) URL() string { return s.url }

// BootstrapPort is the prefill's bootstrap server port (a decode: the port it
// uses for requests without bootstrap_port).
func (s *Server) BootstrapPort() int { return s.bootPort }

// Mode is the server's disaggregation mode.
func (s *Server) Mode() Mode { return s.Config().Mode }

// Config returns the effective configuration.
func (s *Server) Config() Config {
	s.cfgMu.RLock()
	defer s.cfgMu.RUnlock()
	return s.cfg
}

// UpdateConfig changes the runtime knobs (the fields after "Runtime knobs" in
// Config); changes to the other fields are ignored. It returns the result.
func (s *Server) UpdateConfig(fn func(*Config)) Config {
	s.cfgMu.Lock()
	defer s.cfgMu.Unlock()
	c := s.cfg
	fn(&c)
	c = c.knobDefaults()
	old := s.cfg
	c.Mode, c.Host, c.HTTPPort, c.BootstrapPort, c.Model = old.Mode, old.Host, old.HTTPPort, old.BootstrapPort, old.Model
	c.TPSize, c.DPSize, c.TransferBackend = old.TPSize, old.DPSize, old.TransferBackend
	c.MaxRunningRequests, c.ContextLength, c.MaxRecorded, c.Logger = old.MaxRunningRequests, old.ContextLength, old.MaxRecorded, nil
	if c.StartupWindow != old.StartupWindow {
		s.startupUntil = time.Now().Add(c.StartupWindow)
	}
	s.cfg = c
	return c
}

func (s *Server) patchConfig(p ConfigPatch) (Config, error) {
	s.cfgMu.Lock()
	defer s.cfgMu.Unlock()
	c, err := p.apply(s.cfg)
	if err != nil {
		return s.cfg, err
	}
	if p.StartupMS != nil {
		s.startupUntil = time.Now().Add(c.StartupWindow)
	}
	s.cfg = c
	return c, nil
}

func (s *Server) starting() bool {
	s.cfgMu.RLock()
	defer s.cfgMu.RUnlock()
	return time.Now().Before(s.startupUntil)
}

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
	s.cfgMu.Lock()
	s.cfg = s.initial
	s.startupUntil = time.Time{}
	s.cfgMu.Unlock()
}

func (s *Server) event(leg, rid string, room *uint64, outcome, detail string) {
	s.events.Add(common.Event{Leg: leg, RID: rid, Room: room, Outcome: outcome, Detail: detail})
}

func (s *Server) newRID() string {
	return fmt.Sprintf("%016x%016x", rand.Uint64(), s.seq.Add(1))
}
