package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/rs/zerolog"

	"github.com/smg-project/smg-extproc/pkg/fake/vllm"
)

func runVLLM(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("fake-engine vllm", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var (
		cfg                   vllm.Config
		role, connector, mode string
		strict                bool
		logLevel              string
		ms                    = map[string]*int64{}
	)
	durMS := func(name string, def time.Duration, usage string) {
		v := new(int64)
		ms[name] = v
		fs.Int64Var(v, name, def.Milliseconds(), usage)
	}
	fs.StringVar(&role, "role", "both", "kv role: producer, consumer or both (kv_ prefix optional)")
	fs.StringVar(&role, "kv-role", "both", "alias of --role")
	fs.StringVar(&connector, "connector", "none", "kv connector: nixl, mooncake, moriio or none (vLLM class names accepted)")
	fs.StringVar(&connector, "kv-connector", "none", "alias of --connector")
	fs.StringVar(&cfg.Host, "host", vllm.DefaultHost, "listen host (every listener)")
	fs.IntVar(&cfg.HTTPPort, "http-port", 8000, "OpenAI API port (0: any free port)")
	fs.IntVar(&cfg.HTTPPort, "port", 8000, "alias of --http-port")
	fs.StringVar(&cfg.Model, "model", vllm.DefaultModel, "served model name")
	fs.StringVar(&cfg.Model, "served-model-name", vllm.DefaultModel, "alias of --model")
	fs.StringVar(&cfg.EngineID, "engine-id", "", "kv engine id (default: a random uuid; <id>_dp<rank> with --dp-size > 1; MoRI-IO uses <host>:<handshake port>)")
	fs.IntVar(&cfg.TPSize, "tp-size", 1, "tensor-parallel size (reported; tp_size in handoffs)")
	fs.IntVar(&cfg.DPSize, "dp-size", 1, "data-parallel ranks simulated (X-data-parallel-rank picks one)")
	fs.IntVar(&cfg.DPRank, "dp-rank", 0, "rank used by requests without X-data-parallel-rank")
	fs.IntVar(&cfg.BlockSize, "block-size", vllm.DefaultBlockSize, "KV block size (remote_block_ids length = ceil(prompt/size))")
	fs.IntVar(&cfg.KVGroups, "kv-groups", 1, "KV-cache groups (lists in remote_block_ids)")
	fs.IntVar(&cfg.MaxModelLen, "max-model-len", vllm.DefaultMaxModelLen, "reported max_model_len")
	fs.StringVar(&cfg.Version, "engine-version", vllm.DefaultVersion, "GET /version answer")
	fs.IntVar(&cfg.MaxRecorded, "max-recorded", vllm.DefaultMaxRecorded, "requests and events kept for /_fake (oldest dropped)")
	fs.StringVar(&cfg.SideChannelHost, "side-channel-host", "", "NIXL: advertised remote_host (default --host)")
	fs.IntVar(&cfg.SideChannelPort, "side-channel-port", vllm.DefaultNixlSideChannelPort, "NIXL: side channel base port (VLLM_NIXL_SIDE_CHANNEL_PORT; rank r listens on base+r; 0: free ports)")
	fs.IntVar(&cfg.BootstrapPort, "bootstrap-port", vllm.DefaultMooncakeBootstrap, "Mooncake: bootstrap server port (VLLM_MOONCAKE_BOOTSTRAP_PORT; 0: free port)")
	fs.StringVar(&mode, "moriio-mode", "write", "MoRI-IO transfer mode: read or write")
	fs.StringVar(&cfg.MoRIIOHost, "moriio-host", "", "MoRI-IO: advertised host (default --host)")
	fs.IntVar(&cfg.HandshakePort, "handshake-port", vllm.DefaultHandshakePort, "MoRI-IO: handshake port (0: free port)")
	fs.IntVar(&cfg.NotifyPort, "notify-port", vllm.DefaultNotifyPort, "MoRI-IO: notify port (0: free port)")
	fs.BoolVar(&strict, "strict", true, "strict checks (false: behave like the real engine: warn and recompute, or hang until a timeout)")
	fs.StringVar(&cfg.KVLoadFailurePolicy, "kv-load-failure-policy", vllm.PolicyFail, "fail (500) or recompute")
	fs.IntVar(&cfg.FailStatus, "fail-status", 0, "answer every engine request with this status at once (0: off)")
	fs.StringVar(&cfg.FailBody, "fail-body", "", "body sent with --fail-status")
	fs.BoolVar(&cfg.Hang, "hang", false, "accept engine requests and never answer")
	fs.IntVar(&cfg.EOSAt, "eos-at", 0, "the token at this output position (1-based) is EOS unless ignore_eos (0: never)")
	fs.IntVar(&cfg.DefaultMaxTokens, "default-max-tokens", vllm.DefaultMaxTokens, "output length when a request sets no cap")
	fs.BoolVar(&cfg.DevMode, "dev-mode", os.Getenv("VLLM_SERVER_DEV_MODE") == "1", "serve GET /server_info (default: VLLM_SERVER_DEV_MODE=1)")
	durMS("prefill-ms", 0, "fake prefill compute time")
	durMS("per-token-ms", 0, "fake time per generated token")
	durMS("transfer-ms", 0, "fake KV transfer time")
	durMS("abort-request-timeout-ms", vllm.DefaultAbortRequestTimeout, "prefill: how long handoff blocks are held (VLLM_*_ABORT_REQUEST_TIMEOUT)")
	durMS("transfer-timeout-ms", 0, "decode: wait for the prefill (0: Mooncake = abort timeout, MoRI-IO = 30000)")
	durMS("startup-ms", 0, "answer 503 on /health this long after start")
	fs.StringVar(&logLevel, "log-level", "warn", "log level: debug, info, warn, error, disabled")
	if err := fs.Parse(args); err != nil {
		if err == flag.ErrHelp {
			return err
		}
		return errUsage
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "fake-engine vllm: unexpected arguments %q\n", fs.Args())
		return errUsage
	}
	var err error
	usageErr := func(format string, args ...any) error {
		fmt.Fprintf(stderr, "fake-engine vllm: "+format+"\n", args...)
		return errUsage
	}
	if cfg.Role, err = vllm.ParseRole(role); err != nil {
		return usageErr("--role: %v", err)
	}
	if cfg.Connector, err = vllm.ParseConnector(connector); err != nil {
		return usageErr("--connector: %v", err)
	}
	switch cfg.MoRIIOMode = vllm.MoRIIOMode(strings.ToLower(mode)); cfg.MoRIIOMode {
	case vllm.Read, vllm.Write:
	default:
		return usageErr("--moriio-mode must be read or write, got %q", mode)
	}
	switch cfg.KVLoadFailurePolicy {
	case vllm.PolicyFail, vllm.PolicyRecompute:
	default:
		return usageErr("--kv-load-failure-policy must be fail or recompute, got %q", cfg.KVLoadFailurePolicy)
	}
	if cfg.DPSize < 1 || cfg.DPRank < 0 || cfg.DPRank >= cfg.DPSize {
		return usageErr("--dp-rank %d not in [0, --dp-size %d)", cfg.DPRank, cfg.DPSize)
	}
	cfg.Lax = !strict
	d := func(name string) time.Duration { return time.Duration(*ms[name]) * time.Millisecond }
	cfg.PrefillDelay = d("prefill-ms")
	cfg.PerTokenDelay = d("per-token-ms")
	cfg.TransferDelay = d("transfer-ms")
	cfg.AbortRequestTimeout = d("abort-request-timeout-ms")
	cfg.TransferTimeout = d("transfer-timeout-ms")
	cfg.StartupWindow = d("startup-ms")

	lvl, err := zerolog.ParseLevel(logLevel)
	if err != nil {
		return usageErr("%v", err)
	}
	log := zerolog.New(stderr).Level(lvl).With().Timestamp().Logger()
	cfg.Logger = &log

	srv := vllm.New(cfg)
	if err := srv.Start(ctx); err != nil {
		return err
	}
	line := fmt.Sprintf("fake-engine vllm %s (%s) listening on %s", cfg.Role.Short(), cfg.Connector.Short(), srv.URL())
	switch {
	case len(srv.SideChannelPorts()) > 0:
		ports := make([]string, 0, len(srv.SideChannelPorts()))
		for _, p := range srv.SideChannelPorts() {
			ports = append(ports, fmt.Sprint(p))
		}
		line += fmt.Sprintf(" (side channel %s)", strings.Join(ports, ","))
	case srv.BootstrapPort() != 0:
		line += fmt.Sprintf(" (bootstrap %d)", srv.BootstrapPort())
	case srv.HandshakePort() != 0:
		line += fmt.Sprintf(" (handshake %d, notify %d)", srv.HandshakePort(), srv.NotifyPort())
	}
	fmt.Fprintln(stdout, line)
	<-ctx.Done()
	return srv.Close()
}
