package vllm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/smg-project/smg-extproc/pkg/fake/common"
)

// Request-id peer markers (P2pNccl / MoRI-IO, vllm-router style ids):
// ___prefill_addr_<zmq>___decode_addr_<zmq>_<32 hex>, where <zmq> is
// "host:IP,handshake:PORT,notify:PORT".
const (
	markerPrefill = "___prefill_addr_"
	markerDecode  = "___decode_addr_"
)

// The regexes MoRI-IO uses (immutable; compiled once).
var (
	prefillMarkerRE = regexp.MustCompile(`___prefill_addr_(.+?)___decode_addr_`)
	decodeMarkerRE  = regexp.MustCompile(`___decode_addr_(.+)_[0-9a-f]{32}(?:-.*)?$`)
)

// moriPeer is a MoRI-IO side channel: host plus handshake and notify ports.
type moriPeer struct {
	Host          string `json:"host"`
	HandshakePort int    `json:"handshake_port"`
	NotifyPort    int    `json:"notify_port"`
}

func (p moriPeer) String() string {
	return fmt.Sprintf("%s (handshake %d, notify %d)", p.Host, p.HandshakePort, p.NotifyPort)
}

func (p moriPeer) handshakeURL(path string) string {
	return "http://" + net.JoinHostPort(p.Host, strconv.Itoa(p.HandshakePort)) + path
}

func (p moriPeer) notifyURL() string {
	return "http://" + net.JoinHostPort(p.Host, strconv.Itoa(p.NotifyPort)) + "/_fake/moriio/notify"
}

// parseZMQ parses "host:IP,handshake:PORT,notify:PORT".
func parseZMQ(addr string) (moriPeer, error) {
	var p moriPeer
	for _, f := range strings.Split(addr, ",") {
		k, v, ok := strings.Cut(strings.TrimSpace(f), ":")
		if !ok {
			return p, fmt.Errorf("field %q is not key:value", f)
		}
		switch k {
		case "host":
			p.Host = v
		case "handshake", "notify":
			n, err := strconv.Atoi(v)
			if err != nil || n <= 0 || n > 65535 {
				return p, fmt.Errorf("%s port %q", k, v)
			}
			if k == "handshake" {
				p.HandshakePort = n
			} else {
				p.NotifyPort = n
			}
		}
	}
	if p.Host == "" || p.HandshakePort == 0 || p.NotifyPort == 0 {
		return p, fmt.Errorf("%q needs host, handshake and notify", addr)
	}
	return p, nil
}

func hasMarkers(req *request) bool {
	return req.ridFrom != "generated" && (strings.Contains(req.rid, markerPrefill) || strings.Contains(req.rid, markerDecode))
}

// explicitPeer reads remote_host / remote_handshake_port / remote_notify_port.
func explicitPeer(kv kvParams) (moriPeer, bool, string) {
	var p moriPeer
	present := kv.has("remote_host") || kv.has("remote_handshake_port") || kv.has("remote_notify_port")
	if !present {
		return p, false, ""
	}
	var bad []string
	host, ok := kv.str("remote_host")
	if !ok || host == "" || strings.ContainsAny(host, " \t\n") {
		bad = append(bad, "remote_host")
	}
	p.Host = host
	for _, k := range []string{"remote_handshake_port", "remote_notify_port"} {
		v, _, ok := kv.intLike(k)
		if !ok || v <= 0 || v > 65535 {
			bad = append(bad, k)
			continue
		}
		if k == "remote_handshake_port" {
			p.HandshakePort = int(v)
		} else {
			p.NotifyPort = int(v)
		}
	}
	if len(bad) > 0 {
		return p, true, "missing or invalid " + joinKeys(bad)
	}
	return p, true, ""
}

