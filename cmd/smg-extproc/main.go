// Command smg-extproc is a prefill/decode disaggregation gateway built as an
// Envoy external processor with an embedded xDS server.
//
//	smg-extproc launch --pd-disaggregation --prefill URL [PORT|none] --decode URL ...
//	smg-extproc serve  ... (for an Envoy run elsewhere; see envoy-config)
//	smg-extproc envoy-config ... (print the Envoy bootstrap)
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/rs/zerolog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"

	envoycfg "github.com/smg-project/smg-extproc/envoy"
	"github.com/smg-project/smg-extproc/pkg/admin"
	"github.com/smg-project/smg-extproc/pkg/config"
	"github.com/smg-project/smg-extproc/pkg/extproc"
	"github.com/smg-project/smg-extproc/pkg/fleet"
	"github.com/smg-project/smg-extproc/pkg/launcher"
	"github.com/smg-project/smg-extproc/pkg/manager"
	"github.com/smg-project/smg-extproc/pkg/metrics"
	"github.com/smg-project/smg-extproc/pkg/pairing"
	"github.com/smg-project/smg-extproc/pkg/pd"
	"github.com/smg-project/smg-extproc/pkg/policy"
	"github.com/smg-project/smg-extproc/pkg/workers"
	"github.com/smg-project/smg-extproc/pkg/xds"
)

func usage() {
	fmt.Fprintf(os.Stderr, `usage: smg-extproc <launch|serve|envoy-config> [flags]

  launch        run the gateway with a local Envoy child (client port --port)
  serve         run the ext_proc/xDS/admin servers for an Envoy managed elsewhere
  envoy-config  print the Envoy bootstrap for the given flags

flags (SMG's names):
`)
	config.Usage(os.Stderr)
}

func main() {
	if len(os.Args) < 2 {
		usage()
		os.Exit(2)
	}
	sub, args := os.Args[1], os.Args[2:]
	switch sub {
	case "launch", "serve", "envoy-config":
	case "-h", "--help", "help":
		usage()
		return
	default:
		fmt.Fprintf(os.Stderr, "smg-extproc: unknown command %q\n", sub)
		usage()
		os.Exit(2)
	}
	for _, a := range args {
		if a == "-h" || a == "--help" {
			usage()
			return
		}
	}
	cfg, file, err := config.ParseWithFile(args)
	if err != nil {
		fmt.Fprintf(os.Stderr, "smg-extproc: %v\n", err)
		os.Exit(2)
	}
	if sub == "launch" {
		// A local child needs no fixed internal ports; pick free ones unless told.
		if !hasFlag(args, "extproc-port") {
			cfg.ExtProcPort = 0
		}
		if !hasFlag(args, "admin-port") {
			cfg.AdminPort = 0
		}
	}
	if sub == "envoy-config" {
		b, err := renderBootstrap(&cfg, cfg.ExtProcPort, cfg.AdminPort)
		if err != nil {
			fmt.Fprintf(os.Stderr, "smg-extproc: %v\n", err)
			os.Exit(1)
		}
		os.Stdout.Write(b)
		return
	}
	if err := run(sub == "launch", cfg, file); err != nil {
		fmt.Fprintf(os.Stderr, "smg-extproc: %v\n", err)
		os.Exit(1)
	}
}

func hasFlag(args []string, name string) bool {
	for _, a := range args {
		a = strings.ReplaceAll(a, "_", "-")
		if a == "--"+name || strings.HasPrefix(a, "--"+name+"=") {
			return true
		}
	}
	return false
}

func newLogger(level, format string) zerolog.Logger {
	lvl, err := zerolog.ParseLevel(strings.ToLower(level))
	if err != nil || level == "" {
		lvl = zerolog.InfoLevel
	}
	if strings.EqualFold(level, "warning") {
		lvl = zerolog.WarnLevel
	}
	// main owns the process: millisecond timestamps for every logger.
	zerolog.TimeFieldFormat = time.RFC3339Nano
	if format == "console" {
		w := zerolog.ConsoleWriter{Out: os.Stderr, TimeFormat: "15:04:05.000", NoColor: true}
		return zerolog.New(w).Level(lvl).With().Timestamp().Logger()
	}
	return zerolog.New(os.Stderr).Level(lvl).With().Timestamp().Logger()
}

