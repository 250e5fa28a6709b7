package sglang

import (
	"encoding/json"
	"fmt"
	"time"

	"github.com/rs/zerolog"

	"github.com/smg-project/smg-extproc/pkg/fake/common"
)

// Mode is the fake's disaggregation mode (SGLang's --disaggregation-mode).
type Mode string

const (
	// Prefill runs the engine API plus a bootstrap server.
	Prefill Mode = "prefill"
	// Decode dials the prefill's bootstrap server for every room.
	Decode Mode = "decode"
	// Null is a plain, non-disaggregated engine (the PD-equality reference).
	Null Mode = "null"
)

// Defaults (SGLang's where SGLang has one).
const (
	DefaultHost                 = "127.0.0.1"
	DefaultModel                = "fake-model"
	DefaultBootstrapPort        = 8998
	DefaultPageSize             = 1
	DefaultKVCacheDtype         = "auto"
	DefaultTransferBackend      = "mooncake"
	DefaultMaxRunningRequests   = 1024
	DefaultContextLength        = 32768
	DefaultMaxTokens            = 16
	DefaultBootstrapTimeout     = 300 * time.Second
	DefaultWaitingTimeout       = 300 * time.Second
	DefaultFetchRetryInterval   = time.Second
	DefaultFetchAttempts        = 15
	DefaultHeartbeatInterval    = 5 * time.Second
	DefaultHeartbeatMaxFailures = 2
	DefaultMaxRecorded          = 10000
	// FakeBootstrapHost with room 0 is SGLang's health-check form: the request
	// completes locally, with no pairing.
	FakeBootstrapHost = "2.2.2.2"
)

// Config configures a fake SGLang server. Zero values take the defaults
// above. The fields after the "Runtime knobs" line can be changed on a
// running server with UpdateConfig or POST /_fake/config.
type Config struct {
	Mode Mode
	// Host is the listen address of both listeners (default 127.0.0.1).
	Host string
	// HTTPPort is the engine API port; 0 picks a free port.
	HTTPPort int
	// BootstrapPort: on a prefill, the bootstrap server's port (0 picks a free
	// port); on a decode, the port used for requests that carry no
	// bootstrap_port (SGLang's --disaggregation-bootstrap-port; 0 means 8998).
	BootstrapPort int
	// Model is the served model name (default "fake-model").
	Model              string
	TPSize             int
	DPSize             int
	TransferBackend    string
	MaxRunningRequests int
	ContextLength      int
	// MaxRecorded bounds the request and event logs (default 10000; oldest dropped).
	MaxRecorded int
	// Logger receives the fake's logs; nil discards them.
	Logger *zerolog.Logger

	// Runtime knobs.

	// PageSize and KVCacheDtype are reported by the prefill's /route and
	// checked by the decode (default 1 and "auto").
	PageSize     int
	KVCacheDtype string
	// Lax turns every [strict] check into the real engine's behaviour (hang,
	// IndexError, silent recompute). The zero value is strict.
	Lax bool
	// FailStatus, when non-zero, answers every engine request at once with
	// this status and FailBody (no bootstrap, no join).
	FailStatus int
	FailBody   string
	// Hang accepts engine requests and never answers until the client leaves.
	Hang bool
	// HoldBodyOpen (prefill only): after the whole response body is written,
	// keep the response open this long before ending it. Streamed requests
	// also get their response head at once.
	HoldBodyOpen time.Duration
	// PrefillDelay, PerTokenDelay and TransferDelay are the fake compute times.
	PrefillDelay  time.Duration
	PerTokenDelay time.Duration
	TransferDelay time.Duration
	// BootstrapTimeout: how long a prefill room waits for its decode's join.
	BootstrapTimeout time.Duration
	// WaitingTimeout: how long a decode waits for its prefill's transfer.
	WaitingTimeout time.Duration
	// FetchRetryInterval and FetchAttempts drive the decode's topology fetch.
	FetchRetryInterval time.Duration
	FetchAttempts      int
	// HeartbeatInterval and HeartbeatMaxFailures drive the decode's
	// GET /health probes of the prefill while it waits.
	HeartbeatInterval    time.Duration
	HeartbeatMaxFailures int
	// StartupWindow: /health, /health_generate and the bootstrap /route answer
	// 503 for this long after Start (or after the knob is set at run time).
	StartupWindow time.Duration
	// EarlyStreamHead sends a streamed response's 200 head at once, as
	// Starlette does; failures then arrive as in-stream abort chunks. By
	// default the head waits for the first chunk so failures keep their status.
	EarlyStreamHead bool
	// DefaultMaxTokens is the output length when the request sets none (16).
	DefaultMaxTokens int
}

