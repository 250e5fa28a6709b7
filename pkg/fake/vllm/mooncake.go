package vllm

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/smg-project/smg-extproc/pkg/fake/common"
)

// Mooncake transfer stages on the prefill.
const (
	stageWaitingPrefill = "waiting_prefill" // a decode is pulling, no prefill yet
	stageComputing      = "computing"       // the prefill leg is running
	stageReady          = "ready"           // blocks held for the decode
)

type mcEntry struct {
	tid      string
	stage    string
	prefill  bool // the prefill leg arrived
	rid      string
	engineID string
	rank     int
	hash     uint64
	plen     int
	first    common.Token
	reason   string        // set when the transfer ended without KV
	done     chan struct{} // closed when the prefill finished (ready or not)
	claimed  bool          // a decode is pulling
	since    time.Time
	timer    *time.Timer
}

type mooncakeTable struct {
	s    *Server
	mu   sync.Mutex
	m    map[string]*mcEntry
	gone memory
}

func newMooncakeTable(s *Server) *mooncakeTable {
	return &mooncakeTable{s: s, m: map[string]*mcEntry{}, gone: newMemory(4096)}
}

func (t *mooncakeTable) reset() {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, e := range t.m {
		if e.timer != nil {
			e.timer.Stop()
		}
		t.endLocked(e, "the fake was reset")
	}
	t.m = map[string]*mcEntry{}
	t.gone.reset()
}

// endLocked closes e.done once (a waiting decode then reads e.reason/stage).
func (t *mooncakeTable) endLocked(e *mcEntry, reason string) {
	select {
	case <-e.done:
		return
	default:
	}
	if e.stage != stageReady {
		e.reason = reason
	}
	close(e.done)
}

func (t *mooncakeTable) snapshot() []HeldHandoff {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]HeldHandoff, 0, len(t.m))
	for _, e := range t.m {
		out = append(out, HeldHandoff{Key: e.tid, RID: e.rid, Stage: e.stage, Rank: e.rank, EngineID: e.engineID, Claimed: e.claimed, SinceMS: sinceMS(e.since)})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Key < out[j].Key })
	return out
}

type mcReg struct {
	t *mooncakeTable
	e *mcEntry // nil: nothing registered (lax, no transfer_id)
}

// begin registers the prefill leg's transfer_id.
func (t *mooncakeTable) begin(req *request, cfg Config) (prefillReg, *apiError) {
	const leg = "prefill"
	tid, ok := req.kv.str("transfer_id")
	if !ok || tid == "" {
		msg := "Missing transfer_id in kv_transfer_params from router!"
		t.s.event(leg, req.rid, "", "missing_transfer_id", msg)
		if !cfg.Lax {
			return nil, badRequest("%s", msg)
		}
		return &mcReg{t: t}, nil
	}
	engineID := cfg.effectiveEngineID(req.dpRank)
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.m[tid]
	dup := ""
	switch reason, gone := t.gone.get(tid); {
	case e != nil && e.prefill:
		dup = "is already held by another prefill leg"
	case e == nil && gone:
		dup = "was already used (" + reason + ")"
	}
	if dup != "" {
		msg := fmt.Sprintf("transfer_id %s %s; mint a new transfer_id per attempt", tid, dup)
		t.s.event(leg, req.rid, tid, "duplicate_transfer_id", msg)
		if !cfg.Lax {
			return nil, badRequest("%s", msg)
		}
		return &mcReg{t: t}, nil
	}
	if e == nil {
		e = &mcEntry{tid: tid, done: make(chan struct{}), since: time.Now()}
		t.m[tid] = e
	}
	e.prefill, e.stage, e.rid, e.engineID, e.rank = true, stageComputing, req.rid, engineID, req.dpRank
	t.s.event(leg, req.rid, tid, "registered", "engine "+engineID)
	return &mcReg{t: t, e: e}, nil
}

func (g *mcReg) abort(reason string) {
	if g.e == nil {
		return
	}
	t := g.t
	t.mu.Lock()
	defer t.mu.Unlock()
	t.endLocked(g.e, "the prefill was aborted: "+reason)
	if t.m[g.e.tid] == g.e {
		delete(t.m, g.e.tid)
	}
	t.gone.add(g.e.tid, "aborted before the prefill finished")
}

