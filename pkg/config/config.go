// Package config parses SMG's command line into a Config. SMG's flags take
// multi-value forms (`--prefill URL [PORT|none]`) that the standard flag
// package cannot express, so this is a small table-driven parser.
package config

import (
	"fmt"
	"io"
	"sort"
	"strconv"
	"strings"
	"time"
)

// PrefillArg is one `--prefill URL [BOOTSTRAP_PORT|none]`.
type PrefillArg struct {
	URL           string
	BootstrapPort *int
}

// Config is every setting of the gateway. Zero values are never used: Defaults fills them.
type Config struct {
	PDDisaggregation bool
	Prefills         []PrefillArg
	Decodes          []string

	Host string
	Port int

	Policy        string
	PrefillPolicy string
	DecodePolicy  string

	PrometheusHost string
	PrometheusPort int

	LogLevel           string
	LogFormat          string // json | console
	EnvoyAccessLog     string // "" = none, "-" = stdout, else a file path
	RequestTimeoutSecs int
	MaxPayloadSize     int64
	APIKey             string

	// Fleet (health, breakers, retries); parsed now, enforced by the fleet.
	HealthCheckIntervalSecs int
	HealthCheckTimeoutSecs  int
	HealthFailureThreshold  int
	HealthSuccessThreshold  int
	HealthCheckEndpoint     string
	DisableHealthCheck      bool
	CBFailureThreshold      int
	CBSuccessThreshold      int
	CBTimeoutDurationSecs   int
	CBWindowDurationSecs    int
	DisableCircuitBreaker   bool
	RetryMaxRetries         int
	RetryInitialBackoffMS   int
	RetryMaxBackoffMS       int
	RetryBackoffMultiplier  float64
	RetryJitterFactor       float64
	DisableRetries          bool
	PDPairingMode           string
	ConfigFile              string

	// Policy tuning (both legs), SMG's flags.
	CacheThreshold                float64
	BalanceAbsThreshold           int
	BalanceRelThreshold           float64
	EvictionIntervalSecs          int
	MaxTreeSize                   int
	BlockSize                     int
	PrefixTokenCount              int
	PrefixHashLoadFactor          float64
	PrefixHashBalanceAbsThreshold int
	LeastLoadKVPressureWeight     float64
	LeastLoadDefaultThroughput    float64
	LeastLoadMeanPrefillTokens    int
	LeastLoadMaxWaitingRequests   int
	AssignmentMode                string
	MaxIdleSecs                   int
	LoadMonitorIntervalSecs       int

	// Envoy / control-plane wiring (ours, not SMG's).
	EnvoyPath        string
	EnvoyAdminPort   int
	EnvoyConcurrency int
	EnvoyLogLevel    string
	ControlHost      string // where the Go gRPC (ext_proc + ADS) and admin servers listen
	ExtProcPort      int    // gRPC port: ext_proc and ADS
	AdminPort        int    // internal HTTP: /workers, probes
	NodeID           string
	// DestinationHeader also names the decode in the x-gateway-destination-endpoint
	// request header (Envoy Gateway's endpointOverride reads only a header).
	DestinationHeader bool
	// ShutdownGraceSecs bounds how long SIGTERM waits for in-flight requests.
	ShutdownGraceSecs int

	logJSON bool

	// Unrecognised-but-accepted SMG flags, kept for the log line.
	Ignored []string
}

// Defaults returns SMG's defaults.
func Defaults() Config {
	return Config{
		Host:                    "0.0.0.0",
		Port:                    30000,
		Policy:                  "cache_aware",
		PrometheusHost:          "0.0.0.0",
		PrometheusPort:          29000,
		LogLevel:                "info",
		LogFormat:               "json",
		RequestTimeoutSecs:      1800,
		MaxPayloadSize:          512 * 1024 * 1024,
		HealthCheckIntervalSecs: 60,
		HealthCheckTimeoutSecs:  5,
		HealthFailureThreshold:  3,
		HealthSuccessThreshold:  2,
		HealthCheckEndpoint:     "/health",
		CBFailureThreshold:      10,
		CBSuccessThreshold:      3,
		CBTimeoutDurationSecs:   60,
		CBWindowDurationSecs:    120,
		RetryMaxRetries:         5,
		RetryInitialBackoffMS:   50,
		RetryMaxBackoffMS:       30000,
		RetryBackoffMultiplier:  1.5,
		RetryJitterFactor:       0.2,
		PDPairingMode:           "lenient",
		CacheThreshold:          0.3, BalanceAbsThreshold: 64, BalanceRelThreshold: 1.5, EvictionIntervalSecs: 120,
		MaxTreeSize: 67108864, BlockSize: 16, PrefixTokenCount: 256, PrefixHashLoadFactor: 1.25,
		PrefixHashBalanceAbsThreshold: 10, LeastLoadKVPressureWeight: 0.15, LeastLoadDefaultThroughput: 2000,
		LeastLoadMeanPrefillTokens: 1024, AssignmentMode: "random", MaxIdleSecs: 14400, LoadMonitorIntervalSecs: 10,
		EnvoyLogLevel:     "warning",
		ControlHost:       "127.0.0.1",
		ExtProcPort:       18001,
		AdminPort:         18002,
		EnvoyAdminPort:    0,
		NodeID:            "smg-envoy",
		ShutdownGraceSecs: 30,
	}
}