func renderBootstrap(cfg *config.Config, extprocPort, adminPort int) ([]byte, error) {
	routes := make([]string, 0, 8)
	for _, r := range pd.Routes() {
		routes = append(routes, r.ClientPath)
	}
	redirects := 0
	if !cfg.DisableRetries && cfg.RetryMaxRetries > 1 {
		redirects = cfg.RetryMaxRetries - 1
	}
	accessLog := cfg.EnvoyAccessLog
	if accessLog == "-" {
		accessLog = "/dev/stdout"
	}
	return envoycfg.Render(envoycfg.Params{
		MaxRedirects: redirects, AccessLogPath: accessLog,
		NodeID: cfg.NodeID, Host: cfg.Host, Port: cfg.Port, EnvoyAdminPort: cfg.EnvoyAdminPort,
		ControlHost: cfg.ControlHost, ExtProcPort: extprocPort, AdminPort: adminPort,
		MaxPayloadSize: cfg.MaxPayloadSize, RequestTimeoutSecs: cfg.RequestTimeoutSecs,
		RouteTimeoutSecs: cfg.RequestTimeoutSecs + 2, MessageTimeoutSecs: cfg.RequestTimeoutSecs + 30, PDRoutes: routes,
	})
}

func inFlight(reg *workers.Registry) int64 {
	var n int64
	for _, w := range reg.Snapshot() {
		n += w.Load()
	}
	return n
}

func fileSpecs(f *config.File) []workers.Spec {
	out := make([]workers.Spec, 0, len(f.Workers))
	for _, w := range f.Workers {
		t := workers.Type(w.WorkerType)
		if t == "" {
			t = workers.Regular
		}
		out = append(out, workers.Spec{URL: w.URL, Type: t, BootstrapPort: w.BootstrapPort, Runtime: w.RuntimeType,
			Labels: w.Labels, APIKey: w.APIKey, KVConnector: w.KVConnector, KVRole: w.KVRole, KVEngineID: w.KVEngineID,
			DPRank: w.DPRank, DPSize: w.DPSize})
	}
	return out
}

