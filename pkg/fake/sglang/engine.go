package sglang

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/smg-project/smg-extproc/pkg/fake/common"
)

// HeaderFakeKV is set on decode responses: transferred, recomputed or none.
const HeaderFakeKV = "X-Fake-KV"

// outcome is the result of one expanded request item.
type outcome struct {
	item   *item
	tokens []common.Token
	kv     string // transferred | recomputed | none
	cached int
}

// errClientGone marks a request whose client went away (nothing to answer).
var errClientGone = &apiError{status: 499, kind: errAbort, msg: "client disconnected"}

func (s *Server) engine(rt route) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		body, readErr := s.requests.ReadRecord(r)
		s.inFlight.Add(1)
		defer s.inFlight.Add(-1)
		cfg := s.Config()
		leg := string(cfg.Mode)

		if r.Method != http.MethodPost && (rt != routeGenerate || r.Method != http.MethodPut) {
			common.WriteMethodNotAllowed(w)
			return
		}
		if readErr != nil {
			status := common.BodyErrorStatus(readErr)
			common.WriteJSON(w, status, common.ObjectError(status, http.StatusText(status), readErr.Error()))
			return
		}
		if cfg.FailStatus != 0 {
			s.event(leg, "", nil, "fault_fail", fmt.Sprintf("%s -> %d", rt, cfg.FailStatus))
			common.WriteFailBody(w, cfg.FailStatus, cfg.FailBody)
			return
		}
		if cfg.Hang {
			s.event(leg, "", nil, "fault_hang", rt.String())
			<-r.Context().Done()
			return
		}
		if e := checkContentType(r.Header.Get("Content-Type")); e != nil {
			s.event(leg, "", nil, "bad_request", e.msg)
			writeErr(w, rt, e)
			return
		}
		rid := r.Header.Get("X-Request-Id")
		if rid == "" {
			rid = s.newRID()
		}
		req, e := parseRequest(rt, body, cfg, rid)
		if e != nil {
			s.event(leg, rid, nil, "bad_request", e.msg)
			writeErr(w, rt, e)
			return
		}
		if rt == routeCountTokens {
			s.countTokens(w, req, cfg)
			return
		}
		s.serveGenerate(w, r, req, cfg)
	}
}

func (s *Server) countTokens(w http.ResponseWriter, req *request, cfg Config) {
	leg := string(cfg.Mode)
	if req.hasAnyBoots && !cfg.Lax {
		e := abortErr(400, "bootstrap fields are not accepted on /v1/messages/count_tokens: token counting goes to one prefill worker without bootstrap_host/bootstrap_port/bootstrap_room")
		s.event(leg, req.rid, nil, "count_tokens_rejected", e.msg)
		writeErr(w, routeCountTokens, e)
		return
	}
	s.event(leg, req.rid, nil, "count_tokens", "")
	common.WriteJSON(w, http.StatusOK, map[string]int{"input_tokens": len(req.prompts[0])})
}