// RequestTimeout is the whole-request budget.
func (c *Config) RequestTimeout() time.Duration {
	return time.Duration(c.RequestTimeoutSecs) * time.Second
}

// EffectivePolicies returns the per-leg policy names.
func (c *Config) EffectivePolicies() (prefill, decode string) {
	prefill, decode = c.Policy, c.Policy
	if c.PrefillPolicy != "" {
		prefill = c.PrefillPolicy
	}
	if c.DecodePolicy != "" {
		decode = c.DecodePolicy
	}
	return prefill, decode
}

type kind int

const (
	kBool kind = iota
	kString
	kInt
	kInt64
	kFloat
	kStrings // repeatable, one value each time
	kPrefill
	kIgnoreValue // accepted for compatibility, takes one value
	kIgnoreBool  // accepted for compatibility, no value
)

type spec struct {
	kind kind
	dst  any
	help string
}

func (c *Config) table() map[string]spec {
	return map[string]spec{
		"pd-disaggregation":                 {kBool, &c.PDDisaggregation, "enable PD mode"},
		"prefill":                           {kPrefill, &c.Prefills, "prefill worker: URL [BOOTSTRAP_PORT|none] (repeatable)"},
		"decode":                            {kStrings, &c.Decodes, "decode worker URL (repeatable)"},
		"host":                              {kString, &c.Host, "client-facing listen address (Envoy)"},
		"port":                              {kInt, &c.Port, "client-facing port (Envoy)"},
		"policy":                            {kString, &c.Policy, "default routing policy for both legs"},
		"prefill-policy":                    {kString, &c.PrefillPolicy, "prefill leg policy"},
		"decode-policy":                     {kString, &c.DecodePolicy, "decode leg policy"},
		"prometheus-host":                   {kString, &c.PrometheusHost, "metrics listen address"},
		"prometheus-port":                   {kInt, &c.PrometheusPort, "metrics port"},
		"log-level":                         {kString, &c.LogLevel, "debug|info|warn|error"},
		"log-format":                        {kString, &c.LogFormat, "json (default) or console"},
		"log-json":                          {kBool, &c.logJSON, "SMG's flag: JSON logs (the default here)"},
		"envoy-access-log":                  {kString, &c.EnvoyAccessLog, "Envoy access log: a file path, - for stdout (default: none)"},
		"request-timeout-secs":              {kInt, &c.RequestTimeoutSecs, "whole-request timeout"},
		"max-payload-size":                  {kInt64, &c.MaxPayloadSize, "largest accepted request body (bytes)"},
		"api-key":                           {kString, &c.APIKey, "admin API key for the worker API"},
		"health-check-interval-secs":        {kInt, &c.HealthCheckIntervalSecs, ""},
		"health-check-timeout-secs":         {kInt, &c.HealthCheckTimeoutSecs, ""},
		"health-failure-threshold":          {kInt, &c.HealthFailureThreshold, ""},
		"health-success-threshold":          {kInt, &c.HealthSuccessThreshold, ""},
		"health-check-endpoint":             {kString, &c.HealthCheckEndpoint, ""},
		"disable-health-check":              {kBool, &c.DisableHealthCheck, ""},
		"cb-failure-threshold":              {kInt, &c.CBFailureThreshold, ""},
		"cb-success-threshold":              {kInt, &c.CBSuccessThreshold, ""},
		"cb-timeout-duration-secs":          {kInt, &c.CBTimeoutDurationSecs, ""},
		"cb-window-duration-secs":           {kInt, &c.CBWindowDurationSecs, ""},
		"disable-circuit-breaker":           {kBool, &c.DisableCircuitBreaker, ""},
		"retry-max-retries":                 {kInt, &c.RetryMaxRetries, ""},
		"retry-initial-backoff-ms":          {kInt, &c.RetryInitialBackoffMS, ""},
		"retry-max-backoff-ms":              {kInt, &c.RetryMaxBackoffMS, ""},
		"retry-backoff-multiplier":          {kFloat, &c.RetryBackoffMultiplier, ""},
		"retry-jitter-factor":               {kFloat, &c.RetryJitterFactor, ""},
		"disable-retries":                   {kBool, &c.DisableRetries, ""},
		"pd-pairing-mode":                   {kString, &c.PDPairingMode, "off|lenient|strict"},
		"config":                            {kString, &c.ConfigFile, "YAML config file"},
		"envoy-path":                        {kString, &c.EnvoyPath, "Envoy binary (else $ENVOY_BIN, PATH, ./.venv)"},
		"envoy-admin-port":                  {kInt, &c.EnvoyAdminPort, "Envoy admin port on 127.0.0.1 (0 = ephemeral)"},
		"envoy-concurrency":                 {kInt, &c.EnvoyConcurrency, "Envoy worker threads (0 = Envoy's default)"},
		"envoy-log-level":                   {kString, &c.EnvoyLogLevel, "Envoy log level"},
		"control-host":                      {kString, &c.ControlHost, "listen address of the ext_proc/xDS and admin servers"},
		"extproc-port":                      {kInt, &c.ExtProcPort, "ext_proc + ADS gRPC port"},
		"admin-port":                        {kInt, &c.AdminPort, "internal admin HTTP port Envoy forwards /workers and probes to"},
		"node-id":                           {kString, &c.NodeID, "Envoy node id"},
		"shutdown-grace-secs":               {kInt, &c.ShutdownGraceSecs, "on SIGTERM, wait up to this long for in-flight requests (readiness says draining)"},
		"destination-header":                {kBool, &c.DestinationHeader, "also set x-gateway-destination-endpoint (for Envoy Gateway's endpointOverride)"},
		"cache-threshold":                   {kFloat, &c.CacheThreshold, "cache_aware match threshold"},
		"balance-abs-threshold":             {kInt, &c.BalanceAbsThreshold, "load imbalance threshold (absolute)"},
		"balance-rel-threshold":             {kFloat, &c.BalanceRelThreshold, "load imbalance threshold (relative)"},
		"eviction-interval":                 {kInt, &c.EvictionIntervalSecs, "cache_aware eviction interval (s)"},
		"max-tree-size":                     {kInt, &c.MaxTreeSize, "cache_aware tree size bound"},
		"block-size":                        {kInt, &c.BlockSize, ""},
		"prefix-token-count":                {kInt, &c.PrefixTokenCount, "prefix_hash prefix length (tokens)"},
		"prefix-hash-load-factor":           {kFloat, &c.PrefixHashLoadFactor, ""},
		"prefix-hash-balance-abs-threshold": {kInt, &c.PrefixHashBalanceAbsThreshold, ""},
		"least-load-kv-pressure-weight":     {kFloat, &c.LeastLoadKVPressureWeight, ""},
		"least-load-default-throughput":     {kFloat, &c.LeastLoadDefaultThroughput, ""},
		"least-load-mean-prefill-tokens":    {kInt, &c.LeastLoadMeanPrefillTokens, ""},
		"least-load-max-waiting-requests":   {kInt, &c.LeastLoadMaxWaitingRequests, ""},
		"assignment-mode":                   {kString, &c.AssignmentMode, "manual policy: random|min_load|min_group"},
		"max-idle-secs":                     {kInt, &c.MaxIdleSecs, "manual policy key idle eviction"},
		"load-monitor-interval":             {kInt, &c.LoadMonitorIntervalSecs, "engine load polling interval (s)"},
		// SMG flags accepted for compatibility; later work gives them meaning.
		"model-path":                    {kIgnoreValue, nil, ""},
		"tokenizer-path":                {kIgnoreValue, nil, ""},
		"dp-aware":                      {kIgnoreBool, nil, ""},
		"enable-igw":                    {kIgnoreBool, nil, ""},
		"worker-startup-timeout-secs":   {kIgnoreValue, nil, ""},
		"worker-startup-check-interval": {kIgnoreValue, nil, ""},
		"pd-admission-wait-secs":        {kIgnoreValue, nil, ""},
		"remove-unhealthy-workers":      {kIgnoreBool, nil, ""},
		"log-dir":                       {kIgnoreValue, nil, ""},
	}
}

