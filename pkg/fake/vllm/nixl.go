package vllm

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"sort"
	"strconv"
	"sync"
	"time"

	"github.com/smg-project/smg-extproc/pkg/fake/common"
)

// nixlEntry is one handoff a NIXL prefill holds (its blocks stay allocated
// until a decode reads them or AbortRequestTimeout passes).
type nixlEntry struct {
	requestID string
	rid       string
	engineID  string
	rank      int
	blocks    [][]int
	tpSize    int
	hash      uint64
	plen      int
	first     common.Token
	since     time.Time
	timer     *time.Timer
}

type nixlTable struct {
	s    *Server
	mu   sync.Mutex
	held map[string]*nixlEntry
	gone memory
}

func newNixlTable(s *Server) *nixlTable {
	return &nixlTable{s: s, held: map[string]*nixlEntry{}, gone: newMemory(4096)}
}

func (t *nixlTable) reset() {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, e := range t.held {
		e.timer.Stop()
	}
	t.held = map[string]*nixlEntry{}
	t.gone.reset()
}

func (t *nixlTable) snapshot() []HeldHandoff {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]HeldHandoff, 0, len(t.held))
	for _, e := range t.held {
		out = append(out, HeldHandoff{Key: e.requestID, RID: e.rid, Stage: "held", Rank: e.rank, EngineID: e.engineID, SinceMS: sinceMS(e.since)})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Key < out[j].Key })
	return out
}

// nixlReg is the NIXL prefill bookkeeping: nothing until the request
// finishes; then request_finished() holds the blocks if the finish is
// "length" (FINISHED_LENGTH_CAPPED).
type nixlReg struct {
	s    *Server
	rank int
}

func (g *nixlReg) abort(string) {}

func (g *nixlReg) finish(req *request, c *choice, cfg Config) (map[string]any, bool) {
	if c.finish != "length" {
		return nil, false
	}
	s, t := g.s, g.s.nixl
	e := &nixlEntry{
		requestID: req.internalID(0), rid: req.rid, engineID: cfg.effectiveEngineID(g.rank), rank: g.rank,
		blocks: newBlockIDs(len(c.prompt), cfg), tpSize: cfg.TPSize,
		hash: common.HashTokens(c.prompt), plen: len(c.prompt), first: tokenFromChoice(c), since: time.Now(),
	}
	t.mu.Lock()
	t.held[e.requestID] = e
	e.timer = time.AfterFunc(cfg.AbortRequestTimeout, func() { t.expire(e, cfg.AbortRequestTimeout) })
	t.mu.Unlock()
	s.event("prefill", req.rid, "", "handoff_issued", "remote_request_id="+e.requestID)
	port := 0
	if g.rank < len(s.sidePorts) {
		port = s.sidePorts[g.rank]
	}
	return map[string]any{
		"do_remote_prefill": true,
		"do_remote_decode":  false,
		"remote_block_ids":  e.blocks,
		"remote_engine_id":  e.engineID,
		"remote_request_id": e.requestID,
		"remote_host":       cfg.SideChannelHost,
		"remote_port":       port,
		"tp_size":           e.tpSize,
	}, true
}

func (t *nixlTable) expire(e *nixlEntry, after time.Duration) {
	t.mu.Lock()
	if t.held[e.requestID] != e {
		t.mu.Unlock()
		return
	}
	delete(t.held, e.requestID)
	t.gone.add(e.requestID, fmt.Sprintf("expired: its blocks were freed after the abort timeout (%s)", after))
	t.mu.Unlock()
	t.s.event("prefill", e.rid, "", "handoff_expired", "remote_request_id="+e.requestID+": no decode read it; blocks freed")
}

// nixlMux is the side channel of DP rank `rank`: POST /_fake/nixl/read is
// the decode's read of a held handoff (handshake + block read + notify, in
// one call). It consumes the handoff: a second read fails.
func (s *Server) nixlMux(rank int) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /_fake/nixl/read", func(w http.ResponseWriter, r *http.Request) {
		var rr readRequest
		if err := decodeBody(r, &rr); err != nil {
			readFail(w, http.StatusBadRequest, "bad read request: %v", err)
			return
		}
		s.nixl.read(w, rank, &rr)
	})
	mux.HandleFunc("GET /_fake/nixl/info", func(w http.ResponseWriter, _ *http.Request) {
		cfg := s.Config()
		common.WriteJSON(w, http.StatusOK, map[string]any{"engine_id": cfg.effectiveEngineID(rank), "dp_rank": rank, "tp_size": cfg.TPSize})
	})
	return mux
}

