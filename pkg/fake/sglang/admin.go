package sglang

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/smg-project/smg-extproc/pkg/fake/common"
)

// RoomState describes one pending room in GET /_fake/state.
type RoomState struct {
	Room           uint64 `json:"room"`
	RID            string `json:"rid,omitempty"`
	Stage          string `json:"stage"`
	PrefillPresent bool   `json:"prefill_present,omitempty"`
	DecodeID       string `json:"decode_id,omitempty"`
	SinceMS        int64  `json:"since_ms"`
}

// State is the JSON of GET /_fake/state.
type State struct {
	Mode            Mode        `json:"mode"`
	URL             string      `json:"url"`
	BootstrapPort   int         `json:"bootstrap_port"`
	Starting        bool        `json:"starting"`
	InFlight        int64       `json:"in_flight"`
	RequestsTotal   uint64      `json:"requests_total"`
	RequestsDropped uint64      `json:"requests_dropped"`
	EventsDropped   uint64      `json:"events_dropped"`
	PendingRooms    []RoomState `json:"pending_rooms"`
	BootstrapFailed int64       `json:"bootstrap_failed"`
	TransferFailed  int64       `json:"transfer_failed"`
	GeneratedTokens int64       `json:"generated_tokens"`
	Config          ConfigView  `json:"config"`
}

// State returns a snapshot of the server's pending rooms and counters. On a
// prefill, PendingRooms are the bootstrap table's rooms (stages
// waiting_join, waiting_prefill, transferring); on a decode, the rooms its
// requests are working on (fetching, waiting_transfer).
func (s *Server) State() State {
	cfg := s.Config()
	st := State{
		Mode: cfg.Mode, URL: s.url, BootstrapPort: s.bootPort, Starting: s.starting(),
		InFlight: s.inFlight.Load(), RequestsTotal: s.requests.Total(), RequestsDropped: s.requests.Dropped(),
		EventsDropped: s.events.Dropped(), BootstrapFailed: s.bootstrapFailed.Load(),
		TransferFailed: s.transferFailed.Load(), GeneratedTokens: s.genTokens.Load(), Config: cfg.view(),
	}
	if cfg.Mode == Prefill {
		st.PendingRooms = s.rooms.snapshot()
	} else {
		st.PendingRooms = s.dRooms.snapshot()
	}
	return st
}

func (s *Server) engineMux() http.Handler {
	mux := http.NewServeMux()
	for _, rt := range []route{routeGenerate, routeChat, routeCompletions, routeMessages, routeResponses, routeRerank, routeCountTokens} {
		mux.HandleFunc(rt.String(), s.engine(rt))
	}
	mux.HandleFunc("/health", s.handleHealth)
	mux.HandleFunc("/health_generate", s.handleHealth)
	mux.HandleFunc("/get_server_info", s.handleServerInfo)
	mux.HandleFunc("/server_info", s.handleServerInfo)
	mux.HandleFunc("/get_model_info", s.handleModelInfo)
	mux.HandleFunc("/model_info", s.handleModelInfo)
	mux.HandleFunc("/v1/models", s.handleModels)
	mux.HandleFunc("/get_load", s.handleLoad)
	mux.HandleFunc("/v1/loads", s.handleLoad)
	mux.HandleFunc("/metrics", s.handleMetrics)
	mux.HandleFunc("/flush_cache", s.handleFlushCache)

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
		BadRequest: func(msg string) any { return common.MessageError(msg) },
	})
	return mux
}

func (s *Server) handleHealth(w http.ResponseWriter, r *http.Request) {
	if s.starting() {
		w.WriteHeader(http.StatusServiceUnavailable)
		return
	}
	w.WriteHeader(http.StatusOK)
}