// resolvePeer finds the other leg's side channel: the explicit
// kv_transfer_params fields, else the request-id markers (which="prefill"
// reads ___prefill_addr_, "decode" reads ___decode_addr_).
func (s *Server) resolvePeer(req *request, cfg Config, which string) (*moriPeer, error) {
	p, present, bad := explicitPeer(req.kv)
	markers := hasMarkers(req)
	if present {
		if markers && !cfg.Lax {
			msg := fmt.Sprintf("request id %q carries MoRI-IO peer markers (%s/%s) while kv_transfer_params names the peer explicitly; a gateway must not forward such ids", req.rid, markerPrefill, markerDecode)
			s.event("engine", req.rid, "", "request_id_markers", msg)
			return nil, badRequest("%s", msg)
		}
		if bad != "" {
			return nil, &paramsError{msg: "invalid kv_transfer_params: " + bad}
		}
		return &p, nil
	}
	if markers {
		re := prefillMarkerRE
		if which == "decode" {
			re = decodeMarkerRE
		}
		m := re.FindStringSubmatch(req.rid)
		if m == nil {
			return nil, errf(500, "Malformed zmq_address: request id %q has no %s address", req.rid, which)
		}
		mp, err := parseZMQ(m[1])
		if err != nil {
			return nil, errf(500, "Malformed zmq_address %q: %v", m[1], err)
		}
		return &mp, nil
	}
	return nil, &paramsError{msg: fmt.Sprintf("invalid kv_transfer_params: missing the %s's side channel (remote_host, remote_handshake_port, remote_notify_port) and the request id carries no markers", which)}
}

func (s *Server) moriEngineID(cfg Config) string {
	return fmt.Sprintf("%s:%d", cfg.MoRIIOHost, s.hsPort)
}

// moriCheckParams applies MoRI-IO's scheduler-side reads to any non-empty
// kv_transfer_params: params["transfer_id"] (a KeyError kills the engine)
// and int() of remote_dp_size / remote_tp_size.
func (s *Server) moriCheckParams(req *request) *apiError {
	if _, ok := req.kv["transfer_id"]; !ok {
		reason := "KeyError: 'transfer_id' in update_state_after_alloc"
		s.kill(reason)
		s.event("engine", req.rid, "", "engine_dead", reason+" (kv_transfer_params without transfer_id)")
		return errf(500, "engine error: KeyError transfer_id (kv_transfer_params without transfer_id killed the EngineCore)")
	}
	for _, k := range []string{"remote_dp_size", "remote_tp_size", "remote_dp_rank", "tp_size"} {
		if _, present, ok := req.kv.intLike(k); present && !ok {
			reason := fmt.Sprintf("ValueError: invalid literal for int() in %s=%s", k, compact(req.kv[k]))
			s.kill(reason)
			s.event("engine", req.rid, "", "engine_dead", reason)
			return errf(500, "engine error: %s", reason)
		}
	}
	if tid, ok := req.kv.str("transfer_id"); !ok || tid == "" {
		s.event("engine", req.rid, "", "kv_params_invalid", "transfer_id must be a non-empty string")
		return badRequest("invalid kv_transfer_params: transfer_id must be a non-empty string, got %s", compact(req.kv["transfer_id"]))
	}
	return nil
}

// ---- prefill-side table ----

const (
	stageIssued  = "issued"
	stagePushing = "pushing"
)

type moriEntry struct {
	tid      string
	stage    string
	prefill  bool
	rid      string
	rank     int
	engineID string
	hash     uint64
	plen     int
	first    common.Token
	blocks   [][]int
	target   *moriPeer // WRITE: the decode named by the prefill leg
	claim    *moriMsg  // WRITE: the decode's remote_blocks notification
	since    time.Time
	timer    *time.Timer
}

type moriTable struct {
	s    *Server
	mu   sync.Mutex
	m    map[string]*moriEntry
	gone memory
}

func newMoriTable(s *Server) *moriTable {
	return &moriTable{s: s, m: map[string]*moriEntry{}, gone: newMemory(4096)}
}

func (t *moriTable) reset() {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, e := range t.m {
		if e.timer != nil {
			e.timer.Stop()
		}
	}
	t.m = map[string]*moriEntry{}
	t.gone.reset()
}

