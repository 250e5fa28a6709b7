package vllm

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"

	"github.com/smg-project/smg-extproc/pkg/fake/common"
)

type legKind int

const (
	legPlain legKind = iota
	legPrefill
	legDecode
)

func (l legKind) String() string {
	switch l {
	case legPrefill:
		return "prefill"
	case legDecode:
		return "decode"
	}
	return "plain"
}

// paramsError is an invalid kv_transfer_params on a decode leg: vLLM logs
// "Got invalid KVTransferParams … will not utilize KVTransfer" and
// recomputes (lax); the strict fake answers 400. laxStatus != 0 makes the
// lax answer an error too (NIXL's empty remote_block_ids assertion).
type paramsError struct {
	msg       string
	laxStatus int
	laxMsg    string
}

func (e *paramsError) Error() string { return e.msg }

// loadError is a failed KV load, handled per kv_load_failure_policy.
type loadError struct {
	id     string // remote_request_id or transfer_id
	reason string
}

func (e *loadError) Error() string { return fmt.Sprintf("KV load failed for %s: %s", e.id, e.reason) }

// prefillReg is a connector's bookkeeping for one prefill leg.
type prefillReg interface {
	// finish registers the handoff when c finished "length" (the blocks are
	// held for a decode) and returns the kv_transfer_params to return (nil:
	// null), plus whether a handoff is held.
	finish(req *request, c *choice, cfg Config) (map[string]any, bool)
	// abort ends the registration when the client left before the answer.
	abort(reason string)
}

func (s *Server) engine(rt route) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		body, readErr := s.requests.ReadRecord(r)
		s.inFlight.Add(1)
		defer s.inFlight.Add(-1)

		if r.Method != http.MethodPost {
			common.WriteMethodNotAllowed(w)
			return
		}
		if readErr != nil {
			writeErr(w, rt, errf(common.BodyErrorStatus(readErr), "%s", readErr.Error()))
			return
		}
		cfg := s.Config()
		if reason := s.Dead(); reason != "" {
			s.event("engine", "", "", "engine_dead", reason)
			writeErr(w, rt, errf(500, "EngineCore is dead (%s); reset the fake (POST /_fake/reset)", reason))
			return
		}
		if cfg.FailStatus != 0 {
			s.event("engine", "", "", "fault_fail", fmt.Sprintf("%s -> %d", rt, cfg.FailStatus))
			common.WriteFailBody(w, cfg.FailStatus, cfg.FailBody)
			return
		}
		if cfg.Hang {
			s.event("engine", "", "", "fault_hang", rt.String())
			<-r.Context().Done()
			return
		}
		req, e := parseRequest(rt, r, body, cfg)
		if e != nil {
			s.event("engine", r.Header.Get("X-Request-Id"), "", "bad_request", e.msg)
			writeErr(w, rt, e)
			return
		}
		leg, e := s.classify(req, cfg)
		if e != nil {
			writeErr(w, rt, e)
			return
		}
		switch leg {
		case legPrefill:
			e = s.servePrefill(w, r, req, cfg)
		case legDecode:
			e = s.serveDecode(w, r, req, cfg)
		default:
			e = s.servePlain(w, r, req, cfg)
		}
		if e != nil && e != errClientGone && r.Context().Err() == nil {
			writeErr(w, rt, e)
		}
	}
}

// classify decides which leg a request is from its kv_transfer_params.
func (s *Server) classify(req *request, cfg Config) (legKind, *apiError) {
	if req.kvIgnored {
		s.event("plain", req.rid, "", "kv_params_ignored", req.route.String()+" does not declare kv_transfer_params (ResponsesRequest); the field is ignored")
		return legPlain, nil
	}
	if cfg.Connector == None {
		if req.kv != nil {
			s.event("plain", req.rid, "", "kv_params_ignored", "no KV connector configured")
		}
		return legPlain, nil
	}
	if len(req.kv) == 0 {
		return legPlain, nil
	}
	if cfg.Connector == MoRIIO {
		if e := s.moriCheckParams(req); e != nil {
			return legPlain, e
		}
	}
	remoteDecode, remotePrefill := req.kv.flag("do_remote_decode"), req.kv.flag("do_remote_prefill")
	switch {
	case remoteDecode && remotePrefill:
		if !cfg.Lax {
			s.event("engine", req.rid, "", "kv_params_invalid", "both do_remote_decode and do_remote_prefill")
			return legPlain, badRequest("invalid kv_transfer_params: do_remote_decode and do_remote_prefill are both true")
		}
		return legDecode, nil
	case remoteDecode:
		return legPrefill, nil
	case remotePrefill:
		return legDecode, nil
	}
	s.event("plain", req.rid, "", "kv_params_ignored", "kv_transfer_params has neither do_remote_decode nor do_remote_prefill")
	return legPlain, nil
}