func run(withEnvoy bool, cfg config.Config, file *config.File) error {
	log := newLogger(cfg.LogLevel, cfg.LogFormat)
	if !cfg.PDDisaggregation {
		log.Warn().Msg("--pd-disaggregation not given; smg-extproc only serves PD mode and runs it anyway")
	}
	if len(cfg.Ignored) > 0 {
		log.Info().Strs("flags", cfg.Ignored).Msg("accepted for SMG compatibility; no effect yet")
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()

	reg := workers.NewRegistry()
	promReg := prometheus.NewRegistry()
	promReg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	m := metrics.New(promReg)
	fm := fleet.NewMetrics(promReg)
	client := extproc.NewHTTPClient(10 * time.Second)
	fcfg := manager.FleetConfig{
		Health: fleet.HealthConfig{
			Interval: time.Duration(cfg.HealthCheckIntervalSecs) * time.Second, Timeout: time.Duration(cfg.HealthCheckTimeoutSecs) * time.Second,
			FailureThreshold: cfg.HealthFailureThreshold, SuccessThreshold: cfg.HealthSuccessThreshold,
			Endpoint: cfg.HealthCheckEndpoint, Disabled: cfg.DisableHealthCheck,
		},
		Breaker: fleet.BreakerConfig{
			FailureThreshold: cfg.CBFailureThreshold, SuccessThreshold: cfg.CBSuccessThreshold,
			Timeout: time.Duration(cfg.CBTimeoutDurationSecs) * time.Second, Window: time.Duration(cfg.CBWindowDurationSecs) * time.Second,
			Disabled: cfg.DisableCircuitBreaker,
		},
		PendingInterval: 500 * time.Millisecond,
	}
	wlog := log.With().Str("component", "workers").Logger()
	mgr := manager.New(ctx, reg, wlog, manager.FleetHooks(ctx, fcfg, client, fm, reg, wlog))
	for _, p := range cfg.Prefills {
		if _, err := mgr.AddNow(workers.Spec{URL: p.URL, Type: workers.Prefill, BootstrapPort: p.BootstrapPort}); err != nil {
			return fmt.Errorf("--prefill %s: %w", p.URL, err)
		}
	}
	for _, u := range cfg.Decodes {
		if _, err := mgr.AddNow(workers.Spec{URL: u, Type: workers.Decode}); err != nil {
			return fmt.Errorf("--decode %s: %w", u, err)
		}
	}

	if file != nil {
		mgr.Sync(fileSpecs(file))
		wlog := log.With().Str("component", "config").Str("file", cfg.ConfigFile).Logger()
		err := config.Watch(ctx, cfg.ConfigFile, func(f *config.File) {
			wlog.Info().Int("workers", len(f.Workers)).Msg("config file changed; applying the worker list (other settings apply at restart)")
			mgr.Sync(fileSpecs(f))
		}, func(err error) {
			wlog.Error().Err(err).Msg("config file rejected; keeping the last good configuration")
		})
		if err != nil {
			return err
		}
	}

	pp, dp := cfg.EffectivePolicies()
	popts := policy.DefaultOptions()
	popts.CacheThreshold, popts.BalanceAbsThreshold, popts.BalanceRelThreshold = cfg.CacheThreshold, int64(cfg.BalanceAbsThreshold), cfg.BalanceRelThreshold
	popts.EvictionInterval, popts.MaxTreeSize, popts.BlockSize = time.Duration(cfg.EvictionIntervalSecs)*time.Second, cfg.MaxTreeSize, cfg.BlockSize
	popts.PrefixTokenCount, popts.LoadFactor, popts.PrefixHashBalanceAbsThreshold = cfg.PrefixTokenCount, cfg.PrefixHashLoadFactor, int64(cfg.PrefixHashBalanceAbsThreshold)
	popts.LeastLoadKVPressureWeight, popts.LeastLoadDefaultThroughput = cfg.LeastLoadKVPressureWeight, cfg.LeastLoadDefaultThroughput
	popts.LeastLoadMeanPrefillTokens, popts.LeastLoadMaxWaitingReqs = cfg.LeastLoadMeanPrefillTokens, cfg.LeastLoadMaxWaitingRequests
	popts.AssignmentMode, popts.MaxIdle = cfg.AssignmentMode, time.Duration(cfg.MaxIdleSecs)*time.Second
	popts.LoadMonitorInterval = time.Duration(cfg.LoadMonitorIntervalSecs) * time.Second
	var pdeps policy.Deps
	if policy.NeedsEngineLoads(pp) || policy.NeedsEngineLoads(dp) {
		lm := policy.NewEngineLoadMonitor(client, popts.LoadMonitorInterval)
		go lm.Run(ctx, reg.Snapshot)
		pdeps.Loads = lm
	}
	// SMG refuses power_of_two on a leg with fewer than two startup workers.
	np, nd := len(workers.ByType(reg.Snapshot(), workers.Prefill)), len(workers.ByType(reg.Snapshot(), workers.Decode))
	if pp == "power_of_two" && np < 2 {
		return fmt.Errorf("power_of_two as the prefill policy needs at least two prefill workers at startup (have %d)", np)
	}
	if dp == "power_of_two" && nd < 2 {
		return fmt.Errorf("power_of_two as the decode policy needs at least two decode workers at startup (have %d)", nd)
	}
	mk := func(leg policy.Leg, name string) (policy.Policy, error) {
		p, err := policy.Build(name, leg, popts, pdeps)
		if err != nil {
			return nil, err
		}
		if r, ok := p.(policy.Runner); ok {
			r.Start(ctx)
		}
		return p, nil
	}
	prefillPolicy, err := mk(policy.LegPrefill, pp)
	if err != nil {
		return err
	}
	decodePolicy, err := mk(policy.LegDecode, dp)
	if err != nil {
		return err
	}

	mode, err := pairing.ParseMode(cfg.PDPairingMode)
	if err != nil {
		return err
	}
	sel := pairing.NewSelector(prefillPolicy, decodePolicy, mode)
	sel.Available = (*workers.Worker).Available
	plog := log.With().Str("component", "pairing").Logger()
	rebuild := func() {
		if ref := sel.Rebuild(reg.Snapshot()); ref != nil {
			plog.Warn().Msg(ref.Message())
		}
	}
	rebuild()
	go func() {
		ch := reg.Subscribe()
		for {
			select {
			case <-ctx.Done():
				return
			case <-ch:
				rebuild()
			}
		}
	}()

	retry := fleet.RetryConfig{
		MaxRetries: cfg.RetryMaxRetries, InitialBackoff: time.Duration(cfg.RetryInitialBackoffMS) * time.Millisecond,
		MaxBackoff: time.Duration(cfg.RetryMaxBackoffMS) * time.Millisecond, Multiplier: cfg.RetryBackoffMultiplier,
		Jitter: cfg.RetryJitterFactor, Disabled: cfg.DisableRetries || cfg.RetryMaxRetries <= 1,
	}
	xdsSrv, err := xds.New(ctx, log.With().Str("component", "xds").Logger(), func(s *xds.Server) {
		s.PerTry = !retry.Disabled
		s.PerTryTimeout = retry.MaxBackoff*2 + 30*time.Second
	})
	if err != nil {
		return err
	}
	proc := extproc.New(extproc.Deps{
		Log: log.With().Str("component", "extproc").Logger(), Registry: reg,
		Selector: sel,
		Client:   client, Metrics: m, RequestTimeout: cfg.RequestTimeout(), MaxPayloadSize: cfg.MaxPayloadSize,
		Retry: retry, FleetMetrics: fm, DestinationHeader: cfg.DestinationHeader,
	})
	maxMsg := int(cfg.MaxPayloadSize) + 1<<20
	if cfg.MaxPayloadSize > 1<<31-1<<21 {
		maxMsg = 1<<31 - 1
	}
	g := grpc.NewServer(
		grpc.MaxRecvMsgSize(maxMsg), grpc.MaxSendMsgSize(maxMsg),
		grpc.MaxConcurrentStreams(1<<20),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 5 * time.Second, PermitWithoutStream: true}),
	)
	proc.Register(g)
	xdsSrv.Register(g)
	// gRPC health for Envoy/Kubernetes probes of the ext_proc cluster.
	hs := health.NewServer()
	hs.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	hs.SetServingStatus("envoy.service.ext_proc.v3.ExternalProcessor", healthpb.HealthCheckResponse_SERVING)
	healthpb.RegisterHealthServer(g, hs)

	gl, err := net.Listen("tcp", net.JoinHostPort(cfg.ControlHost, strconv.Itoa(cfg.ExtProcPort)))
	if err != nil {
		return fmt.Errorf("ext_proc listener: %w", err)
	}
	al, err := net.Listen("tcp", net.JoinHostPort(cfg.ControlHost, strconv.Itoa(cfg.AdminPort)))
	if err != nil {
		return fmt.Errorf("admin listener: %w", err)
	}
	var draining atomic.Bool
	adminSrv := &http.Server{Handler: admin.Handler(admin.Deps{Log: log, Registry: reg, Client: client, APIKey: cfg.APIKey, Manager: mgr, PairingKey: pairing.KeyOf,
		Draining: draining.Load}),
		ReadHeaderTimeout: 10 * time.Second}
	var envoyAdmin atomic.Value // Envoy's admin address once launched
	var promSrv *http.Server
	var pl net.Listener
	if cfg.PrometheusPort > 0 {
		pl, err = net.Listen("tcp", net.JoinHostPort(cfg.PrometheusHost, strconv.Itoa(cfg.PrometheusPort)))
		if err != nil {
			return fmt.Errorf("prometheus listener: %w", err)
		}
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(promReg, promhttp.HandlerOpts{Registry: promReg}))
		// Envoy's own stats (decode upstream timing, response codes), when Envoy is our child.
		mux.HandleFunc("/envoy/metrics", func(w http.ResponseWriter, r *http.Request) {
			addr, _ := envoyAdmin.Load().(string)
			if addr == "" {
				http.Error(w, "Envoy is not managed by this process (use Envoy's admin /stats/prometheus)", http.StatusNotFound)
				return
			}
			resp, err := http.Get("http://" + addr + "/stats/prometheus")
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadGateway)
				return
			}
			defer resp.Body.Close()
			w.Header().Set("Content-Type", resp.Header.Get("Content-Type"))
			_, _ = io.Copy(w, resp.Body)
		})
		promSrv = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	}

	errc := make(chan error, 4)
	go func() { errc <- g.Serve(gl) }()
	go func() { errc <- adminSrv.Serve(al) }()
	if promSrv != nil {
		go func() { errc <- promSrv.Serve(pl) }()
	}
	go xdsSrv.Run(ctx, reg)
	go proc.Run(ctx)

	extprocPort := gl.Addr().(*net.TCPAddr).Port
	adminPort := al.Addr().(*net.TCPAddr).Port
	log.Info().Int("prefill", len(workers.ByType(reg.Snapshot(), workers.Prefill))).
		Int("decode", len(workers.ByType(reg.Snapshot(), workers.Decode))).
		Str("prefill_policy", pp).Str("decode_policy", dp).
		Int("extproc_port", extprocPort).Int("admin_port", adminPort).Msg("control plane up")

	// Startup workers get a short grace to pass their first health checks, so
	// the gateway is usable as soon as it says ready (SMG waits for them too).
	startup := reg.Snapshot() // command line and config file workers
	wctx, wcancel := context.WithTimeout(ctx, 15*time.Second)
	manager.WaitReady(wctx, startup)
	wcancel()
	for _, w := range startup {
		if !w.Healthy() {
			log.Warn().Str("url", w.URL).Str("status", string(w.Status())).Msg("startup worker not ready yet; it joins once healthy")
		}
	}

	var child *launcher.Envoy
	var childExited <-chan struct{}
	if withEnvoy {
		bin, err := launcher.FindEnvoy(cfg.EnvoyPath)
		if err != nil {
			return err
		}
		boot, err := renderBootstrap(&cfg, extprocPort, adminPort)
		if err != nil {
			return err
		}
		child, err = launcher.Start(launcher.Options{Binary: bin, Bootstrap: boot, LogLevel: cfg.EnvoyLogLevel,
			Concurrency: cfg.EnvoyConcurrency, Log: os.Stderr})
		if err != nil {
			return err
		}
		childExited = child.Exited()
		readyCtx, cancel := context.WithTimeout(ctx, 60*time.Second)
		err = child.WaitReady(readyCtx)
		cancel()
		if err != nil {
			child.Stop(5 * time.Second)
			return err
		}
		envoyAdmin.Store(child.AdminAddress())
		log.Info().Str("envoy", bin).Str("envoy_admin", child.AdminAddress()).
			Str("listen", fmt.Sprintf("http://%s:%d", cfg.Host, cfg.Port)).Msg("gateway ready")
	}

	var runErr error
	select {
	case <-ctx.Done():
		// Readiness turns 503 so load balancers move away; in-flight requests
		// (streams included) finish within the grace period.
		draining.Store(true)
		grace := time.Duration(cfg.ShutdownGraceSecs) * time.Second
		log.Info().Dur("grace", grace).Msg("shutting down: draining in-flight requests")
		deadline := time.Now().Add(grace)
		for inFlight(reg) > 0 && time.Now().Before(deadline) {
			time.Sleep(50 * time.Millisecond)
		}
		if n := inFlight(reg); n > 0 {
			log.Warn().Int64("in_flight", n).Msg("grace period over; stopping with requests in flight")
		}
	case <-childExited:
		runErr = fmt.Errorf("envoy exited: %v", child.Err())
	case err := <-errc:
		if err != nil && !errors.Is(err, http.ErrServerClosed) {
			runErr = fmt.Errorf("server failed: %w", err)
		}
	}
	if child != nil {
		child.Stop(10 * time.Second)
	}
	shutCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = adminSrv.Shutdown(shutCtx)
	if promSrv != nil {
		_ = promSrv.Shutdown(shutCtx)
	}
	done := make(chan struct{})
	go func() { g.GracefulStop(); close(done) }()
	select {
	case <-done:
	case <-shutCtx.Done():
		g.Stop()
	}
	return runErr
}
