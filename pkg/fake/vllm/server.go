package vllm

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"net/http"
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

	settings *common.Settings[Config]
	life     *common.Lifecycle

	requests *common.RequestLog
	events   *common.EventLog
	nixl     *nixlTable
	mc       *mooncakeTable
	mori     *moriTable
	moriWait *moriWaits
	client   *http.Client
	tr       *http.Transport

	url       string
	sidePorts []int // NIXL side channel port per DP rank
	bootPort  int
	hsPort    int
	notePort  int

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
		settings: common.NewSettings(cfg, func(c Config) time.Duration { return c.StartupWindow }),
		requests: common.NewRequestLog(cfg.MaxRecorded),
		events:   common.NewEventLog(cfg.MaxRecorded),
		tr:       tr,
		client:   &http.Client{Transport: tr},
	}
	s.life = common.NewLifecycle("vllm fake", func() {
		s.nixl.reset()
		s.mc.reset()
		s.mori.reset()
		s.tr.CloseIdleConnections()
	})
	s.nixl = newNixlTable(s)
	s.mc = newMooncakeTable(s)
	s.mori = newMoriTable(s)
	s.moriWait = newMoriWaits()
	return s
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
	var lns []common.Listener
	listen := func(port int, what string, h http.Handler) (int, error) {
		ln, bound, err := common.ListenTCP(ctx, cfg.Host, port)
		if err != nil {
			for _, l := range lns {
				_ = l.Ln.Close()
			}
			return 0, fmt.Errorf("vllm fake: listen %s: %w", what, err)
		}
		lns = append(lns, common.Listener{Ln: ln, Handler: h})
		return bound, nil
	}
	httpPort, err := listen(cfg.HTTPPort, "http", s.engineMux())
	if err != nil {
		return err
	}
	s.url = common.HTTPURL(cfg.Host, httpPort)
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
	s.settings.Started(func(c *Config) {
		c.HTTPPort, c.BootstrapPort, c.HandshakePort, c.NotifyPort = httpPort, s.bootPort, s.hsPort, s.notePort
		if len(s.sidePorts) > 0 {
			c.SideChannelPort = s.sidePorts[0]
		}
	})
	s.life.Serve(ctx, s.log, lns...)
	s.log.Info().Str("url", s.url).Msg("fake vllm listening")
	return nil
}

// goBackground runs fn on a tracked goroutine with the server's base context
// (cancelled by Close). It returns false when the server is closing.
func (s *Server) goBackground(fn func(ctx context.Context)) bool { return s.life.Go(fn) }

// Close stops every listener, cancels in-flight requests and background
// transfers, stops the hold timers and waits for the server's goroutines.
// It is safe to call more than once.
func (s *Server) Close() error { return s.life.Close() }

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
	return common.HTTPURL(s.Config().Host, s.bootPort)
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
func (s *Server) Config() Config { return s.settings.Get() }

// UpdateConfig changes the runtime knobs (the fields after "Runtime knobs" in
// Config); changes to the other fields are ignored. It returns the result.
func (s *Server) UpdateConfig(fn func(*Config)) Config {
	c, _ := s.settings.Update(func(old Config) (Config, error) {
		c := old
		fn(&c)
		if validatePolicy(c.KVLoadFailurePolicy) != nil && c.KVLoadFailurePolicy != "" {
			c.KVLoadFailurePolicy = old.KVLoadFailurePolicy
		}
		c = c.knobDefaults()
		fixed := old
		fixed.Lax, fixed.KVLoadFailurePolicy, fixed.FailStatus, fixed.FailBody, fixed.Hang = c.Lax, c.KVLoadFailurePolicy, c.FailStatus, c.FailBody, c.Hang
		fixed.PrefillDelay, fixed.PerTokenDelay, fixed.TransferDelay = c.PrefillDelay, c.PerTokenDelay, c.TransferDelay
		fixed.AbortRequestTimeout, fixed.TransferTimeout, fixed.EOSAt = c.AbortRequestTimeout, c.TransferTimeout, c.EOSAt
		fixed.StartupWindow, fixed.DefaultMaxTokens, fixed.DevMode = c.StartupWindow, c.DefaultMaxTokens, c.DevMode
		return fixed, nil
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
	s.settings.Reset()
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