// Parse reads args (without the program/subcommand name) over the defaults
// and validates the result.
func Parse(args []string) (Config, error) {
	c, err := parse(args)
	if err != nil {
		return c, err
	}
	return c, c.Validate()
}

// parse reads args without the cross-setting validation (a config file's
// settings are only complete once merged with the command line).
func parse(args []string) (Config, error) {
	c := Defaults()
	t := c.table()
	for i := 0; i < len(args); i++ {
		a := args[i]
		if !strings.HasPrefix(a, "--") || a == "--" {
			return c, fmt.Errorf("unexpected argument %q", a)
		}
		name, inline, hasInline := strings.Cut(a[2:], "=")
		name = strings.ReplaceAll(name, "_", "-")
		s, ok := t[name]
		if !ok {
			return c, fmt.Errorf("unknown flag --%s", name)
		}
		next := func() (string, error) {
			if hasInline {
				return inline, nil
			}
			if i+1 >= len(args) {
				return "", fmt.Errorf("flag --%s needs a value", name)
			}
			i++
			return args[i], nil
		}
		switch s.kind {
		case kBool, kIgnoreBool:
			v := true
			if hasInline {
				b, err := strconv.ParseBool(inline)
				if err != nil {
					return c, fmt.Errorf("flag --%s: %w", name, err)
				}
				v = b
			}
			if s.kind == kBool {
				*s.dst.(*bool) = v
				if name == "log-json" && v {
					// Applied in order, so a later --log-format (the command
					// line after a config file) still wins.
					c.LogFormat = "json"
				}
			} else {
				c.Ignored = append(c.Ignored, "--"+name)
			}
		case kString, kIgnoreValue:
			v, err := next()
			if err != nil {
				return c, err
			}
			if s.kind == kString {
				*s.dst.(*string) = v
			} else {
				c.Ignored = append(c.Ignored, "--"+name)
			}
		case kInt:
			v, err := next()
			if err != nil {
				return c, err
			}
			n, err := strconv.Atoi(v)
			if err != nil {
				return c, fmt.Errorf("flag --%s: %q is not an integer", name, v)
			}
			*s.dst.(*int) = n
		case kInt64:
			v, err := next()
			if err != nil {
				return c, err
			}
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				return c, fmt.Errorf("flag --%s: %q is not an integer", name, v)
			}
			*s.dst.(*int64) = n
		case kFloat:
			v, err := next()
			if err != nil {
				return c, err
			}
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				return c, fmt.Errorf("flag --%s: %q is not a number", name, v)
			}
			*s.dst.(*float64) = f
		case kStrings:
			v, err := next()
			if err != nil {
				return c, err
			}
			*s.dst.(*[]string) = append(*s.dst.(*[]string), v)
		case kPrefill:
			v, err := next()
			if err != nil {
				return c, err
			}
			p := PrefillArg{URL: v}
			// The optional second value is a port or "none"; anything else is the next flag.
			if !hasInline && i+1 < len(args) && !strings.HasPrefix(args[i+1], "--") {
				pv := args[i+1]
				if strings.EqualFold(pv, "none") {
					i++
				} else if n, err := strconv.Atoi(pv); err == nil {
					if n < 1 || n > 65535 {
						return c, fmt.Errorf("flag --prefill: bootstrap port %d out of range", n)
					}
					p.BootstrapPort = &n
					i++
				} else {
					return c, fmt.Errorf("flag --prefill: %q is neither a bootstrap port nor \"none\"", pv)
				}
			}
			c.Prefills = append(c.Prefills, p)
		}
	}
	return c, nil
}