func (t *moriTable) snapshot() []HeldHandoff {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]HeldHandoff, 0, len(t.m))
	for _, e := range t.m {
		out = append(out, HeldHandoff{Key: e.tid, RID: e.rid, Stage: e.stage, Rank: e.rank, EngineID: e.engineID, Claimed: e.claim != nil, SinceMS: sinceMS(e.since)})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Key < out[j].Key })
	return out
}

// moriMsg is one message on a MoRI-IO notify port.
type moriMsg struct {
	Type       string          `json:"type"` // remote_blocks | push | push_failed | release
	TransferID string          `json:"transfer_id"`
	Instance   string          `json:"instance,omitempty"`
	Peer       *moriPeer       `json:"peer,omitempty"` // the sender's side channel
	EngineID   *string         `json:"remote_engine_id,omitempty"`
	BlockIDs   json.RawMessage `json:"remote_block_ids,omitempty"`
	PromptHash string          `json:"prompt_hash,omitempty"`
	PromptLen  int             `json:"prompt_len,omitempty"`
	RID        string          `json:"rid,omitempty"`
	FirstToken *transferToken  `json:"first_token,omitempty"`
	Reason     string          `json:"reason,omitempty"`
}

type moriReg struct {
	t *moriTable
	e *moriEntry
}

func (t *moriTable) begin(req *request, cfg Config) (prefillReg, *apiError) {
	const leg = "prefill"
	tid, _ := req.kv.str("transfer_id")
	if !cfg.Lax && (!req.ignoreEOS || len(req.stop) > 0 || len(req.stopIDs) > 0) {
		msg := "MoRI-IO prefill leg needs ignore_eos=true and no stop / stop_token_ids (otherwise an EOS or stop on the first token finishes with reason stop and no handoff is returned)"
		t.s.event(leg, req.rid, tid, "prefill_stop_conditions", msg)
		return nil, badRequest("%s", msg)
	}
	var target *moriPeer
	if cfg.MoRIIOMode == Write {
		p, err := t.s.resolvePeer(req, cfg, "decode")
		var ae *apiError
		var pe *paramsError
		switch {
		case errors.As(err, &ae):
			return nil, ae
		case errors.As(err, &pe):
			msg := "MoRI-IO WRITE prefill leg needs the decode's side channel: " + strings.TrimPrefix(pe.msg, "invalid kv_transfer_params: ")
			t.s.event(leg, req.rid, tid, "kv_params_invalid", msg)
			if !cfg.Lax {
				return nil, badRequest("%s", msg)
			}
		default:
			target = p
		}
	}
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
		return nil, badRequest("%s", msg)
	}
	if e == nil {
		e = &moriEntry{tid: tid, since: time.Now()}
		t.m[tid] = e
	} else if e.timer != nil {
		e.timer.Stop() // a decode's early remote_blocks: the prefill is here now
	}
	e.prefill, e.stage, e.rid, e.rank, e.engineID, e.target = true, stageComputing, req.rid, req.dpRank, t.s.moriEngineID(cfg), target
	t.s.event(leg, req.rid, tid, "registered", fmt.Sprintf("mode %s", cfg.MoRIIOMode))
	return &moriReg{t: t, e: e}, nil
}

func (g *moriReg) abort(reason string) {
	g.t.drop(g.e, "the prefill was aborted: "+reason)
}

// drop removes e (with reason) and tells a waiting WRITE decode.
func (t *moriTable) drop(e *moriEntry, reason string) {
	t.mu.Lock()
	if t.m[e.tid] != e {
		t.mu.Unlock()
		return
	}
	delete(t.m, e.tid)
	if e.timer != nil {
		e.timer.Stop()
	}
	t.gone.add(e.tid, reason)
	claim := e.claim
	t.mu.Unlock()
	if claim != nil {
		t.s.sendPushFailed(claim, reason)
	}
}