func (s *Server) handleServerInfo(w http.ResponseWriter, _ *http.Request) {
	cfg := s.Config()
	tput := 0.0
	common.WriteJSON(w, http.StatusOK, map[string]any{
		"model_path":                      cfg.Model,
		"tokenizer_path":                  cfg.Model,
		"served_model_name":               cfg.Model,
		"host":                            cfg.Host,
		"port":                            cfg.HTTPPort,
		"disaggregation_mode":             string(cfg.Mode),
		"disaggregation_transfer_backend": cfg.TransferBackend,
		"disaggregation_bootstrap_port":   s.bootPort,
		"disaggregation_ib_device":        nil,
		"page_size":                       cfg.PageSize,
		"kv_cache_dtype":                  cfg.KVCacheDtype,
		"dtype":                           "auto",
		"attention_backend":               "fake",
		"max_running_requests":            cfg.MaxRunningRequests,
		"max_total_num_tokens":            cfg.ContextLength * 16,
		"max_req_input_len":               cfg.ContextLength - 1,
		"context_length":                  cfg.ContextLength,
		"tp_size":                         cfg.TPSize,
		"dp_size":                         cfg.DPSize,
		"enable_dp_attention":             false,
		"load_balance_method":             "follow_bootstrap_room",
		"is_embedding":                    false,
		"internal_states":                 []any{map[string]any{"last_gen_throughput": tput}},
		"version":                         "0.0.0-fake",
	})
}

func (s *Server) handleModelInfo(w http.ResponseWriter, _ *http.Request) {
	cfg := s.Config()
	common.WriteJSON(w, http.StatusOK, map[string]any{
		"model_path": cfg.Model, "tokenizer_path": cfg.Model, "is_generation": true,
		"preferred_sampling_params": nil, "weight_version": "default",
		"model_type": "fake", "architectures": []string{"FakeForCausalLM"},
	})
}

func (s *Server) handleModels(w http.ResponseWriter, _ *http.Request) {
	cfg := s.Config()
	common.WriteJSON(w, http.StatusOK, map[string]any{
		"object": "list",
		"data": []any{map[string]any{
			"id": cfg.Model, "object": "model", "created": time.Now().Unix(), "owned_by": "sglang",
			"root": cfg.Model, "max_model_len": cfg.ContextLength,
		}},
	})
}

func (s *Server) handleLoad(w http.ResponseWriter, _ *http.Request) {
	cfg := s.Config()
	loads := make([]any, cfg.DPSize)
	for i := range loads {
		n := int64(0)
		if i == 0 {
			n = s.inFlight.Load()
		}
		loads[i] = map[string]any{
			"dp_rank": i, "num_reqs": n, "num_waiting_reqs": 0, "num_tokens": 0,
			"num_pending_tokens": 0, "ts_tic": float64(time.Now().UnixNano()) / 1e9,
		}
	}
	common.WriteJSON(w, http.StatusOK, loads)
}

func (s *Server) handleMetrics(w http.ResponseWriter, _ *http.Request) {
	cfg := s.Config()
	var pPrealloc, pBootstrap, pInflight, dPrealloc, dTransfer int
	if cfg.Mode == Prefill {
		pBootstrap, pInflight = s.rooms.counts()
	} else {
		dPrealloc, dTransfer = s.dRooms.counts()
	}
	labels := fmt.Sprintf(`{model_name=%q,engine_type="unified"}`, cfg.Model)
	var b strings.Builder
	gauge := func(name, help string, v any) {
		fmt.Fprintf(&b, "# HELP sglang:%s %s\n# TYPE sglang:%s gauge\nsglang:%s%s %v\n", name, help, name, name, labels, v)
	}
	counter := func(name, help string, v any) {
		fmt.Fprintf(&b, "# HELP sglang:%s %s\n# TYPE sglang:%s counter\nsglang:%s%s %v\n", name, help, name, name, labels, v)
	}
	gauge("num_running_reqs", "The number of running requests.", s.inFlight.Load())
	gauge("num_queue_reqs", "The number of requests in the waiting queue.", 0)
	gauge("token_usage", "The token usage.", 0.0)
	gauge("gen_throughput", "The generation throughput (token/s).", 0.0)
	gauge("num_prefill_prealloc_queue_reqs", "The number of requests in the prefill prealloc queue.", pPrealloc)
	gauge("num_prefill_bootstrap_queue_reqs", "The number of requests in the prefill bootstrap queue.", pBootstrap)
	gauge("num_prefill_inflight_queue_reqs", "The number of requests in the prefill inflight queue.", pInflight)
	gauge("num_decode_prealloc_queue_reqs", "The number of requests in the decode prealloc queue.", dPrealloc)
	gauge("num_decode_transfer_queue_reqs", "The number of requests in the decode transfer queue.", dTransfer)
	counter("num_bootstrap_failed_reqs_total", "The number of bootstrap failed requests.", s.bootstrapFailed.Load())
	counter("num_transfer_failed_reqs_total", "The number of transfer failed requests.", s.transferFailed.Load())
	counter("generation_tokens_total", "Number of generation tokens processed.", s.genTokens.Load())
	common.WriteRaw(w, http.StatusOK, "text/plain; version=0.0.4; charset=utf-8", []byte(b.String()))
}

