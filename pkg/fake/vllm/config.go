package vllm

import (
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"github.com/rs/zerolog"

	"github.com/smg-project/smg-extproc/pkg/fake/common"
)

// Role is vLLM's kv_transfer_config.kv_role.
type Role string

const (
	// Producer serves prefill legs (kv_producer).
	Producer Role = "kv_producer"
	// Consumer serves decode legs (kv_consumer).
	Consumer Role = "kv_consumer"
	// Both serves either leg (kv_both, the default).
	Both Role = "kv_both"
)

// Short is the role without the kv_ prefix: producer, consumer or both.
func (r Role) Short() string { return strings.TrimPrefix(string(r), "kv_") }

// ParseRole accepts producer|consumer|both, with or without the kv_ prefix.
func ParseRole(s string) (Role, error) {
	switch strings.TrimPrefix(strings.ToLower(strings.TrimSpace(s)), "kv_") {
	case "producer", "prefill":
		return Producer, nil
	case "consumer", "decode":
		return Consumer, nil
	case "both", "":
		return Both, nil
	}
	return "", fmt.Errorf("unknown kv role %q (want producer, consumer or both)", s)
}

func (r Role) canPrefill() bool { return r != Consumer }
func (r Role) canDecode() bool  { return r != Producer }

// Connector is vLLM's kv_transfer_config.kv_connector.
type Connector string

const (
	// None is a plain vLLM server without a KV connector (the non-PD reference).
	None Connector = ""
	// Nixl is NixlConnector: the prefill returns a handoff, the decode pulls it.
	Nixl Connector = "NixlConnector"
	// Mooncake is MooncakeConnector: a router-minted transfer_id, the decode
	// pulls through the prefill's bootstrap server.
	Mooncake Connector = "MooncakeConnector"
	// MoRIIO is MoRIIOConnector (READ or WRITE mode).
	MoRIIO Connector = "MoRIIOConnector"
)

// Short is nixl, mooncake, moriio or none.
func (c Connector) Short() string {
	switch c {
	case Nixl:
		return "nixl"
	case Mooncake:
		return "mooncake"
	case MoRIIO:
		return "moriio"
	}
	return "none"
}

// ParseConnector accepts nixl|mooncake|moriio|none or the vLLM class names.
func ParseConnector(s string) (Connector, error) {
	switch strings.TrimSuffix(strings.ToLower(strings.TrimSpace(s)), "connector") {
	case "nixl":
		return Nixl, nil
	case "mooncake":
		return Mooncake, nil
	case "moriio", "mori-io", "mori":
		return MoRIIO, nil
	case "none", "":
		return None, nil
	}
	return "", fmt.Errorf("unknown kv connector %q (want nixl, mooncake, moriio or none)", s)
}

// MoRIIOMode is the MoRI-IO transfer mode.
type MoRIIOMode string

const (
	// Read: the decode pulls after the prefill answered (sequential).
	Read MoRIIOMode = "read"
	// Write: the prefill pushes into blocks the decode allocated (the default;
	// legs may be concurrent).
	Write MoRIIOMode = "write"
)

// Load-failure policies (kv_transfer_config.kv_load_failure_policy).
const (
	PolicyFail      = "fail"
	PolicyRecompute = "recompute"
)

// Defaults (vLLM's where vLLM has one).
const (
	DefaultHost                = "127.0.0.1"
	DefaultModel               = "fake-model"
	DefaultVersion             = "0.11.0"
	DefaultBlockSize           = 16
	DefaultMaxModelLen         = 32768
	DefaultMaxTokens           = 16
	DefaultMaxRecorded         = 10000
	DefaultNixlSideChannelPort = 5600  // VLLM_NIXL_SIDE_CHANNEL_PORT
	DefaultMooncakeBootstrap   = 8998  // VLLM_MOONCAKE_BOOTSTRAP_PORT
	DefaultHandshakePort       = 6301  // MoRI-IO handshake_port
	DefaultNotifyPort          = 61005 // MoRI-IO notify_port
	// DefaultAbortRequestTimeout is VLLM_NIXL_ABORT_REQUEST_TIMEOUT /
	// VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT: how long a prefill holds blocks.
	DefaultAbortRequestTimeout = 480 * time.Second
	// DefaultMoRIIOTransferTimeout is how long a MoRI-IO WRITE decode waits
	// for the prefill's push.
	DefaultMoRIIOTransferTimeout = 30 * time.Second
)