func (g *moriReg) finish(req *request, c *choice, cfg Config) (map[string]any, bool) {
	t, e := g.t, g.e
	if c.finish != "length" {
		t.drop(e, fmt.Sprintf("the prefill finished with finish_reason=%s, so no KV was held", c.finish))
		return nil, false
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.m[e.tid] != e {
		return nil, false // reset while the prefill ran
	}
	e.stage, e.hash, e.plen, e.first = stageIssued, common.HashTokens(c.prompt), len(c.prompt), tokenFromChoice(c)
	e.blocks = newBlockIDs(len(c.prompt), cfg)
	after := cfg.AbortRequestTimeout
	e.timer = time.AfterFunc(after, func() { t.expire(e, after) })
	t.s.event("prefill", req.rid, e.tid, "handoff_issued", "engine "+e.engineID)
	if cfg.MoRIIOMode == Write && e.claim != nil {
		if reason := claimMismatch(e, e.claim); reason != "" {
			claim := e.claim
			delete(t.m, e.tid)
			e.timer.Stop()
			t.gone.add(e.tid, reason)
			t.s.event("notify", e.rid, e.tid, "push_failed", reason)
			t.s.sendPushFailed(claim, reason)
		} else {
			t.startPushLocked(e, cfg)
		}
	}
	return map[string]any{
		"do_remote_prefill":     true,
		"do_remote_decode":      false,
		"remote_block_ids":      e.blocks,
		"remote_engine_id":      e.engineID,
		"remote_host":           cfg.MoRIIOHost,
		"remote_handshake_port": t.s.hsPort,
		"remote_notify_port":    t.s.notePort,
		"remote_dp_size":        cfg.DPSize,
		"tp_size":               cfg.TPSize,
		"transfer_id":           e.tid,
	}, true
}

func (t *moriTable) expire(e *moriEntry, after time.Duration) {
	t.mu.Lock()
	if t.m[e.tid] != e || e.stage == stagePushing {
		t.mu.Unlock()
		return
	}
	delete(t.m, e.tid)
	t.gone.add(e.tid, fmt.Sprintf("expired after %s", after))
	prefill := e.prefill
	t.mu.Unlock()
	if prefill {
		t.s.event("prefill", e.rid, e.tid, "orphan_transfer", "no decode claimed the transfer; blocks freed after the abort timeout")
	} else {
		t.s.event("notify", e.rid, e.tid, "orphan_remote_blocks", "a decode's remote_blocks waited for a prefill leg that never came")
	}
}

// claimMismatch checks a decode's remote_blocks against an issued handoff.
func claimMismatch(e *moriEntry, m *moriMsg) string {
	switch {
	case m.EngineID != nil && *m.EngineID != e.engineID:
		return fmt.Sprintf("remote_engine_id %q is not the prefill's engine %q", *m.EngineID, e.engineID)
	case len(m.BlockIDs) > 0 && !common.IsNull(m.BlockIDs) && !sameJSON(m.BlockIDs, e.blocks):
		return fmt.Sprintf("remote_block_ids %s differ from the blocks issued for transfer_id %s (%s)", compact(m.BlockIDs), e.tid, mustJSON(e.blocks))
	case m.PromptHash != hashString(e.hash) || m.PromptLen != e.plen:
		return fmt.Sprintf("KV mismatch: the decode's prompt (%d tokens, hash %s) is not the prefill's (%d tokens, hash %s)", m.PromptLen, m.PromptHash, e.plen, hashString(e.hash))
	}
	return ""
}

// claim handles a decode's remote_blocks (WRITE): the decode allocated its
// blocks and asks the prefill to write into them.
func (t *moriTable) claim(m *moriMsg) (int, string) {
	cfg := t.s.Config()
	if cfg.MoRIIOMode != Write {
		return http.StatusConflict, "mode mismatch: this prefill runs MoRI-IO in read mode; remote_blocks rejected"
	}
	if !cfg.Role.canPrefill() {
		return http.StatusConflict, fmt.Sprintf("this worker is %s: it holds no prefill KV", cfg.Role)
	}
	if m.Peer == nil || m.Instance == "" {
		return http.StatusBadRequest, "remote_blocks without the decode's side channel"
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.m[m.TransferID]
	if e == nil {
		if reason, gone := t.gone.get(m.TransferID); gone {
			return http.StatusGone, fmt.Sprintf("transfer_id %s: %s", m.TransferID, reason)
		}
		e = &moriEntry{tid: m.TransferID, stage: stageWaitingPrefill, rid: m.RID, claim: m, since: time.Now()}
		after := cfg.AbortRequestTimeout
		e.timer = time.AfterFunc(after, func() { t.expire(e, after) })
		t.m[m.TransferID] = e
		t.s.event("notify", m.RID, m.TransferID, "remote_blocks_early", "the decode's blocks arrived before the prefill leg")
		return http.StatusOK, ""
	}
	if e.claim != nil {
		return http.StatusConflict, fmt.Sprintf("transfer_id %s is already claimed by another decode (%s)", m.TransferID, e.claim.Peer)
	}
	if e.stage == stageIssued {
		if reason := claimMismatch(e, m); reason != "" {
			t.s.event("notify", e.rid, e.tid, "remote_blocks_rejected", reason)
			return http.StatusConflict, reason
		}
	}
	e.claim = m
	t.s.event("notify", e.rid, e.tid, "remote_blocks", "from "+m.Peer.String())
	if e.stage == stageIssued {
		t.startPushLocked(e, cfg)
	}
	return http.StatusOK, ""
}

func (t *moriTable) release(m *moriMsg) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if e := t.m[m.TransferID]; e != nil && e.claim != nil && e.claim.Instance == m.Instance && e.stage != stagePushing {
		e.claim = nil
		t.s.event("notify", e.rid, e.tid, "released", "the decode released its blocks")
	}
}

func (t *moriTable) startPushLocked(e *moriEntry, cfg Config) {
	e.stage = stagePushing
	if !t.s.goBackground(func(ctx context.Context) { t.push(ctx, e, cfg) }) {
		e.stage = stageIssued
	}
}

// push is the prefill's KV write into the decode named by the prefill leg.
func (t *moriTable) push(ctx context.Context, e *moriEntry, cfg Config) {
	if common.Sleep(ctx, cfg.TransferDelay) != nil {
		return
	}
	claim, target := e.claim, e.target
	var reason string
	if target == nil {
		reason = "the prefill leg's kv_transfer_params named no decode side channel (remote_host, remote_handshake_port, remote_notify_port)"
	} else {
		ictx, cancel := context.WithTimeout(ctx, 5*time.Second)
		info, err := t.s.moriInfo(ictx, *target)
		cancel()
		switch {
		case err != nil:
			reason = fmt.Sprintf("handshake with the decode at %s failed: %v", target, err)
		case info.Instance != claim.Instance:
			reason = fmt.Sprintf("the prefill leg names decode %s (engine %s) but remote_blocks came from %s", target, info.EngineID, claim.Peer)
		case info.NotifyPort != target.NotifyPort:
			reason = fmt.Sprintf("remote_notify_port %d is not the decode's notify port %d", target.NotifyPort, info.NotifyPort)
		}
	}
	if reason == "" {
		// The blocks are handed over now: a later claim sees the transfer gone.
		t.retire(e, "already written to a decode (one transfer per transfer_id)")
		msg := moriMsg{
			Type: "push", TransferID: e.tid, Instance: t.s.instance, EngineID: &e.engineID,
			PromptHash: hashString(e.hash), PromptLen: e.plen, RID: e.rid, FirstToken: toTransfer(e.first),
		}
		var res readResult
		pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		status, err := t.s.callJSON(pctx, http.MethodPost, target.notifyURL(), msg, &res)
		cancel()
		switch {
		case err != nil:
			reason = fmt.Sprintf("KV write to the decode at %s failed: %v", target, err)
		case status != http.StatusOK:
			reason = fmt.Sprintf("KV write to the decode at %s failed: %s", target, res.Reason)
		}
	}
	if reason != "" {
		t.retire(e, "its KV write failed: "+reason)
	}
	if reason == "" {
		t.s.event("prefill", e.rid, e.tid, "pushed", "KV written to "+target.String())
		return
	}
	t.s.event("prefill", e.rid, e.tid, "push_failed", reason)
	t.s.sendPushFailed(claim, reason)
}

// retire removes e from the table (if still there) and remembers why.
func (t *moriTable) retire(e *moriEntry, reason string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.m[e.tid] == e {
		delete(t.m, e.tid)
		e.timer.Stop()
	}
	if t.m[e.tid] == nil {
		t.gone.add(e.tid, reason)
	}
}

// sendPushFailed tells the decode that sent claim (at its own side channel)
// that no KV will come, so it fails at once instead of timing out.
func (s *Server) sendPushFailed(claim *moriMsg, reason string) {
	if claim == nil || claim.Peer == nil {
		return
	}
	peer := *claim.Peer
	tid := claim.TransferID
	s.goBackground(func(ctx context.Context) {
		ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		_, _ = s.callJSON(ctx, http.MethodPost, peer.notifyURL(), moriMsg{Type: "push_failed", TransferID: tid, Instance: s.instance, Reason: reason}, nil)
	})
}

// read is a READ-mode decode's pull of an issued handoff.
func (t *moriTable) read(w http.ResponseWriter, rr *readRequest) {
	cfg := t.s.Config()
	if cfg.MoRIIOMode != Read {
		readFail(w, http.StatusConflict, "mode mismatch: this prefill runs MoRI-IO in write mode")
		return
	}
	t.mu.Lock()
	e := t.m[rr.TransferID]
	if e == nil || e.stage != stageIssued {
		reason, gone := t.gone.get(rr.TransferID)
		t.mu.Unlock()
		switch {
		case e == nil && gone:
			readFail(w, http.StatusGone, "transfer_id %s: %s", rr.TransferID, reason)
		case e != nil:
			readFail(w, http.StatusNotFound, "no prefill blocks for transfer_id %s (the prefill has not finished; READ mode needs the decode after the prefill answered)", rr.TransferID)
		default:
			readFail(w, http.StatusNotFound, "no prefill blocks for transfer_id %s", rr.TransferID)
		}
		return
	}
	m := &moriMsg{EngineID: &rr.EngineID, BlockIDs: rr.BlockIDs, PromptHash: rr.PromptHash, PromptLen: rr.PromptLen}
	if reason := claimMismatch(e, m); reason != "" {
		t.mu.Unlock()
		t.s.event("side_channel", e.rid, e.tid, "read_rejected", reason)
		readFail(w, http.StatusConflict, "%s", reason)
		return
	}
	delete(t.m, e.tid)
	e.timer.Stop()
	t.gone.add(e.tid, "already consumed by a decode (one transfer per transfer_id)")
	t.mu.Unlock()
	t.s.event("prefill", e.rid, e.tid, "handoff_consumed", "read by "+rr.Decode)
	readOK(w, e.first)
}

// ---- decode-side waits (WRITE) ----

type moriWaits struct {
	mu sync.Mutex
	m  map[string]chan moriMsg
}

func newMoriWaits() *moriWaits { return &moriWaits{m: map[string]chan moriMsg{}} }

func (w *moriWaits) register(tid string) (chan moriMsg, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if _, dup := w.m[tid]; dup {
		return nil, false
	}
	ch := make(chan moriMsg, 1)
	w.m[tid] = ch
	return ch, true
}

func (w *moriWaits) unregister(tid string, ch chan moriMsg) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.m[tid] == ch {
		delete(w.m, tid)
	}
}