func (s *Server) serveGenerate(w http.ResponseWriter, r *http.Request, req *request, cfg Config) {
	ctx := r.Context()
	leg := string(cfg.Mode)
	if cfg.Mode != Null {
		if e := checkRooms(req, cfg.Lax); e != nil {
			what := "bad_request"
			switch {
			case strings.HasPrefix(e.msg, "duplicate"):
				what = "duplicate_room"
			case strings.HasPrefix(e.msg, "Invalid request"):
				what = "missing_room"
			}
			s.event(leg, req.rid, nil, what, e.msg)
			writeErr(w, req.route, e)
			return
		}
	}
	p := newResponder(s, w, req, cfg)
	if req.stream && (cfg.EarlyStreamHead || (cfg.Mode == Prefill && cfg.HoldBodyOpen > 0)) {
		if cfg.Mode == Decode {
			p.kv = "transferred"
			if allHealth(req.items) {
				p.kv = "none"
			}
		}
		p.startStream()
	}

	var outs []outcome
	var e *apiError
	switch cfg.Mode {
	case Prefill:
		outs, e = s.runPrefill(ctx, req, cfg)
	case Decode:
		outs, e = s.runDecode(ctx, req, cfg)
	default:
		if err := common.Sleep(ctx, cfg.PrefillDelay); err != nil {
			return
		}
		outs = make([]outcome, len(req.items))
		for i := range req.items {
			outs[i] = localOutcome(&req.items[i], req.maxTokens, "")
		}
	}
	if ctx.Err() != nil || e == errClientGone {
		return
	}
	if e != nil {
		p.fail(e)
		return
	}
	if cfg.Mode == Decode && !p.headSent() {
		p.kv = kvHeader(outs)
	}
	if err := p.render(ctx, outs); err != nil {
		return
	}
	if cfg.Mode == Prefill && cfg.HoldBodyOpen > 0 {
		p.flush()
		if err := common.Sleep(ctx, cfg.HoldBodyOpen); err != nil {
			s.event(leg, req.rid, nil, "client_closed_early", fmt.Sprintf("prefill response closed by the client during hold_body_open_ms=%d", cfg.HoldBodyOpen.Milliseconds()))
		}
	}
}

func allHealth(items []item) bool {
	for i := range items {
		if !items[i].healthForm {
			return false
		}
	}
	return true
}

func kvHeader(outs []outcome) string {
	kv := "none"
	for _, o := range outs {
		switch o.kv {
		case "recomputed":
			return "recomputed"
		case "transferred":
			kv = "transferred"
		}
	}
	return kv
}

func localOutcome(it *item, maxTokens int, kv string) outcome {
	return outcome{item: it, tokens: common.Generate(it.hash, it.sample, maxTokens), kv: kv}
}