func (c Config) withDefaults() Config {
	if c.Mode == "" {
		c.Mode = Null
	}
	if c.Host == "" {
		c.Host = DefaultHost
	}
	if c.Mode != Prefill && c.BootstrapPort == 0 {
		c.BootstrapPort = DefaultBootstrapPort
	}
	if c.Model == "" {
		c.Model = DefaultModel
	}
	if c.TPSize <= 0 {
		c.TPSize = 1
	}
	if c.DPSize <= 0 {
		c.DPSize = 1
	}
	if c.TransferBackend == "" {
		c.TransferBackend = DefaultTransferBackend
	}
	if c.MaxRunningRequests <= 0 {
		c.MaxRunningRequests = DefaultMaxRunningRequests
	}
	if c.ContextLength <= 0 {
		c.ContextLength = DefaultContextLength
	}
	if c.MaxRecorded <= 0 {
		c.MaxRecorded = DefaultMaxRecorded
	}
	return c.knobDefaults()
}

func (c Config) knobDefaults() Config {
	if c.PageSize <= 0 {
		c.PageSize = DefaultPageSize
	}
	if c.KVCacheDtype == "" {
		c.KVCacheDtype = DefaultKVCacheDtype
	}
	if c.BootstrapTimeout <= 0 {
		c.BootstrapTimeout = DefaultBootstrapTimeout
	}
	if c.WaitingTimeout <= 0 {
		c.WaitingTimeout = DefaultWaitingTimeout
	}
	if c.FetchRetryInterval <= 0 {
		c.FetchRetryInterval = DefaultFetchRetryInterval
	}
	if c.FetchAttempts <= 0 {
		c.FetchAttempts = DefaultFetchAttempts
	}
	if c.HeartbeatInterval <= 0 {
		c.HeartbeatInterval = DefaultHeartbeatInterval
	}
	if c.HeartbeatMaxFailures <= 0 {
		c.HeartbeatMaxFailures = DefaultHeartbeatMaxFailures
	}
	if c.DefaultMaxTokens <= 0 {
		c.DefaultMaxTokens = DefaultMaxTokens
	}
	return c
}

func (c Config) validate() error {
	switch c.Mode {
	case Prefill, Decode, Null:
	default:
		return fmt.Errorf("sglang fake: unknown mode %q (want prefill, decode or null)", c.Mode)
	}
	if c.HTTPPort < 0 || c.HTTPPort > 65535 || c.BootstrapPort < 0 || c.BootstrapPort > 65535 {
		return fmt.Errorf("sglang fake: port out of range")
	}
	return nil
}

// ConfigView is the JSON shape of GET/POST /_fake/config (durations in ms).
type ConfigView struct {
	Mode                 Mode   `json:"mode"`
	Model                string `json:"model"`
	Host                 string `json:"host"`
	HTTPPort             int    `json:"http_port"`
	BootstrapPort        int    `json:"bootstrap_port"`
	TPSize               int    `json:"tp_size"`
	DPSize               int    `json:"dp_size"`
	PageSize             int    `json:"page_size"`
	KVCacheDtype         string `json:"kv_cache_dtype"`
	Strict               bool   `json:"strict"`
	FailStatus           int    `json:"fail_status"`
	FailBody             string `json:"fail_body"`
	Hang                 bool   `json:"hang"`
	HoldBodyOpenMS       int64  `json:"hold_body_open_ms"`
	PrefillMS            int64  `json:"prefill_ms"`
	PerTokenMS           int64  `json:"per_token_ms"`
	TransferMS           int64  `json:"transfer_ms"`
	BootstrapTimeoutMS   int64  `json:"bootstrap_timeout_ms"`
	WaitingTimeoutMS     int64  `json:"waiting_timeout_ms"`
	FetchRetryIntervalMS int64  `json:"fetch_retry_interval_ms"`
	FetchAttempts        int    `json:"fetch_attempts"`
	HeartbeatIntervalMS  int64  `json:"heartbeat_interval_ms"`
	HeartbeatMaxFailures int    `json:"heartbeat_max_failures"`
	StartupMS            int64  `json:"startup_ms"`
	EarlyStreamHead      bool   `json:"early_stream_head"`
	DefaultMaxTokens     int    `json:"default_max_tokens"`
}

