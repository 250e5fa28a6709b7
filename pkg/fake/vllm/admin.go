package vllm

import (
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/smg-project/smg-extproc/pkg/fake/common"
)

// State is the JSON of GET /_fake/state.
type State struct {
	Role             Role   `json:"role"`
	Connector        string `json:"connector"`
	URL              string `json:"url"`
	SideChannelPorts []int  `json:"side_channel_ports,omitempty"`
	BootstrapPort    int    `json:"bootstrap_port,omitempty"`
	HandshakePort    int    `json:"handshake_port,omitempty"`
	NotifyPort       int    `json:"notify_port,omitempty"`
	Starting         bool   `json:"starting"`
	Dead             string `json:"dead,omitempty"`
	InFlight         int64  `json:"in_flight"`
	RequestsTotal    uint64 `json:"requests_total"`
	RequestsDropped  uint64 `json:"requests_dropped"`
	EventsDropped    uint64 `json:"events_dropped"`
	// Held are the handoffs (NIXL) or transfers (Mooncake, MoRI-IO) this
	// worker knows as a prefill: held blocks, a prefill still computing, or
	// a decode waiting for a prefill that has not arrived.
	Held []HeldHandoff `json:"held"`
	// DecodeWaits are the transfer ids a MoRI-IO WRITE decode waits on.
	DecodeWaits     []string   `json:"decode_waits"`
	LoadFailures    int64      `json:"load_failures"`
	PromptTokens    int64      `json:"prompt_tokens"`
	GeneratedTokens int64      `json:"generated_tokens"`
	Config          ConfigView `json:"config"`
}

// State returns a snapshot of the server's held handoffs and counters.
func (s *Server) State() State {
	cfg := s.Config()
	st := State{
		Role: cfg.Role, Connector: cfg.Connector.Short(), URL: s.url, SideChannelPorts: s.SideChannelPorts(),
		BootstrapPort: s.bootPort, HandshakePort: s.hsPort, NotifyPort: s.notePort, Starting: s.starting(),
		Dead: s.Dead(), InFlight: s.inFlight.Load(), RequestsTotal: s.requests.Total(),
		RequestsDropped: s.requests.Dropped(), EventsDropped: s.events.Dropped(),
		LoadFailures: s.loadFail.Load(), PromptTokens: s.promptTok.Load(), GeneratedTokens: s.genTok.Load(),
		Config: cfg.view(),
	}
	switch cfg.Connector {
	case Nixl:
		st.Held = s.nixl.snapshot()
	case Mooncake:
		st.Held = s.mc.snapshot()
	case MoRIIO:
		st.Held = s.mori.snapshot()
	}
	if st.Held == nil {
		st.Held = []HeldHandoff{}
	}
	st.DecodeWaits = s.moriWait.snapshot()
	return st
}

func (s *Server) engineMux() http.Handler {
	mux := http.NewServeMux()
	for _, rt := range []route{routeChat, routeCompletions, routeMessages, routeResponses} {
		mux.HandleFunc(rt.String(), s.engine(rt))
	}
	mux.HandleFunc("/health", s.handleHealth)
	mux.HandleFunc("/ping", s.handleHealth)
	mux.HandleFunc("GET /version", func(w http.ResponseWriter, _ *http.Request) {
		common.WriteJSON(w, http.StatusOK, map[string]string{"version": s.Config().Version})
	})
	mux.HandleFunc("GET /v1/models", s.handleModels)
	mux.HandleFunc("GET /metrics", s.handleMetrics)
	mux.HandleFunc("GET /load", func(w http.ResponseWriter, _ *http.Request) {
		common.WriteJSON(w, http.StatusOK, map[string]int64{"server_load": s.inFlight.Load()})
	})
	mux.HandleFunc("GET /server_info", s.handleServerInfo)
	mux.HandleFunc("/", func(w http.ResponseWriter, _ *http.Request) {
		common.WriteJSON(w, http.StatusNotFound, map[string]string{"detail": "Not Found"})
	})

	common.HandleIntrospection(mux, common.Introspection[ConfigPatch]{
		Requests: s.Requests,
		Events:   s.Events,
		State:    func() any { return s.State() },
		Config:   func() any { return s.Config().view() },
		Patch: func(p ConfigPatch) (any, error) {
			cfg, err := s.patchConfig(p)
			return cfg.view(), err
		},
		Reset:      s.Reset,
		BadRequest: func(msg string) any { return common.NestedError(400, "BadRequestError", msg) },
	})
	return mux
}