func (s *Server) servePlain(w http.ResponseWriter, r *http.Request, req *request, cfg Config) *apiError {
	ctx := r.Context()
	// A decode-capable worker with a connector that computes the prompt
	// itself "recomputed"; a plain server (or a producer) has no KV to load.
	kv := kvNone
	if cfg.Connector != None && cfg.Role.canDecode() {
		kv = kvRecomputed
	}
	if cfg.Connector == MoRIIO && cfg.Role == Consumer && !cfg.Lax {
		msg := "MoRI-IO decode requires kv_transfer_params with do_remote_prefill and transfer_id (a MoRI-IO decode never recomputes)"
		s.event("decode", req.rid, "", "kv_params_missing", msg)
		return badRequest("%s", msg)
	}
	if common.Sleep(ctx, cfg.PrefillDelay) != nil {
		return errClientGone
	}
	o := &outcome{choices: generateAll(req, cfg, nil), kv: kv}
	if kv == kvRecomputed {
		s.event("decode", req.rid, "", "recomputed", "no usable kv_transfer_params: the prompt was computed locally")
	} else {
		s.event("plain", req.rid, "", "generated", "")
	}
	return s.finishRender(ctx, w, req, cfg, o, true)
}

func (s *Server) finishRender(ctx context.Context, w http.ResponseWriter, req *request, cfg Config, o *outcome, delay bool) *apiError {
	if err := newResponder(s, w, req, cfg, delay).render(ctx, o); err != nil {
		return errClientGone
	}
	s.success.Add(1)
	return nil
}

// ---- prefill leg ----

func (s *Server) servePrefill(w http.ResponseWriter, r *http.Request, req *request, cfg Config) *apiError {
	const leg = "prefill"
	ctx := r.Context()
	tid, _ := req.kv.str("transfer_id")
	if !cfg.Role.canPrefill() {
		msg := fmt.Sprintf("kv_role %s cannot serve a prefill leg (kv_transfer_params.do_remote_decode=true)", cfg.Role)
		s.event(leg, req.rid, tid, "role_mismatch", msg)
		if !cfg.Lax {
			return badRequest("%s", msg)
		}
	}
	if ok, why := req.single(); !ok {
		msg := fmt.Sprintf("PD prefill leg must be single-sequence (got %s)", why)
		s.event(leg, req.rid, tid, "prefill_multi_sequence", msg)
		if !cfg.Lax {
			return badRequest("%s", msg)
		}
	}
	if req.capField == "" || req.maxTokens != 1 {
		got := "no output cap"
		if req.capField != "" {
			got = fmt.Sprintf("%s=%d", req.capField, req.maxTokens)
		}
		if !cfg.Lax {
			msg := fmt.Sprintf("PD prefill leg must be capped at one output token (got %s)", got)
			s.event(leg, req.rid, tid, "prefill_uncapped", msg)
			return badRequest("%s", msg)
		}
	}
	if req.stream {
		s.event(leg, req.rid, tid, "prefill_streamed", "stream chunks carry no kv_transfer_params: the handoff is lost")
	}
	var (
		reg prefillReg
		e   *apiError
	)
	switch cfg.Connector {
	case Nixl:
		reg = &nixlReg{s: s, rank: req.dpRank}
	case Mooncake:
		reg, e = s.mc.begin(req, cfg)
	case MoRIIO:
		reg, e = s.mori.begin(req, cfg)
	}
	if e != nil {
		return e
	}
	if common.Sleep(ctx, cfg.PrefillDelay) != nil {
		reg.abort("client disconnected during the prefill")
		s.event(leg, req.rid, tid, "aborted", "client disconnected during the prefill")
		return errClientGone
	}
	o := &outcome{choices: generateAll(req, cfg, nil), handoffS: "none"}
	c0 := &o.choices[0]
	params, held := reg.finish(req, c0, cfg)
	switch {
	case held && req.stream:
		o.handoffS = "issued"
	case held:
		o.handoff, o.handoffS = params, "issued"
	default:
		s.event(leg, req.rid, tid, "no_handoff", fmt.Sprintf("finish_reason=%s (a handoff needs finish_reason length)", c0.finish))
	}
	if c0.completion > 1 {
		s.event(leg, req.rid, tid, "prefill_generated_gt_1", fmt.Sprintf("the prefill generated %d tokens", c0.completion))
	}
	if e := s.finishRender(ctx, w, req, cfg, o, false); e != nil {
		return e
	}
	return nil
}