func (s *Server) handleFlushCache(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet && r.Method != http.MethodPost {
		w.WriteHeader(http.StatusMethodNotAllowed)
		return
	}
	common.WriteRaw(w, http.StatusOK, "text/plain; charset=utf-8",
		[]byte("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n"))
}

// ---- bootstrap server (prefill) ----

func (s *Server) bootstrapMux() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/route", s.handleRoute)
	mux.HandleFunc("/health", func(w http.ResponseWriter, _ *http.Request) {
		common.WriteRaw(w, http.StatusOK, "text/plain; charset=utf-8", []byte("OK"))
	})
	mux.HandleFunc("POST /register_dp_rank", func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, io.LimitReader(r.Body, 1<<20))
		common.WriteRaw(w, http.StatusOK, "text/plain; charset=utf-8", []byte("OK"))
	})
	mux.HandleFunc("POST /query_dp_ranks", s.handleQueryDPRanks)
	mux.HandleFunc("POST /_fake/join", s.handleJoin)
	mux.HandleFunc("POST /_fake/abort", s.handleAbort)
	return mux
}

func text(w http.ResponseWriter, status int, msg string) {
	common.WriteRaw(w, status, "text/plain; charset=utf-8", []byte(msg))
}

func (s *Server) handleRoute(w http.ResponseWriter, r *http.Request) {
	cfg := s.Config()
	switch r.Method {
	case http.MethodPut:
		_, _ = io.Copy(io.Discard, io.LimitReader(r.Body, 1<<20))
		text(w, http.StatusOK, "OK")
		return
	case http.MethodGet:
	default:
		text(w, http.StatusMethodNotAllowed, "Method not allowed")
		return
	}
	q := r.URL.Query()
	var ranks [4]int
	for i, k := range []string{"prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank"} {
		v, err := strconv.Atoi(q.Get(k))
		if !q.Has(k) || err != nil {
			text(w, http.StatusBadRequest, "Missing inputs for bootstrap server.")
			return
		}
		ranks[i] = v
	}
	if s.starting() {
		text(w, http.StatusServiceUnavailable, "Prefill server not fully registered yet (0 workers registered).")
		return
	}
	dp, cp, tp, pp := ranks[0], ranks[1], ranks[2], ranks[3]
	if dp == -1 && cp == -1 && tp == -1 && pp == -1 {
		common.WriteJSON(w, http.StatusOK, prefillInfo{
			AttnTPSize: cfg.TPSize, AttnCPSize: 1, DPSize: cfg.DPSize, PPSize: 1,
			PageSize: cfg.PageSize, KVCacheDtype: cfg.KVCacheDtype, FollowBootstrapRoom: true,
			PrefillHTTPPort: cfg.HTTPPort,
		})
		return
	}
	if dp >= 0 && dp < cfg.DPSize && cp == 0 && tp >= 0 && tp < cfg.TPSize && pp == 0 {
		common.WriteJSON(w, http.StatusOK, map[string]any{"rank_ip": cfg.Host, "rank_port": s.bootPort})
		return
	}
	text(w, http.StatusNotFound, fmt.Sprintf("Bootstrap info not found for dp_rank=%d cp_rank=%d tp_rank=%d pp_rank=%d", dp, cp, tp, pp))
}