// Config configures a fake vLLM server. Zero values take the defaults above;
// a zero port means "any free port" (the binary's flags default to vLLM's
// real ports). The fields after the "Runtime knobs" line can be changed on a
// running server with UpdateConfig or POST /_fake/config.
type Config struct {
	Role      Role
	Connector Connector
	// Host is the listen address of every listener (default 127.0.0.1).
	Host string
	// HTTPPort is the OpenAI API port.
	HTTPPort int
	// Model is the served model name (default "fake-model").
	Model string
	// EngineID is kv_transfer_config.engine_id (default: a random uuid). With
	// DPSize > 1 the effective id of rank r is "<EngineID>_dp<r>". MoRI-IO
	// ignores it: its engine id is "<MoRIIOHost>:<HandshakePort>".
	EngineID string
	TPSize   int
	// DPSize is the number of data-parallel ranks this server simulates;
	// requests pick one with the X-data-parallel-rank header, else DPRank.
	DPSize int
	DPRank int
	// BlockSize is cache_config.block_size (block count = ceil(prompt/size)).
	BlockSize int
	// KVGroups is the number of KV-cache groups (lists in remote_block_ids).
	KVGroups    int
	MaxModelLen int
	Version     string
	// MaxRecorded bounds the request and event logs (oldest dropped).
	MaxRecorded int
	// Logger receives the fake's logs; nil discards them.
	Logger *zerolog.Logger

	// NIXL: the side channel is advertised as remote_host =
	// SideChannelHost (default Host) and remote_port = SideChannelPort +
	// rank (0: a free port per rank). Only producer-capable roles listen.
	SideChannelHost string
	SideChannelPort int
	// Mooncake: the bootstrap server port (producer-capable roles only).
	BootstrapPort int
	// MoRI-IO: mode (default write), advertised host (default Host) and the
	// handshake and notify ports (every role listens on both).
	MoRIIOMode    MoRIIOMode
	MoRIIOHost    string
	HandshakePort int
	NotifyPort    int

	// Runtime knobs.

	// Lax turns every [strict] check into the real engine's behaviour (a
	// warning and a silent recompute, or a hang until a timeout). The zero
	// value is strict.
	Lax bool
	// KVLoadFailurePolicy is "fail" (default: 500 "KV load failed for …") or
	// "recompute" (the decode recomputes, X-Fake-KV: recomputed).
	KVLoadFailurePolicy string
	// FailStatus, when non-zero, answers every engine request at once with
	// this status and FailBody.
	FailStatus int
	FailBody   string
	// Hang accepts engine requests and never answers until the client leaves.
	Hang bool
	// PrefillDelay, PerTokenDelay and TransferDelay are the fake compute times.
	PrefillDelay  time.Duration
	PerTokenDelay time.Duration
	TransferDelay time.Duration
	// AbortRequestTimeout: how long a prefill holds a handoff's blocks (480 s).
	AbortRequestTimeout time.Duration
	// TransferTimeout: how long a decode waits for its prefill (Mooncake:
	// default AbortRequestTimeout; MoRI-IO WRITE: default 30 s).
	TransferTimeout time.Duration
	// EOSAt, when > 0, makes the token sampled at output position EOSAt
	// (1-based) the EOS token: generation stops there (finish_reason "stop")
	// unless the request sets ignore_eos. EOSAt=1 is "first token is EOS".
	EOSAt int
	// StartupWindow: /health answers 503 for this long after Start.
	StartupWindow time.Duration
	// DefaultMaxTokens is the output length when the request sets no cap.
	DefaultMaxTokens int
	// DevMode serves GET /server_info (VLLM_SERVER_DEV_MODE=1); else 404.
	DevMode bool
}