// handleHealth: 200 with an empty body; 503 during the startup window or
// once the engine is dead.
func (s *Server) handleHealth(w http.ResponseWriter, _ *http.Request) {
	if s.starting() || s.Dead() != "" {
		w.WriteHeader(http.StatusServiceUnavailable)
		return
	}
	w.WriteHeader(http.StatusOK)
}

func (s *Server) handleModels(w http.ResponseWriter, _ *http.Request) {
	cfg := s.Config()
	created := time.Now().Unix()
	common.WriteJSON(w, http.StatusOK, map[string]any{
		"object": "list",
		"data": []any{map[string]any{
			"id": cfg.Model, "object": "model", "created": created, "owned_by": "vllm",
			"root": cfg.Model, "parent": nil, "max_model_len": cfg.MaxModelLen,
			"permission": []any{map[string]any{
				"id": "modelperm-" + randHex(16), "object": "model_permission", "created": created,
				"allow_create_engine": false, "allow_sampling": true, "allow_logprobs": true,
				"allow_search_indices": false, "allow_view": true, "allow_fine_tuning": false,
				"organization": "*", "group": nil, "is_blocking": false,
			}},
		}},
	})
}

func (s *Server) handleMetrics(w http.ResponseWriter, _ *http.Request) {
	cfg := s.Config()
	labels := fmt.Sprintf(`{engine="0",model_name=%q}`, cfg.Model)
	var b strings.Builder
	metric := func(kind, name, help string, v any) {
		fmt.Fprintf(&b, "# HELP vllm:%s %s\n# TYPE vllm:%s %s\nvllm:%s%s %v\n", name, help, name, kind, name, labels, v)
	}
	metric("gauge", "num_requests_running", "Number of requests in model execution batches.", s.inFlight.Load())
	metric("gauge", "num_requests_waiting", "Number of requests waiting to be processed.", 0)
	metric("gauge", "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", 0.0)
	metric("counter", "prompt_tokens_total", "Number of prefill tokens processed.", s.promptTok.Load())
	metric("counter", "generation_tokens_total", "Number of generation tokens processed.", s.genTok.Load())
	metric("counter", "request_success_total", "Count of successfully processed requests.", s.success.Load())
	common.WriteRaw(w, http.StatusOK, "text/plain; version=0.0.4; charset=utf-8", []byte(b.String()))
}

// handleServerInfo exists only in dev mode (VLLM_SERVER_DEV_MODE=1).
func (s *Server) handleServerInfo(w http.ResponseWriter, r *http.Request) {
	cfg := s.Config()
	if !cfg.DevMode {
		common.WriteJSON(w, http.StatusNotFound, map[string]string{"detail": "Not Found"})
		return
	}
	var connector, role any
	extra := map[string]any{}
	if cfg.Connector != None {
		connector, role = string(cfg.Connector), string(cfg.Role)
		switch cfg.Connector {
		case MoRIIO:
			extra = map[string]any{"handshake_port": s.hsPort, "notify_port": s.notePort, "read_mode": cfg.MoRIIOMode == Read}
		case Mooncake:
			extra = map[string]any{"bootstrap_port": s.bootPort}
		}
	}
	engineID := cfg.EngineID
	if cfg.Connector == MoRIIO {
		engineID = s.moriEngineID(cfg)
	}
	vc := map[string]any{
		"model_config": map[string]any{"model": cfg.Model, "served_model_name": cfg.Model, "max_model_len": cfg.MaxModelLen},
		"cache_config": map[string]any{"block_size": cfg.BlockSize, "cache_dtype": "auto"},
		"parallel_config": map[string]any{
			"tensor_parallel_size": cfg.TPSize, "data_parallel_size": cfg.DPSize, "data_parallel_rank": cfg.DPRank,
		},
		"kv_transfer_config": map[string]any{
			"kv_connector": connector, "kv_role": role, "engine_id": engineID,
			"kv_connector_extra_config": extra, "kv_load_failure_policy": cfg.KVLoadFailurePolicy,
		},
	}
	if r.URL.Query().Get("config_format") == "json" {
		common.WriteJSON(w, http.StatusOK, map[string]any{"vllm_config": vc})
		return
	}
	common.WriteJSON(w, http.StatusOK, map[string]any{"vllm_config": mustJSON(vc)})
}