func (s *Server) handleQueryDPRanks(w http.ResponseWriter, r *http.Request) {
	var body struct {
		Rooms []uint64 `json:"bootstrap_rooms"`
	}
	if err := json.NewDecoder(io.LimitReader(r.Body, 1<<20)).Decode(&body); err != nil {
		text(w, http.StatusBadRequest, "Missing inputs for bootstrap server.")
		return
	}
	dp := uint64(s.Config().DPSize)
	out := make(map[string]uint64, len(body.Rooms))
	for _, room := range body.Rooms {
		out[strconv.FormatUint(room, 10)] = room % dp
	}
	common.WriteJSON(w, http.StatusOK, out)
}

func joinReply(w http.ResponseWriter, status int, st, msg string) {
	common.WriteJSON(w, status, transferResult{Status: st, Message: msg})
}

// handleJoin is the decode's stand-in for the ZMQ "send destination
// indices" step. It long-polls: the answer comes when the room transferred
// (200), was aborted (410) or the join was rejected (409/400).
func (s *Server) handleJoin(w http.ResponseWriter, r *http.Request) {
	var j joinInfo
	if err := json.NewDecoder(io.LimitReader(r.Body, 1<<20)).Decode(&j); err != nil || j.DecodeID == "" {
		joinReply(w, http.StatusBadRequest, "bad_request", "bad join request")
		return
	}
	cfg := s.Config()
	room := common.RoomPtr(j.Room)
	if j.PageSize != cfg.PageSize {
		joinReply(w, http.StatusBadRequest, "bad_request", fmt.Sprintf("Page size mismatch: prefill server has page_size=%d, but decode server has page_size=%d", cfg.PageSize, j.PageSize))
		return
	}
	if j.KVCacheDtype != cfg.KVCacheDtype {
		joinReply(w, http.StatusBadRequest, "bad_request", fmt.Sprintf("KV cache dtype mismatch: prefill server has kv_cache_dtype=%s, but decode server has kv_cache_dtype=%s", cfg.KVCacheDtype, j.KVCacheDtype))
		return
	}
	e, res := s.rooms.join(&j, !cfg.Lax)
	switch res {
	case joinDuplicate:
		msg := fmt.Sprintf("bootstrap_room %d already joined by decode %s; second join from %s rejected", j.Room, e.join.DecodeID, j.DecodeID)
		s.event("bootstrap", j.RID, room, "join_rejected", msg)
		if cfg.Lax {
			<-r.Context().Done()
			return
		}
		joinReply(w, http.StatusConflict, "rejected", msg)
		return
	case joinAlreadyTransferred:
		msg := fmt.Sprintf("bootstrap_room %d already transferred; join from %s rejected", j.Room, j.DecodeID)
		s.event("bootstrap", j.RID, room, "join_rejected", msg)
		joinReply(w, http.StatusConflict, "rejected", msg)
		return
	}
	s.event("bootstrap", j.RID, room, "join_accepted", j.DecodeID)
	select {
	case <-e.done:
		common.WriteJSON(w, http.StatusOK, e.result)
	case <-e.aborted:
		joinReply(w, http.StatusGone, "aborted", e.abortMsg)
	case <-r.Context().Done():
		s.rooms.fail(e, "Aborted by AbortReq.")
		s.event("bootstrap", j.RID, room, "join_left", j.DecodeID)
	}
}

func (s *Server) handleAbort(w http.ResponseWriter, r *http.Request) {
	var body struct {
		Room     uint64 `json:"room"`
		DecodeID string `json:"decode_id"`
		Reason   string `json:"reason"`
	}
	if err := json.NewDecoder(io.LimitReader(r.Body, 1<<20)).Decode(&body); err != nil {
		text(w, http.StatusBadRequest, "bad abort request")
		return
	}
	reason := body.Reason
	if reason == "" {
		reason = "Aborted by AbortReq."
	}
	ok := s.rooms.abort(body.Room, body.DecodeID, reason)
	if ok {
		s.event("bootstrap", "", common.RoomPtr(body.Room), "abort_received", body.DecodeID)
	}
	common.WriteJSON(w, http.StatusOK, map[string]bool{"aborted": ok})
}