func (c Config) withDefaults() Config {
	if c.Role == "" {
		c.Role = Both
	}
	if c.Host == "" {
		c.Host = DefaultHost
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
	if c.BlockSize <= 0 {
		c.BlockSize = DefaultBlockSize
	}
	if c.KVGroups <= 0 {
		c.KVGroups = 1
	}
	if c.MaxModelLen <= 0 {
		c.MaxModelLen = DefaultMaxModelLen
	}
	if c.Version == "" {
		c.Version = DefaultVersion
	}
	if c.MaxRecorded <= 0 {
		c.MaxRecorded = DefaultMaxRecorded
	}
	if c.SideChannelHost == "" {
		c.SideChannelHost = c.Host
	}
	if c.MoRIIOMode == "" {
		c.MoRIIOMode = Write
	}
	if c.MoRIIOHost == "" {
		c.MoRIIOHost = c.Host
	}
	return c.knobDefaults()
}

func (c Config) knobDefaults() Config {
	if c.KVLoadFailurePolicy == "" {
		c.KVLoadFailurePolicy = PolicyFail
	}
	if c.AbortRequestTimeout <= 0 {
		c.AbortRequestTimeout = DefaultAbortRequestTimeout
	}
	if c.TransferTimeout <= 0 {
		if c.Connector == MoRIIO {
			c.TransferTimeout = DefaultMoRIIOTransferTimeout
		} else {
			c.TransferTimeout = c.AbortRequestTimeout
		}
	}
	if c.DefaultMaxTokens <= 0 {
		c.DefaultMaxTokens = DefaultMaxTokens
	}
	return c
}

func (c Config) validate() error {
	switch c.Role {
	case Producer, Consumer, Both:
	default:
		return fmt.Errorf("vllm fake: unknown role %q", c.Role)
	}
	switch c.Connector {
	case None, Nixl, Mooncake, MoRIIO:
	default:
		return fmt.Errorf("vllm fake: unknown connector %q", c.Connector)
	}
	switch c.MoRIIOMode {
	case Read, Write:
	default:
		return fmt.Errorf("vllm fake: unknown MoRI-IO mode %q (want read or write)", c.MoRIIOMode)
	}
	for _, p := range []int{c.HTTPPort, c.BootstrapPort, c.HandshakePort, c.NotifyPort} {
		if p < 0 || p > 65535 {
			return fmt.Errorf("vllm fake: port %d out of range", p)
		}
	}
	if c.SideChannelPort < 0 || c.SideChannelPort+c.DPSize-1 > 65535 {
		return fmt.Errorf("vllm fake: side channel port %d out of range", c.SideChannelPort)
	}
	if c.DPRank < 0 || c.DPRank >= c.DPSize {
		return fmt.Errorf("vllm fake: dp rank %d not in [0, %d)", c.DPRank, c.DPSize)
	}
	return validatePolicy(c.KVLoadFailurePolicy)
}

func validatePolicy(p string) error {
	if p != PolicyFail && p != PolicyRecompute {
		return fmt.Errorf("kv_load_failure_policy %q (want fail or recompute)", p)
	}
	return nil
}

// effectiveEngineID is the kv engine id of DP rank r.
func (c Config) effectiveEngineID(r int) string {
	if c.DPSize > 1 {
		return fmt.Sprintf("%s_dp%d", c.EngineID, r)
	}
	return c.EngineID
}

// ConfigView is the JSON shape of GET/POST /_fake/config (durations in ms).
type ConfigView struct {
	Role                  Role       `json:"role"`
	Connector             string     `json:"connector"`
	Model                 string     `json:"model"`
	Host                  string     `json:"host"`
	HTTPPort              int        `json:"http_port"`
	EngineID              string     `json:"engine_id"`
	TPSize                int        `json:"tp_size"`
	DPSize                int        `json:"dp_size"`
	DPRank                int        `json:"dp_rank"`
	BlockSize             int        `json:"block_size"`
	KVGroups              int        `json:"kv_groups"`
	SideChannelHost       string     `json:"side_channel_host"`
	SideChannelPort       int        `json:"side_channel_port"`
	BootstrapPort         int        `json:"bootstrap_port"`
	MoRIIOMode            MoRIIOMode `json:"moriio_mode"`
	MoRIIOHost            string     `json:"moriio_host"`
	HandshakePort         int        `json:"handshake_port"`
	NotifyPort            int        `json:"notify_port"`
	Strict                bool       `json:"strict"`
	KVLoadFailurePolicy   string     `json:"kv_load_failure_policy"`
	FailStatus            int        `json:"fail_status"`
	FailBody              string     `json:"fail_body"`
	Hang                  bool       `json:"hang"`
	PrefillMS             int64      `json:"prefill_ms"`
	PerTokenMS            int64      `json:"per_token_ms"`
	TransferMS            int64      `json:"transfer_ms"`
	AbortRequestTimeoutMS int64      `json:"abort_request_timeout_ms"`
	TransferTimeoutMS     int64      `json:"transfer_timeout_ms"`
	EOSAt                 int        `json:"eos_at"`
	StartupMS             int64      `json:"startup_ms"`
	DefaultMaxTokens      int        `json:"default_max_tokens"`
	DevMode               bool       `json:"dev_mode"`
}

func (c Config) view() ConfigView {
	ms := func(d time.Duration) int64 { return d.Milliseconds() }
	return ConfigView{
		Role: c.Role, Connector: c.Connector.Short(), Model: c.Model, Host: c.Host, HTTPPort: c.HTTPPort,
		EngineID: c.EngineID, TPSize: c.TPSize, DPSize: c.DPSize, DPRank: c.DPRank, BlockSize: c.BlockSize,
		KVGroups: c.KVGroups, SideChannelHost: c.SideChannelHost, SideChannelPort: c.SideChannelPort,
		BootstrapPort: c.BootstrapPort, MoRIIOMode: c.MoRIIOMode, MoRIIOHost: c.MoRIIOHost,
		HandshakePort: c.HandshakePort, NotifyPort: c.NotifyPort,
		Strict: !c.Lax, KVLoadFailurePolicy: c.KVLoadFailurePolicy, FailStatus: c.FailStatus,
		FailBody: c.FailBody, Hang: c.Hang, PrefillMS: ms(c.PrefillDelay), PerTokenMS: ms(c.PerTokenDelay),
		TransferMS: ms(c.TransferDelay), AbortRequestTimeoutMS: ms(c.AbortRequestTimeout),
		TransferTimeoutMS: ms(c.TransferTimeout), EOSAt: c.EOSAt, StartupMS: ms(c.StartupWindow),
		DefaultMaxTokens: c.DefaultMaxTokens, DevMode: c.DevMode,
	}
}

// ConfigPatch is the body of POST /_fake/config: every field is optional;
// unknown fields are rejected. Durations are milliseconds. fail_body may be a
// JSON string (sent as is) or any other JSON value (sent as its JSON text).
type ConfigPatch struct {
	Strict                *bool           `json:"strict,omitempty"`
	KVLoadFailurePolicy   *string         `json:"kv_load_failure_policy,omitempty"`
	FailStatus            *int            `json:"fail_status,omitempty"`
	FailBody              json.RawMessage `json:"fail_body,omitempty"`
	Hang                  *bool           `json:"hang,omitempty"`
	PrefillMS             *int64          `json:"prefill_ms,omitempty"`
	PerTokenMS            *int64          `json:"per_token_ms,omitempty"`
	TransferMS            *int64          `json:"transfer_ms,omitempty"`
	AbortRequestTimeoutMS *int64          `json:"abort_request_timeout_ms,omitempty"`
	TransferTimeoutMS     *int64          `json:"transfer_timeout_ms,omitempty"`
	EOSAt                 *int            `json:"eos_at,omitempty"`
	StartupMS             *int64          `json:"startup_ms,omitempty"`
	DefaultMaxTokens      *int            `json:"default_max_tokens,omitempty"`
	DevMode               *bool           `json:"dev_mode,omitempty"`
}

// apply returns c with the patch applied (runtime knobs only).
func (p ConfigPatch) apply(c Config) (Config, error) {
	if p.Strict != nil {
		c.Lax = !*p.Strict
	}
	if p.KVLoadFailurePolicy != nil {
		if err := validatePolicy(*p.KVLoadFailurePolicy); err != nil {
			return c, err
		}
		c.KVLoadFailurePolicy = *p.KVLoadFailurePolicy
	}
	if err := common.PatchFailStatus(p.FailStatus, &c.FailStatus); err != nil {
		return c, err
	}
	if err := common.PatchFailBody(p.FailBody, &c.FailBody); err != nil {
		return c, err
	}
	common.PatchValue(p.Hang, &c.Hang)
	common.PatchMS(p.PrefillMS, &c.PrefillDelay)
	common.PatchMS(p.PerTokenMS, &c.PerTokenDelay)
	common.PatchMS(p.TransferMS, &c.TransferDelay)
	common.PatchMS(p.AbortRequestTimeoutMS, &c.AbortRequestTimeout)
	common.PatchMS(p.TransferTimeoutMS, &c.TransferTimeout)
	common.PatchMS(p.StartupMS, &c.StartupWindow)
	common.PatchValue(p.EOSAt, &c.EOSAt)
	common.PatchValue(p.DefaultMaxTokens, &c.DefaultMaxTokens)
	common.PatchValue(p.DevMode, &c.DevMode)
	return c.knobDefaults(), nil
}