// ---- decode leg ----

func (s *Server) serveDecode(w http.ResponseWriter, r *http.Request, req *request, cfg Config) *apiError {
	const leg = "decode"
	ctx := r.Context()
	tid, _ := req.kv.str("transfer_id")
	if !cfg.Role.canDecode() {
		msg := fmt.Sprintf("kv_role %s cannot serve a decode leg (kv_transfer_params.do_remote_prefill=true)", cfg.Role)
		s.event(leg, req.rid, tid, "role_mismatch", msg)
		if !cfg.Lax {
			return badRequest("%s", msg)
		}
	}
	if ok, why := req.single(); !ok {
		msg := fmt.Sprintf("PD decode leg must be single-sequence (got %s)", why)
		s.event(leg, req.rid, tid, "decode_multi_sequence", msg)
		if !cfg.Lax {
			return badRequest("%s", msg)
		}
	}
	var (
		first *common.Token
		err   error
	)
	switch cfg.Connector {
	case Nixl:
		first, err = s.loadNixl(ctx, req, cfg)
	case Mooncake:
		first, err = s.loadMooncake(ctx, req, cfg)
	case MoRIIO:
		first, err = s.loadMoRIIO(ctx, req, cfg)
	}
	kv := kvTransferred
	var pe *paramsError
	var le *loadError
	var ae *apiError
	switch {
	case err == nil:
		s.event(leg, req.rid, tid, "transferred", fmt.Sprintf("first token %q", first.Word))
		if common.Sleep(ctx, cfg.TransferDelay) != nil {
			return errClientGone
		}
	case errors.As(err, &ae):
		return ae
	case errors.As(err, &pe):
		s.event(leg, req.rid, tid, "kv_params_invalid", pe.msg)
		switch {
		case !cfg.Lax:
			return badRequest("%s", pe.msg)
		case pe.laxStatus != 0:
			return errf(pe.laxStatus, "%s", pe.laxMsg)
		}
		kv = kvRecomputed
	case errors.As(err, &le):
		s.loadFail.Add(1)
		s.event(leg, req.rid, tid, "kv_load_failed", le.Error())
		if cfg.KVLoadFailurePolicy != PolicyRecompute {
			return errf(500, "%s", le.Error())
		}
		kv = kvRecomputed
	default:
		return errf(500, "%s", err.Error())
	}
	if kv == kvRecomputed {
		s.event(leg, req.rid, tid, "recomputed", "the decode computes the prompt itself")
		if common.Sleep(ctx, cfg.PrefillDelay) != nil {
			return errClientGone
		}
		first = nil
	}
	o := &outcome{choices: generateAll(req, cfg, first), kv: kv}
	return s.finishRender(ctx, w, req, cfg, o, true)
}

// tokenFromChoice is the first sampled token of a finished prefill (length
// finish guarantees one).
func tokenFromChoice(c *choice) common.Token {
	if len(c.tokens) > 0 {
		return c.tokens[0]
	}
	return common.NewGenerator(common.HashTokens(c.prompt), 0).Next()
}

func hashString(h uint64) string { return fmt.Sprintf("%016x", h) }

func joinKeys(keys []string) string { return strings.Join(keys, ", ") }