// finish: Mooncake's request_finished returns (delay_free, None): the
// response's kv_transfer_params is always null; the blocks are held (for a
// pull by transfer_id) only after a length-capped finish.
func (g *mcReg) finish(req *request, c *choice, cfg Config) (map[string]any, bool) {
	if g.e == nil {
		return nil, false
	}
	t, e := g.t, g.e
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.m[e.tid] != e {
		return nil, false // the fake was reset while the prefill ran
	}
	if c.finish != "length" {
		reason := fmt.Sprintf("the prefill finished with finish_reason=%s, so no KV was held", c.finish)
		t.endLocked(e, reason)
		if t.m[e.tid] == e {
			delete(t.m, e.tid)
		}
		t.gone.add(e.tid, reason)
		return nil, false
	}
	e.stage, e.hash, e.plen, e.first = stageReady, common.HashTokens(c.prompt), len(c.prompt), tokenFromChoice(c)
	after := cfg.AbortRequestTimeout
	e.timer = time.AfterFunc(after, func() { t.expire(e, after) })
	t.endLocked(e, "")
	t.s.event("prefill", req.rid, e.tid, "handoff_issued", "blocks held for a pull by transfer_id")
	return nil, true
}

func (t *mooncakeTable) expire(e *mcEntry, after time.Duration) {
	t.mu.Lock()
	if t.m[e.tid] != e {
		t.mu.Unlock()
		return
	}
	delete(t.m, e.tid)
	t.gone.add(e.tid, fmt.Sprintf("expired after %s (no decode pulled it)", after))
	t.mu.Unlock()
	t.s.event("prefill", e.rid, e.tid, "orphan_transfer", "no decode pulled the transfer; blocks freed after the abort timeout")
}

// pull is the decode's request for transfer tid (ordering-agnostic: it
// waits for the prefill while the caller's context allows).
func (t *mooncakeTable) pull(ctx context.Context, rr *readRequest) (*common.Token, int, string) {
	tid := rr.TransferID
	t.mu.Lock()
	e := t.m[tid]
	if e == nil {
		if reason, gone := t.gone.get(tid); gone {
			t.mu.Unlock()
			return nil, http.StatusGone, fmt.Sprintf("transfer_id %s: %s", tid, reason)
		}
		e = &mcEntry{tid: tid, stage: stageWaitingPrefill, done: make(chan struct{}), since: time.Now()}
		t.m[tid] = e
	}
	if e.claimed {
		t.mu.Unlock()
		return nil, http.StatusConflict, fmt.Sprintf("transfer_id %s is already being pulled by another decode", tid)
	}
	e.claimed = true
	t.mu.Unlock()

	select {
	case <-e.done:
	case <-ctx.Done():
		t.mu.Lock()
		e.claimed = false
		if !e.prefill && t.m[tid] == e {
			delete(t.m, tid)
		}
		t.mu.Unlock()
		return nil, http.StatusGatewayTimeout, fmt.Sprintf("no prefill for transfer_id %s arrived in time", tid)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	e.claimed = false
	if t.m[tid] != e {
		reason, ok := t.gone.get(tid)
		if !ok {
			reason = "the transfer is gone"
		}
		return nil, http.StatusGone, fmt.Sprintf("transfer_id %s: %s", tid, reason)
	}
	if e.stage != stageReady || e.reason != "" {
		return nil, http.StatusGone, fmt.Sprintf("transfer_id %s: %s", tid, e.reason)
	}
	var reason string
	switch {
	case rr.EngineID != e.engineID:
		reason = fmt.Sprintf("transfer_id %s was prefilled by engine %s, not %s", tid, e.engineID, rr.EngineID)
	case rr.PromptHash != hashString(e.hash) || rr.PromptLen != e.plen:
		reason = fmt.Sprintf("KV mismatch: the decode's prompt (%d tokens, hash %s) is not the prefill's (%d tokens, hash %s)", rr.PromptLen, rr.PromptHash, e.plen, hashString(e.hash))
	}
	if reason != "" {
		t.s.event("bootstrap", e.rid, tid, "pull_rejected", reason)
		return nil, http.StatusConflict, reason
	}
	delete(t.m, tid)
	e.timer.Stop()
	t.gone.add(tid, "already consumed by a decode (one transfer per transfer_id)")
	t.s.event("prefill", e.rid, tid, "handoff_consumed", "pulled by "+rr.Decode)
	return &e.first, http.StatusOK, ""
}

// bootstrapMux is the prefill's Mooncake bootstrap server: POST /register,
// GET /query, and the fake's worker endpoint POST /_fake/mooncake/pull
// (advertised as the rank's worker_addr).
func (s *Server) bootstrapMux() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /register", func(w http.ResponseWriter, r *http.Request) {
		var body map[string]any
		if err := decodeBody(r, &body); err != nil {
			common.WriteJSON(w, http.StatusBadRequest, map[string]any{"detail": "invalid registration: " + err.Error()})
			return
		}
		s.event("bootstrap", "", "", "register", mustJSON(body))
		common.WriteJSON(w, http.StatusOK, map[string]any{"status": "ok"})
	})
	mux.HandleFunc("GET /query", func(w http.ResponseWriter, _ *http.Request) {
		common.WriteJSON(w, http.StatusOK, s.mooncakeQuery())
	})
	mux.HandleFunc("POST /_fake/mooncake/pull", func(w http.ResponseWriter, r *http.Request) {
		var rr readRequest
		if err := decodeBody(r, &rr); err != nil || rr.TransferID == "" {
			readFail(w, http.StatusBadRequest, "bad pull request")
			return
		}
		tok, status, reason := s.mc.pull(r.Context(), &rr)
		if r.Context().Err() != nil {
			return
		}
		if tok == nil {
			readFail(w, status, "%s", reason)
			return
		}
		readOK(w, *tok)
	})
	return mux
}