var knownPolicies = map[string]bool{
	"random": true, "round_robin": true, "power_of_two": true, "least_load": true,
	"cache_aware": true, "prefix_hash": true, "consistent_hashing": true, "manual": true, "bucket": true,
}

// Validate checks values that would otherwise fail later and less clearly.
func (c *Config) Validate() error {
	if c.Port < 1 || c.Port > 65535 {
		return fmt.Errorf("--port %d out of range", c.Port)
	}
	if c.PrometheusPort < 0 || c.PrometheusPort > 65535 {
		return fmt.Errorf("--prometheus-port %d out of range", c.PrometheusPort)
	}
	if c.RequestTimeoutSecs < 1 {
		return fmt.Errorf("--request-timeout-secs must be positive")
	}
	if c.MaxPayloadSize < 1 {
		return fmt.Errorf("--max-payload-size must be positive")
	}
	pp, dp := c.EffectivePolicies()
	for _, p := range []string{c.Policy, pp, dp} {
		if !knownPolicies[p] {
			return fmt.Errorf("unknown policy %q", p)
		}
	}
	if dp == "bucket" {
		return fmt.Errorf("bucket cannot be used as the decode policy")
	}
	switch c.PDPairingMode {
	case "off", "lenient", "strict":
	default:
		return fmt.Errorf("--pd-pairing-mode must be off, lenient or strict")
	}
	switch c.LogFormat {
	case "json", "console":
	default:
		return fmt.Errorf("--log-format must be json or console")
	}
	switch strings.ToLower(c.LogLevel) {
	case "trace", "debug", "info", "warn", "warning", "error":
	default:
		return fmt.Errorf("--log-level must be debug, info, warn or error")
	}
	return nil
}

// Usage prints the flag list.
func Usage(w io.Writer) {
	c := Defaults()
	t := c.table()
	names := make([]string, 0, len(t))
	for n, s := range t {
		if s.help != "" {
			names = append(names, n)
		}
	}
	sort.Strings(names)
	for _, n := range names {
		fmt.Fprintf(w, "  --%-28s %s\n", n, t[n].help)
	}
}
