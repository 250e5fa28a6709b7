package vllm

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"

	"github.com/smg-project/smg-extproc/pkg/fake/common"
)

// Server is one fake vLLM worker: the OpenAI API on URL() plus the listeners
// its connector needs (NIXL side channels, the Mooncake bootstrap server, the
// MoRI-IO handshake and notify ports).
type Server struct {
	log      zerolog.Logger
	instance string // unique per server, reported by the MoRI-IO info endpoint

	cfgMu        sync.RWMutex
	cfg          Config
	initial      Config
	startupUntil time.Time

	requests *common.RequestLog
	events   *common.EventLog
	nixl     *nixlTable
	mc       *mooncakeTable
	mori     *moriTable
	moriWait *moriWaits
	client   *http.Client
	tr       *http.Transport

	servers   []*http.Server
	url       string
	sidePorts []int // NIXL side channel port per DP rank
	bootPort  int
	hsPort    int
	notePort  int

	baseCtx   context.Context
	cancel    context.CancelFunc
	wg        sync.WaitGroup // serve loops, the ctx watcher, background pushes
	hmu       sync.Mutex
	closing   bool
	handlers  sync.WaitGroup // in-flight handlers
	started   atomic.Bool
	closeOnce sync.Once
	closeErr  error
	closed    chan struct{}

	dead      atomic.Pointer[string] // MoRI-IO "engine dead" reason
	inFlight  atomic.Int64
	promptTok atomic.Int64
	genTok    atomic.Int64
	success   atomic.Int64
	loadFail  atomic.Int64
}

// New returns a server for cfg; call Start to listen.
func New(cfg Config) *Server {
	if cfg.EngineID == "" {
		cfg.EngineID = uuidString()
	}
	cfg = cfg.withDefaults()
	log := zerolog.Nop()
	if cfg.Logger != nil {
		log = cfg.Logger.With().Str("fake", "vllm").Str("role", cfg.Role.Short()).Str("connector", cfg.Connector.Short()).Logger()
	}
	cfg.Logger = nil
	tr := &http.Transport{
		Proxy:               nil,
		DialContext:         (&net.Dialer{Timeout: 2 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:        512,
		MaxIdleConnsPerHost: 256,
		IdleConnTimeout:     30 * time.Second,
	}
	s := &Server{
		log:      log,
		instance: randHex(16),
		cfg:      cfg,
		initial:  cfg,
		requests: common.NewRequestLog(cfg.MaxRecorded),
		events:   common.NewEventLog(cfg.MaxRecorded),
		tr:       tr,
		client:   &http.Client{Transport: tr},
		closed:   make(chan struct{}),
	}
	s.nixl = newNixlTable(s)
	s.mc = newMooncakeTable(s)
	s.mori = newMoriTable(s)
	s.moriWait = newMoriWaits()
	return s
}

type listener struct {
	ln      net.Listener
	handler http.Handler
}

// Start binds the listeners and serves in the background. The server runs
// until Close is called or ctx is done.
func (s *Server) Start(ctx context.Context) error {
	if !s.started.CompareAndSwap(false, true) {
		return errors.New("vllm fake: already started")
	}
	cfg := s.Config()
	if err := cfg.validate(); err != nil {
		return err
	}
	var (
		lc  net.ListenConfig
		lns []listener
	)
	closeAll := func() {
		for _, l := range lns {
			_ = l.ln.Close()
		}
	}
	listen := func(port int, what string, h http.Handler) (int, error) {
		ln, err := lc.Listen(ctx, "tcp", net.JoinHostPort(cfg.Host, strconv.Itoa(port)))
		if err != nil {
			closeAll()
			return 0, fmt.Errorf("vllm fake: listen %s: %w", what, err)
		}
		lns = append(lns, listener{ln, h})
		return ln.Addr().(*net.TCPAddr).Port, nil
	}
	httpPort, err := listen(cfg.HTTPPort, "http", s.engineMux())
	if err != nil {
		return err
	}
	s.url = "http://" + net.JoinHostPort(cfg.Host, strconv.Itoa(httpPort))
	switch cfg.Connector {
	case Nixl:
		if cfg.Role.canPrefill() {
			for r := 0; r < cfg.DPSize; r++ {
				port := 0
				if cfg.SideChannelPort != 0 {
					port = cfg.SideChannelPort + r
				}
				p, err := listen(port, fmt.Sprintf("nixl side channel (dp rank %d)", r), s.nixlMux(r))
				if err != nil {
					return err
				}
				s.sidePorts = append(s.sidePorts, p)
			}
		}
	case Mooncake:
		if cfg.Role.canPrefill() {
			if s.bootPort, err = listen(cfg.BootstrapPort, "mooncake bootstrap", s.bootstrapMux()); err != nil {
				return err
			}
		}
	case MoRIIO:
		if s.hsPort, err = listen(cfg.HandshakePort, "moriio handshake", s.moriHandshakeMux()); err != nil {
			return err
		}
		if s.notePort, err = listen(cfg.NotifyPort, "moriio notify", s.moriNotifyMux()); err != nil {
			return err
		}
	}
	s.cfgMu.Lock()
	for _, c := range []*Config{&s.cfg, &s.initial} {
		c.HTTPPort, c.BootstrapPort, c.HandshakePort, c.NotifyPort = httpPort, s.bootPort, s.hsPort, s.notePort
		if len(s.sidePorts) > 0 {
			c.SideChannelPort = s.sidePorts[0]
		}
	}
	s.startupUntil = time.Now().Add(s.cfg.StartupWindow)
	s.cfgMu.Unlock()

	s.baseCtx, s.cancel = context.WithCancel(context.WithoutCancel(ctx))
	base := func(net.Listener) context.Context { return s.baseCtx }
	for _, l := range lns {
		srv := &http.Server{Handler: s.track(l.handler), BaseContext: base, ReadHeaderTimeout: 10 * time.Second}
		s.servers = append(s.servers, srv)
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			if err := srv.Serve(l.ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				s.log.Error().Err(err).Msg("serve")
			}
		}()
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
	s.log.Info().Str("url", s.url).Msg("fake vllm listening")
	return nil
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

// goBackground runs fn on a tracked goroutine with the server's base context
// (cancelled by Close). It returns false when the server is closing.
func (s *Server) goBackground(fn func(ctx context.Context)) bool {
	s.hmu.Lock()
	defer s.hmu.Unlock()
	if s.closing || s.baseCtx == nil {
		return false
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		fn(s.baseCtx)
	}()
	return true
}

// Close stops every listener, cancels in-flight requests and background
// transfers, stops the hold timers and waits for the server's goroutines.
// It is safe to call more than once.
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
		ctx, cancel := context.WithTimeout(context.Background(), 250*time.Millisecond)
		defer cancel()
		for _, srv := range s.servers {
			if err := srv.Shutdown(ctx); err != nil && !errors.Is(err, context.DeadlineExceeded) {
				s.closeErr = errors.Join(s.closeErr, err)
			}
			if err := srv.Close(); err != nil {
				s.closeErr = errors.Join(s.closeErr, err)
			}
		}
		s.handlers.Wait()
		s.nixl.reset()
		s.mc.reset()
		s.mori.reset()
		s.tr.CloseIdleConnections()
		s.wg.Wait()
	})
	return s.closeErr
}