type mcWorker struct {
	EngineID   string                       `json:"engine_id"`
	WorkerAddr map[string]map[string]string `json:"worker_addr"`
}

// mooncakeQuery is GET /query: {dp_rank: {engine_id, worker_addr: {tp_rank:
// {pp_rank: "tcp://ip:port"}}}}.
func (s *Server) mooncakeQuery() map[string]mcWorker {
	cfg := s.Config()
	addr := "tcp://" + net.JoinHostPort(cfg.Host, strconv.Itoa(s.bootPort))
	out := make(map[string]mcWorker, cfg.DPSize)
	for r := 0; r < cfg.DPSize; r++ {
		out[strconv.Itoa(r)] = mcWorker{EngineID: cfg.effectiveEngineID(r), WorkerAddr: map[string]map[string]string{"0": {"0": addr}}}
	}
	return out
}

// loadMooncake is the decode side: validate the synthesized params, resolve
// remote_engine_id through remote_bootstrap_addr/query, then pull the
// transfer from that worker (waiting for the prefill if needed).
func (s *Server) loadMooncake(ctx context.Context, req *request, cfg Config) (*common.Token, error) {
	kv := req.kv
	var missing []string
	tid, ok1 := kv.str("transfer_id")
	engineID, ok2 := kv.str("remote_engine_id")
	addr, ok3 := kv.str("remote_bootstrap_addr")
	for _, m := range []struct {
		key string
		ok  bool
	}{{"transfer_id", ok1 && tid != ""}, {"remote_engine_id", ok2 && engineID != ""}, {"remote_bootstrap_addr", ok3 && addr != ""}} {
		if !m.ok {
			missing = append(missing, m.key)
		}
	}
	if len(missing) > 0 {
		return nil, &paramsError{msg: "invalid kv_transfer_params: missing " + joinKeys(missing) + " (Mooncake needs transfer_id, remote_engine_id and remote_bootstrap_addr)"}
	}
	qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	var query map[string]mcWorker
	status, err := s.callJSON(qctx, http.MethodGet, strings.TrimSuffix(addr, "/")+"/query", nil, &query)
	cancel()
	if ctx.Err() != nil {
		return nil, errClientGone
	}
	if err != nil || status != http.StatusOK {
		if err == nil {
			err = fmt.Errorf("answered %d", status)
		}
		return nil, &loadError{id: tid, reason: fmt.Sprintf("bootstrap query at remote_bootstrap_addr %s failed: %v", addr, err)}
	}
	worker, known := "", make([]string, 0, len(query))
	for _, w := range query {
		known = append(known, w.EngineID)
		if w.EngineID == engineID {
			worker = w.WorkerAddr["0"]["0"]
		}
	}
	sort.Strings(known)
	if worker == "" {
		return nil, &loadError{id: tid, reason: fmt.Sprintf("unknown remote_engine_id %q (the bootstrap server at %s knows %v)", engineID, addr, known)}
	}
	p := first(req.prompts)
	rr := readRequest{
		EngineID: engineID, TransferID: tid,
		PromptHash: hashString(common.HashTokens(p)), PromptLen: len(p), RID: req.rid, Decode: s.url,
	}
	s.event("decode", req.rid, tid, "pulling", "worker "+worker)
	pctx, cancel := context.WithTimeout(ctx, cfg.TransferTimeout)
	defer cancel()
	tok, reason := s.read(pctx, "http://"+strings.TrimPrefix(worker, "tcp://")+"/_fake/mooncake/pull", rr)
	if ctx.Err() != nil {
		return nil, errClientGone
	}
	if tok == nil {
		if pctx.Err() != nil {
			reason = fmt.Sprintf("no prefill for transfer_id %s within %s", tid, cfg.TransferTimeout)
		}
		return nil, &loadError{id: tid, reason: reason}
	}
	return tok, nil
}