func (w *moriWaits) deliver(m moriMsg) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	ch, ok := w.m[m.TransferID]
	if !ok {
		return false
	}
	delete(w.m, m.TransferID)
	ch <- m
	return true
}

func (w *moriWaits) snapshot() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := make([]string, 0, len(w.m))
	for tid := range w.m {
		out = append(out, tid)
	}
	sort.Strings(out)
	return out
}

// ---- side-channel servers ----

// moriInfoResp is GET /_fake/moriio/info on the handshake port.
type moriInfoResp struct {
	EngineID      string     `json:"engine_id"`
	Instance      string     `json:"instance"`
	Role          Role       `json:"role"`
	Mode          MoRIIOMode `json:"mode"`
	Host          string     `json:"host"`
	HandshakePort int        `json:"handshake_port"`
	NotifyPort    int        `json:"notify_port"`
	TPSize        int        `json:"tp_size"`
	DPSize        int        `json:"dp_size"`
}

func (s *Server) moriHandshakeMux() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /_fake/moriio/info", func(w http.ResponseWriter, _ *http.Request) {
		cfg := s.Config()
		common.WriteJSON(w, http.StatusOK, moriInfoResp{
			EngineID: s.moriEngineID(cfg), Instance: s.instance, Role: cfg.Role, Mode: cfg.MoRIIOMode,
			Host: cfg.MoRIIOHost, HandshakePort: s.hsPort, NotifyPort: s.notePort, TPSize: cfg.TPSize, DPSize: cfg.DPSize,
		})
	})
	mux.HandleFunc("POST /_fake/moriio/read", func(w http.ResponseWriter, r *http.Request) {
		var rr readRequest
		if err := decodeBody(r, &rr); err != nil || rr.TransferID == "" {
			readFail(w, http.StatusBadRequest, "bad read request")
			return
		}
		s.mori.read(w, &rr)
	})
	return mux
}