func (c Config) view() ConfigView {
	ms := func(d time.Duration) int64 { return d.Milliseconds() }
	return ConfigView{
		Mode: c.Mode, Model: c.Model, Host: c.Host, HTTPPort: c.HTTPPort, BootstrapPort: c.BootstrapPort,
		TPSize: c.TPSize, DPSize: c.DPSize, PageSize: c.PageSize, KVCacheDtype: c.KVCacheDtype,
		Strict: !c.Lax, FailStatus: c.FailStatus, FailBody: c.FailBody, Hang: c.Hang,
		HoldBodyOpenMS: ms(c.HoldBodyOpen), PrefillMS: ms(c.PrefillDelay), PerTokenMS: ms(c.PerTokenDelay),
		TransferMS: ms(c.TransferDelay), BootstrapTimeoutMS: ms(c.BootstrapTimeout),
		WaitingTimeoutMS: ms(c.WaitingTimeout), FetchRetryIntervalMS: ms(c.FetchRetryInterval),
		FetchAttempts: c.FetchAttempts, HeartbeatIntervalMS: ms(c.HeartbeatInterval),
		HeartbeatMaxFailures: c.HeartbeatMaxFailures, StartupMS: ms(c.StartupWindow),
		EarlyStreamHead: c.EarlyStreamHead, DefaultMaxTokens: c.DefaultMaxTokens,
	}
}

// ConfigPatch is the body of POST /_fake/config: every field is optional;
// unknown fields are rejected. Durations are milliseconds. fail_body may be a
// JSON string (sent as is) or any other JSON value (sent as its JSON text).
type ConfigPatch struct {
	PageSize             *int            `json:"page_size,omitempty"`
	KVCacheDtype         *string         `json:"kv_cache_dtype,omitempty"`
	Strict               *bool           `json:"strict,omitempty"`
	FailStatus           *int            `json:"fail_status,omitempty"`
	FailBody             json.RawMessage `json:"fail_body,omitempty"`
	Hang                 *bool           `json:"hang,omitempty"`
	HoldBodyOpenMS       *int64          `json:"hold_body_open_ms,omitempty"`
	PrefillMS            *int64          `json:"prefill_ms,omitempty"`
	PerTokenMS           *int64          `json:"per_token_ms,omitempty"`
	TransferMS           *int64          `json:"transfer_ms,omitempty"`
	BootstrapTimeoutMS   *int64          `json:"bootstrap_timeout_ms,omitempty"`
	WaitingTimeoutMS     *int64          `json:"waiting_timeout_ms,omitempty"`
	FetchRetryIntervalMS *int64          `json:"fetch_retry_interval_ms,omitempty"`
	FetchAttempts        *int            `json:"fetch_attempts,omitempty"`
	HeartbeatIntervalMS  *int64          `json:"heartbeat_interval_ms,omitempty"`
	HeartbeatMaxFailures *int            `json:"heartbeat_max_failures,omitempty"`
	StartupMS            *int64          `json:"startup_ms,omitempty"`
	EarlyStreamHead      *bool           `json:"early_stream_head,omitempty"`
	DefaultMaxTokens     *int            `json:"default_max_tokens,omitempty"`
}

// apply returns c with the patch applied (runtime knobs only).
func (p ConfigPatch) apply(c Config) (Config, error) {
	common.PatchValue(p.PageSize, &c.PageSize)
	common.PatchValue(p.KVCacheDtype, &c.KVCacheDtype)
	if p.Strict != nil {
		c.Lax = !*p.Strict
	}
	if err := common.PatchFailStatus(p.FailStatus, &c.FailStatus); err != nil {
		return c, err
	}
	if err := common.PatchFailBody(p.FailBody, &c.FailBody); err != nil {
		return c, err
	}
	common.PatchValue(p.Hang, &c.Hang)
	common.PatchMS(p.HoldBodyOpenMS, &c.HoldBodyOpen)
	common.PatchMS(p.PrefillMS, &c.PrefillDelay)
	common.PatchMS(p.PerTokenMS, &c.PerTokenDelay)
	common.PatchMS(p.TransferMS, &c.TransferDelay)
	common.PatchMS(p.BootstrapTimeoutMS, &c.BootstrapTimeout)
	common.PatchMS(p.WaitingTimeoutMS, &c.WaitingTimeout)
	common.PatchMS(p.FetchRetryIntervalMS, &c.FetchRetryInterval)
	common.PatchMS(p.HeartbeatIntervalMS, &c.HeartbeatInterval)
	common.PatchMS(p.StartupMS, &c.StartupWindow)
	common.PatchValue(p.FetchAttempts, &c.FetchAttempts)
	common.PatchValue(p.HeartbeatMaxFailures, &c.HeartbeatMaxFailures)
	common.PatchValue(p.EarlyStreamHead, &c.EarlyStreamHead)
	common.PatchValue(p.DefaultMaxTokens, &c.DefaultMaxTokens)
	return c.knobDefaults(), nil
}
