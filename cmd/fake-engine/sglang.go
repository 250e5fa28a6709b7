package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/rs/zerolog"

	"github.com/smg-project/smg-extproc/pkg/fake/sglang"
)

func runSGLang(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("fake-engine sglang", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var (
		cfg      sglang.Config
		mode     string
		strict   bool
		logLevel string
		ms       = map[string]*int64{}
	)
	durMS := func(name string, def time.Duration, usage string) {
		v := new(int64)
		ms[name] = v
		fs.Int64Var(v, name, def.Milliseconds(), usage)
	}
	fs.StringVar(&mode, "mode", "null", "disaggregation mode: prefill, decode or null")
	fs.StringVar(&mode, "disaggregation-mode", "null", "alias of --mode")
	fs.StringVar(&cfg.Host, "host", sglang.DefaultHost, "listen host (both listeners)")
	fs.IntVar(&cfg.HTTPPort, "http-port", 30000, "engine API port (0: any free port)")
	fs.IntVar(&cfg.HTTPPort, "port", 30000, "alias of --http-port")
	fs.IntVar(&cfg.BootstrapPort, "bootstrap-port", sglang.DefaultBootstrapPort, "prefill: bootstrap server port (0: any free port); decode: port for requests without bootstrap_port")
	fs.IntVar(&cfg.BootstrapPort, "disaggregation-bootstrap-port", sglang.DefaultBootstrapPort, "alias of --bootstrap-port")
	fs.StringVar(&cfg.Model, "model", sglang.DefaultModel, "served model name")
	fs.StringVar(&cfg.Model, "served-model-name", sglang.DefaultModel, "alias of --model")
	fs.IntVar(&cfg.TPSize, "tp-size", 1, "reported tensor-parallel size")
	fs.IntVar(&cfg.DPSize, "dp-size", 1, "reported data-parallel size")
	fs.IntVar(&cfg.PageSize, "page-size", sglang.DefaultPageSize, "KV page size (checked between prefill and decode)")
	fs.StringVar(&cfg.KVCacheDtype, "kv-cache-dtype", sglang.DefaultKVCacheDtype, "KV cache dtype (checked between prefill and decode)")
	fs.StringVar(&cfg.TransferBackend, "transfer-backend", sglang.DefaultTransferBackend, "reported disaggregation transfer backend")
	fs.IntVar(&cfg.MaxRunningRequests, "max-running-requests", sglang.DefaultMaxRunningRequests, "reported max_running_requests")
	fs.IntVar(&cfg.ContextLength, "context-length", sglang.DefaultContextLength, "reported context length (max_model_len)")
	fs.IntVar(&cfg.MaxRecorded, "max-recorded", sglang.DefaultMaxRecorded, "requests and events kept for /_fake (oldest dropped)")
	fs.IntVar(&cfg.DefaultMaxTokens, "default-max-tokens", sglang.DefaultMaxTokens, "output length when a request sets none")
	fs.BoolVar(&strict, "strict", true, "strict checks (false: behave like the real engine: hang, recompute, IndexError)")
	fs.IntVar(&cfg.FailStatus, "fail-status", 0, "answer every engine request with this status at once (0: off)")
	fs.StringVar(&cfg.FailBody, "fail-body", "", "body sent with --fail-status")
	fs.BoolVar(&cfg.Hang, "hang", false, "accept engine requests and never answer")
	fs.BoolVar(&cfg.EarlyStreamHead, "early-stream-head", false, "send the 200 head of streamed responses at once (failures become in-stream abort chunks)")
	durMS("hold-body-open-ms", 0, "prefill: keep the response open this long after the body")
	durMS("prefill-ms", 0, "fake prefill compute time")
	durMS("per-token-ms", 0, "fake time per generated token")
	durMS("transfer-ms", 0, "fake KV transfer time")
	durMS("bootstrap-timeout-ms", sglang.DefaultBootstrapTimeout, "prefill: wait for the decode's join (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT)")
	durMS("waiting-timeout-ms", sglang.DefaultWaitingTimeout, "decode: wait for the transfer (SGLANG_DISAGGREGATION_WAITING_TIMEOUT)")
	durMS("fetch-retry-interval-ms", sglang.DefaultFetchRetryInterval, "decode: interval between prefill topology fetches")
	fs.IntVar(&cfg.FetchAttempts, "fetch-attempts", sglang.DefaultFetchAttempts, "decode: prefill topology fetch attempts")
	durMS("heartbeat-interval-ms", sglang.DefaultHeartbeatInterval, "decode: GET /health interval while waiting")
	fs.IntVar(&cfg.HeartbeatMaxFailures, "heartbeat-max-failures", sglang.DefaultHeartbeatMaxFailures, "decode: heartbeat failures before giving up")
	durMS("startup-ms", 0, "answer 503 on /health and the bootstrap /route this long after start")
	fs.StringVar(&logLevel, "log-level", "warn", "log level: debug, info, warn, error, disabled")
	if err := fs.Parse(args); err != nil {
		if err == flag.ErrHelp {
			return err
		}
		return errUsage
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "fake-engine sglang: unexpected arguments %q\n", fs.Args())
		return errUsage
	}
	cfg.Mode = sglang.Mode(strings.ToLower(mode))
	switch cfg.Mode {
	case sglang.Prefill, sglang.Decode, sglang.Null:
	default:
		fmt.Fprintf(stderr, "fake-engine sglang: --mode must be prefill, decode or null, got %q\n", mode)
		return errUsage
	}
	cfg.Lax = !strict
	d := func(name string) time.Duration { return time.Duration(*ms[name]) * time.Millisecond }
	cfg.HoldBodyOpen = d("hold-body-open-ms")
	cfg.PrefillDelay = d("prefill-ms")
	cfg.PerTokenDelay = d("per-token-ms")
	cfg.TransferDelay = d("transfer-ms")
	cfg.BootstrapTimeout = d("bootstrap-timeout-ms")
	cfg.WaitingTimeout = d("waiting-timeout-ms")
	cfg.FetchRetryInterval = d("fetch-retry-interval-ms")
	cfg.HeartbeatInterval = d("heartbeat-interval-ms")
	cfg.StartupWindow = d("startup-ms")

	lvl, err := zerolog.ParseLevel(logLevel)
	if err != nil {
		fmt.Fprintf(stderr, "fake-engine sglang: %v\n", err)
		return errUsage
	}
	log := zerolog.New(stderr).Level(lvl).With().Timestamp().Logger()
	cfg.Logger = &log

	srv := sglang.New(cfg)
	if err := srv.Start(ctx); err != nil {
		return err
	}
	line := fmt.Sprintf("fake-engine sglang %s listening on %s", cfg.Mode, srv.URL())
	if cfg.Mode == sglang.Prefill {
		line += fmt.Sprintf(" (bootstrap %d)", srv.BootstrapPort())
	}
	fmt.Fprintln(stdout, line)
	<-ctx.Done()
	return srv.Close()
}