func (s *Server) moriNotifyMux() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /_fake/moriio/notify", func(w http.ResponseWriter, r *http.Request) {
		var m moriMsg
		if err := decodeBody(r, &m); err != nil || m.TransferID == "" {
			readFail(w, http.StatusBadRequest, "bad notify message")
			return
		}
		switch m.Type {
		case "remote_blocks":
			status, reason := s.mori.claim(&m)
			if status != http.StatusOK {
				readFail(w, status, "%s", reason)
				return
			}
			common.WriteJSON(w, http.StatusOK, readResult{Status: "ok"})
		case "push", "push_failed":
			if !s.moriWait.deliver(m) {
				readFail(w, http.StatusNotFound, "no decode on this worker is waiting for transfer_id %s", m.TransferID)
				return
			}
			common.WriteJSON(w, http.StatusOK, readResult{Status: "ok"})
		case "release":
			s.mori.release(&m)
			common.WriteJSON(w, http.StatusOK, readResult{Status: "ok"})
		default:
			readFail(w, http.StatusBadRequest, "unknown notify type %q", m.Type)
		}
	})
	return mux
}

func (s *Server) moriInfo(ctx context.Context, p moriPeer) (*moriInfoResp, error) {
	var info moriInfoResp
	status, err := s.callJSON(ctx, http.MethodGet, p.handshakeURL("/_fake/moriio/info"), nil, &info)
	if err != nil {
		return nil, err
	}
	if status != http.StatusOK || info.Instance == "" {
		return nil, fmt.Errorf("%s answered %d: not a MoRI-IO handshake port", p.handshakeURL(""), status)
	}
	return &info, nil
}