// URL is the OpenAI API base URL, e.g. "http://127.0.0.1:8000".
func (s *Server) URL() string { return s.url }

// SideChannelPorts are the NIXL side channel ports, one per DP rank (nil
// unless the server is a producer-capable NIXL worker).
func (s *Server) SideChannelPorts() []int { return append([]int(nil), s.sidePorts...) }

// BootstrapPort is the Mooncake bootstrap server port (0 if none).
func (s *Server) BootstrapPort() int { return s.bootPort }

// BootstrapAddr is the Mooncake remote_bootstrap_addr of this prefill,
// "http://host:port" ("" if none).
func (s *Server) BootstrapAddr() string {
	if s.bootPort == 0 {
		return ""
	}
	return "http://" + net.JoinHostPort(s.Config().Host, strconv.Itoa(s.bootPort))
}

// HandshakePort and NotifyPort are the MoRI-IO ports (0 if none).
func (s *Server) HandshakePort() int { return s.hsPort }

// NotifyPort is the MoRI-IO notify port (0 if none).
func (s *Server) NotifyPort() int { return s.notePort }

// EngineID is the kv engine id of DP rank r: "<id>_dp<r>" when DPSize > 1;
// for MoRI-IO "<host>:<handshake port>".
func (s *Server) EngineID(rank int) string {
	cfg := s.Config()
	if cfg.Connector == MoRIIO {
		return s.moriEngineID(cfg)
	}
	return cfg.effectiveEngineID(rank)
}

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
	if validatePolicy(c.KVLoadFailurePolicy) != nil && c.KVLoadFailurePolicy != "" {
		c.KVLoadFailurePolicy = s.cfg.KVLoadFailurePolicy
	}
	c = c.knobDefaults()
	old := s.cfg
	fixed := old
	fixed.Lax, fixed.KVLoadFailurePolicy, fixed.FailStatus, fixed.FailBody, fixed.Hang = c.Lax, c.KVLoadFailurePolicy, c.FailStatus, c.FailBody, c.Hang
	fixed.PrefillDelay, fixed.PerTokenDelay, fixed.TransferDelay = c.PrefillDelay, c.PerTokenDelay, c.TransferDelay
	fixed.AbortRequestTimeout, fixed.TransferTimeout, fixed.EOSAt = c.AbortRequestTimeout, c.TransferTimeout, c.EOSAt
	fixed.StartupWindow, fixed.DefaultMaxTokens, fixed.DevMode = c.StartupWindow, c.DefaultMaxTokens, c.DevMode
	if fixed.StartupWindow != old.StartupWindow {
		s.startupUntil = time.Now().Add(fixed.StartupWindow)
	}
	s.cfg = fixed
	return fixed
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

// Reset clears the request and event logs, every held handoff and pending
// transfer (their timers stop), the memory of consumed handoffs and the
// "engine dead" state, and restores the configuration given to New.
// In-flight requests are not touched.
func (s *Server) Reset() {
	s.requests.Reset()
	s.events.Reset()
	s.nixl.reset()
	s.mc.reset()
	s.mori.reset()
	s.dead.Store(nil)
	s.cfgMu.Lock()
	s.cfg = s.initial
	s.startupUntil = time.Time{}
	s.cfgMu.Unlock()
}

// Dead reports the MoRI-IO "engine dead" reason ("" while alive).
func (s *Server) Dead() string {
	if p := s.dead.Load(); p != nil {
		return *p
	}
	return ""
}

func (s *Server) kill(reason string) {
	s.dead.CompareAndSwap(nil, &reason)
}

func (s *Server) event(leg, rid, transferID, outcome, detail string) {
	s.events.Add(common.Event{Leg: leg, RID: rid, TransferID: transferID, Outcome: outcome, Detail: detail})
	s.log.Debug().Str("leg", leg).Str("rid", rid).Str("transfer_id", transferID).Str("outcome", outcome).Str("detail", detail).Msg("event")
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// uuidString is a random (version 4) uuid in its hyphenated form.
func uuidString() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	h := hex.EncodeToString(b)
	return h[:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:]
}