func (t *nixlTable) read(w http.ResponseWriter, rank int, rr *readRequest) {
	cfg := t.s.Config()
	if want := cfg.effectiveEngineID(rank); rr.EngineID != want {
		readFail(w, http.StatusNotFound, "unknown remote_engine_id %q: this side channel serves engine %q", rr.EngineID, want)
		return
	}
	t.mu.Lock()
	e := t.held[rr.RequestID]
	if e == nil {
		reason, gone := t.gone.get(rr.RequestID)
		t.mu.Unlock()
		if gone {
			readFail(w, http.StatusGone, "remote_request_id %s was already %s", rr.RequestID, reason)
		} else {
			readFail(w, http.StatusNotFound, "unknown remote_request_id %q on engine %s (the prefill's internal request id must be relayed verbatim)", rr.RequestID, rr.EngineID)
		}
		return
	}
	var reason string
	switch {
	case e.rank != rank:
		reason = fmt.Sprintf("remote_request_id %s is held by dp rank %d, not by this side channel (rank %d)", rr.RequestID, e.rank, rank)
	case !sameJSON(rr.BlockIDs, e.blocks):
		reason = fmt.Sprintf("remote_block_ids %s differ from the blocks issued for %s (%s)", compact(rr.BlockIDs), rr.RequestID, mustJSON(e.blocks))
	case len(rr.TPSize) > 0 && !common.IsNull(rr.TPSize) && !sameJSON(rr.TPSize, e.tpSize):
		reason = fmt.Sprintf("tp_size %s differs from the prefill's tp_size %d", compact(rr.TPSize), e.tpSize)
	case rr.PromptHash != hashString(e.hash) || rr.PromptLen != e.plen:
		reason = fmt.Sprintf("KV mismatch: the decode's prompt (%d tokens, hash %s) is not the prefill's (%d tokens, hash %s)", rr.PromptLen, rr.PromptHash, e.plen, hashString(e.hash))
	}
	if reason != "" {
		t.mu.Unlock()
		t.s.event("side_channel", e.rid, "", "read_rejected", reason)
		readFail(w, http.StatusConflict, "%s", reason)
		return
	}
	delete(t.held, e.requestID)
	e.timer.Stop()
	t.gone.add(e.requestID, "consumed by a decode (one transfer per handoff; the blocks were freed)")
	t.mu.Unlock()
	t.s.event("prefill", e.rid, "", "handoff_consumed", "remote_request_id="+e.requestID+" read by "+rr.Decode)
	readOK(w, e.first)
}

// loadNixl is the decode side: validate the relayed params, then read the
// handoff through the prefill's side channel at remote_host:remote_port.
func (s *Server) loadNixl(ctx context.Context, req *request, cfg Config) (*common.Token, error) {
	kv := req.kv
	if !nonEmptyList(kv["remote_block_ids"]) {
		return nil, &paramsError{
			msg:       "invalid kv_transfer_params: missing remote_block_ids (do_remote_prefill=true needs the prefill's blocks)",
			laxStatus: 500,
			laxMsg:    "AssertionError: assert num_external_tokens == 0 (do_remote_prefill without remote_block_ids)",
		}
	}
	var missing []string
	for _, k := range []string{"remote_engine_id", "remote_request_id", "remote_host", "remote_port"} {
		if !kv.has(k) {
			missing = append(missing, k)
		}
	}
	if len(missing) > 0 {
		return nil, &paramsError{msg: "invalid kv_transfer_params: missing " + joinKeys(missing)}
	}
	engineID, ok1 := kv.str("remote_engine_id")
	requestID, ok2 := kv.str("remote_request_id")
	host, ok3 := kv.str("remote_host")
	port, _, ok4 := kv.intLike("remote_port")
	if !ok1 || !ok2 || !ok3 || !ok4 || port <= 0 || port > 65535 {
		return nil, &paramsError{msg: fmt.Sprintf("invalid kv_transfer_params: remote_engine_id, remote_request_id and remote_host must be strings and remote_port a port (got %s)", compactKV(kv))}
	}
	p := first(req.prompts)
	rr := readRequest{
		EngineID: engineID, RequestID: requestID, BlockIDs: kv["remote_block_ids"], TPSize: kv["tp_size"],
		PromptHash: hashString(common.HashTokens(p)), PromptLen: len(p), RID: req.rid, Decode: s.url,
	}
	url := "http://" + net.JoinHostPort(host, strconv.FormatInt(port, 10)) + "/_fake/nixl/read"
	rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	tok, reason := s.read(rctx, url, rr)
	if ctx.Err() != nil {
		return nil, errClientGone
	}
	if tok == nil {
		return nil, &loadError{id: requestID, reason: reason}
	}
	return tok, nil
}

func first(prompts [][]int) []int {
	if len(prompts) == 0 {
		return nil
	}
	return prompts[0]
}

func compact(raw json.RawMessage) string {
	if v := normJSON(raw); v != nil {
		return mustJSON(v)
	}
	return string(raw)
}

func compactKV(kv kvParams) string {
	b, _ := json.Marshal(kv)
	return string(b)
}

func mustJSON(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}