// ---- decode side ----

func (s *Server) loadMoRIIO(ctx context.Context, req *request, cfg Config) (*common.Token, error) {
	const leg = "decode"
	kv := req.kv
	tid, _ := kv.str("transfer_id")
	peer, err := s.resolvePeer(req, cfg, "prefill")
	if err != nil {
		return nil, err
	}
	engineID, hasEngine := kv.str("remote_engine_id")
	hasEngine = hasEngine && engineID != ""
	blocks := kv["remote_block_ids"]
	if cfg.MoRIIOMode == Read && (!nonEmptyList(blocks) || !hasEngine) {
		return nil, &paramsError{msg: "invalid kv_transfer_params: MoRI-IO READ needs remote_block_ids and remote_engine_id (relay the prefill's handoff verbatim)"}
	}
	ictx, cancel := context.WithTimeout(ctx, 5*time.Second)
	info, ierr := s.moriInfo(ictx, *peer)
	cancel()
	if ctx.Err() != nil {
		return nil, errClientGone
	}
	var reason string
	switch {
	case ierr != nil:
		reason = fmt.Sprintf("handshake with the prefill at %s failed: %v", peer, ierr)
	case info.Mode != cfg.MoRIIOMode:
		reason = fmt.Sprintf("mode mismatch: the prefill at %s runs %s mode, this decode %s", peer, info.Mode, cfg.MoRIIOMode)
	case !info.Role.canPrefill():
		reason = fmt.Sprintf("the peer at %s is %s, not a prefill", peer, info.Role)
	case info.NotifyPort != peer.NotifyPort:
		reason = fmt.Sprintf("remote_notify_port %d is not the prefill's notify port %d", peer.NotifyPort, info.NotifyPort)
	case hasEngine && info.EngineID != engineID:
		reason = fmt.Sprintf("remote_engine_id %q is not the engine at %s (%q)", engineID, peer, info.EngineID)
	}
	if reason != "" {
		return nil, &loadError{id: tid, reason: reason}
	}
	p := first(req.prompts)
	hash := hashString(common.HashTokens(p))
	if cfg.MoRIIOMode == Read {
		rr := readRequest{EngineID: engineID, TransferID: tid, BlockIDs: blocks, PromptHash: hash, PromptLen: len(p), RID: req.rid, Decode: s.url}
		rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		tok, reason := s.read(rctx, peer.handshakeURL("/_fake/moriio/read"), rr)
		if ctx.Err() != nil {
			return nil, errClientGone
		}
		if tok == nil {
			return nil, &loadError{id: tid, reason: reason}
		}
		return tok, nil
	}

	ch, ok := s.moriWait.register(tid)
	if !ok {
		s.event(leg, req.rid, tid, "duplicate_transfer_id", "already waiting for a KV write on this decode")
		return nil, badRequest("transfer_id %s is already waiting for a KV write on this decode", tid)
	}
	defer s.moriWait.unregister(tid, ch)
	msg := moriMsg{
		Type: "remote_blocks", TransferID: tid, Instance: s.instance,
		Peer:       &moriPeer{Host: cfg.MoRIIOHost, HandshakePort: s.hsPort, NotifyPort: s.notePort},
		BlockIDs:   blocks,
		PromptHash: hash, PromptLen: len(p), RID: req.rid,
	}
	if hasEngine {
		msg.EngineID = &engineID
	}
	var res readResult
	nctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	status, err := s.callJSON(nctx, http.MethodPost, peer.notifyURL(), msg, &res)
	cancel()
	if ctx.Err() != nil {
		return nil, errClientGone
	}
	switch {
	case err != nil:
		return nil, &loadError{id: tid, reason: fmt.Sprintf("notify to the prefill at %s failed: %v", peer, err)}
	case status != http.StatusOK:
		return nil, &loadError{id: tid, reason: res.Reason}
	}
	s.event(leg, req.rid, tid, "waiting_push", "blocks allocated; waiting for the prefill's KV write")
	timer := time.NewTimer(cfg.TransferTimeout)
	defer timer.Stop()
	select {
	case m := <-ch:
		switch {
		case m.Type == "push_failed":
			return nil, &loadError{id: tid, reason: m.Reason}
		case m.PromptHash != hash || m.PromptLen != len(p) || m.FirstToken == nil:
			return nil, &loadError{id: tid, reason: "KV mismatch: the pushed KV is for another prompt"}
		}
		return m.FirstToken.token(), nil
	case <-timer.C:
		return nil, &loadError{id: tid, reason: fmt.Sprintf("timed out after %s waiting for the prefill's KV write", cfg.TransferTimeout)}
	case <-ctx.Done():
		s.event(leg, req.rid, tid, "leaked_decode_blocks", "the decode was aborted before the prefill's push; its blocks stay allocated")
		return nil, errClientGone
	}
}