// runItems runs fn for every item concurrently; the first failure cancels
// the others and is returned.
func runItems(ctx context.Context, items []item, fn func(context.Context, int) (outcome, *apiError)) ([]outcome, *apiError) {
	outs := make([]outcome, len(items))
	if len(items) == 1 {
		o, e := fn(ctx, 0)
		outs[0] = o
		return outs, e
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var (
		wg    sync.WaitGroup
		once  sync.Once
		first *apiError
	)
	for i := range items {
		wg.Add(1)
		go func() {
			defer wg.Done()
			o, e := fn(ctx, i)
			outs[i] = o
			if e != nil {
				once.Do(func() { first = e; cancel() })
			}
		}()
	}
	wg.Wait()
	return outs, first
}

func hashString(h uint64) string { return fmt.Sprintf("%016x", h) }

func secs(d time.Duration) string { return fmt.Sprintf("%.1fs", d.Seconds()) }

// ---- prefill ----

func prefillFailed(it *item, reason string) *apiError {
	return abortErr(500, "Prefill transfer failed for request rank=0 req.rid='%s' req.bootstrap_room=%d with exception KVTransferError(bootstrap_room=%d): %s",
		it.rid, it.room, it.room, reason)
}

func (s *Server) runPrefill(ctx context.Context, req *request, cfg Config) ([]outcome, *apiError) {
	entries, dup := s.rooms.registerPrefill(req.items, cfg.Lax)
	if dup != nil {
		e := abortErr(400, "duplicate bootstrap_room %d", *dup)
		s.event("prefill", req.rid, common.RoomPtr(*dup), "duplicate_room", "room already pending on this worker")
		return nil, e
	}
	return runItems(ctx, req.items, func(ctx context.Context, i int) (outcome, *apiError) {
		return s.prefillItem(ctx, req, &req.items[i], entries[i], cfg)
	})
}

func (s *Server) prefillItem(ctx context.Context, req *request, it *item, e *roomEntry, cfg Config) (outcome, *apiError) {
	const leg = "prefill"
	room := common.RoomPtr(it.room)
	if it.healthForm {
		if err := common.Sleep(ctx, cfg.PrefillDelay); err != nil {
			return outcome{}, errClientGone
		}
		return localOutcome(it, 1, "none"), nil
	}
	if it.stall {
		s.event(leg, it.rid, room, "stalled_duplicate", "lax: duplicate room waits for the bootstrap timeout")
		if err := common.Sleep(ctx, cfg.BootstrapTimeout); err != nil {
			return outcome{}, errClientGone
		}
		s.bootstrapFailed.Add(1)
		return outcome{}, prefillFailed(it, fmt.Sprintf("Request %d timed out after %s in KVPoll.Bootstrapping", it.room, secs(cfg.BootstrapTimeout)))
	}
	s.event(leg, it.rid, room, "registered", "")
	if err := common.Sleep(ctx, cfg.PrefillDelay); err != nil {
		s.rooms.fail(e, "Prefill request aborted (client disconnected).")
		s.event(leg, it.rid, room, "aborted", "client disconnected")
		return outcome{}, errClientGone
	}
	first := common.NewGenerator(it.hash, it.sample).Next()

	timer := time.NewTimer(time.Until(e.since.Add(cfg.BootstrapTimeout)))
	defer timer.Stop()
	select {
	case <-e.joined:
	case <-e.aborted:
		s.transferFailed.Add(1)
		s.event(leg, it.rid, room, "aborted", e.abortMsg)
		return outcome{}, prefillFailed(it, e.abortMsg)
	case <-timer.C:
		reason := fmt.Sprintf("Request %d timed out after %s in KVPoll.Bootstrapping", it.room, secs(cfg.BootstrapTimeout))
		s.rooms.fail(e, reason)
		s.bootstrapFailed.Add(1)
		s.event(leg, it.rid, room, "bootstrap_timeout", reason)
		return outcome{}, prefillFailed(it, reason)
	case <-ctx.Done():
		s.rooms.fail(e, "Prefill request aborted (client disconnected).")
		s.event(leg, it.rid, room, "aborted", "client disconnected before the decode joined")
		return outcome{}, errClientGone
	}
	s.event(leg, it.rid, room, "joined", e.join.DecodeID)

	if cfg.TransferDelay > 0 {
		t := time.NewTimer(cfg.TransferDelay)
		select {
		case <-t.C:
		case <-e.aborted:
			t.Stop()
			s.transferFailed.Add(1)
			s.event(leg, it.rid, room, "aborted", e.abortMsg)
			return outcome{}, prefillFailed(it, e.abortMsg)
		case <-ctx.Done():
			t.Stop()
			s.rooms.fail(e, "Prefill request aborted (client disconnected).")
			s.event(leg, it.rid, room, "aborted", "client disconnected during the transfer")
			return outcome{}, errClientGone
		}
	}
	res := &transferResult{
		Status: "transferred", Room: it.room, PrefillRID: it.rid,
		PromptTokensHash: hashString(it.hash), PromptLen: len(it.tokens),
		FirstTokenID: first.ID, FirstTokenWord: first.Word, FirstTokenLogprob: first.Logprob,
	}
	if !s.rooms.complete(e, res) {
		s.transferFailed.Add(1)
		s.event(leg, it.rid, room, "aborted", e.abortMsg)
		return outcome{}, prefillFailed(it, e.abortMsg)
	}
	s.event(leg, it.rid, room, "transferred", e.join.DecodeID)
	return outcome{item: it, tokens: []common.Token{first}, kv: "transferred"}, nil
}

// ---- decode ----

func (s *Server) runDecode(ctx context.Context, req *request, cfg Config) ([]outcome, *apiError) {
	if dup := s.dRooms.register(req.items, cfg.Lax); dup != nil {
		s.event("decode", req.rid, common.RoomPtr(*dup), "duplicate_room", "room already pending on this worker")
		return nil, abortErr(400, "duplicate bootstrap_room %d", *dup)
	}
	defer s.dRooms.release(req.items)
	return runItems(ctx, req.items, func(ctx context.Context, i int) (outcome, *apiError) {
		return s.decodeItem(ctx, req, &req.items[i], cfg)
	})
}
