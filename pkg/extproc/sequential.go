package extproc

import (
	"context"
	"strings"
	"time"

	"github.com/smg-project/smg-extproc/pkg/apierr"
	"github.com/smg-project/smg-extproc/pkg/pairing"
	"github.com/smg-project/smg-extproc/pkg/pd"
	"github.com/smg-project/smg-extproc/pkg/workers"
)

// sequentialPair reports whether a pair takes vLLM's sequential dispatch: a
// vLLM prefill, or any MoRI-IO decode (which never recomputes, so it always
// gets the validated MoRI-IO path).
func sequentialPair(p pairing.Pair) bool {
	return p.Prefill.Runtime == "vllm" || p.Decode.KVConnector == pd.MoRIIOConnector
}

func vllmWorker(w *workers.Worker) pd.VLLMWorker {
	return pd.VLLMWorker{URL: w.URL, KVConnector: w.KVConnector, KVEngineID: w.KVEngineID,
		BootstrapHost: w.BootstrapHost, BootstrapPort: w.BootstrapPort, DPRank: w.DPRank, DPSize: w.DPSize, Labels: w.Labels}
}

// sequential runs the vLLM handoff: a one-token prefill, then the decode with
// the prefill's (or a minted) kv_transfer_params. The decode is released to
// Envoy only after the prefill returns — except under MoRI-IO concurrent
// WRITE, where both go at once and the decode's answer waits for a valid handoff.
func (x *exchange) sequential(req *pd.Request) error {
	d := x.s.d
	pair := x.pair
	x.seq = true
	tid, err := pd.MintTransferID()
	if err != nil {
		return x.reject(apierr.Wrap(err, 500, apierr.CodeInternal, "Failed to mint transfer id"))
	}
	var xrids []string
	for k, v := range x.reqHdr {
		if k == "x-request-id" || strings.HasPrefix(k, "x-request-id-") {
			xrids = append(xrids, v)
		}
	}
	plan, err := pd.BuildVLLMLegs(req, pd.VLLMAttempt{Prefill: vllmWorker(pair.Prefill), Decode: vllmWorker(pair.Decode),
		TransferID: tid, XRequestIDs: xrids})
	if err != nil {
		ae := asAPIError(err, 500, apierr.CodeInternal)
		if ae.Cause != nil {
			x.log.Warn().Err(ae.Cause).Str("prefill", pair.Prefill.URL).Str("decode", pair.Decode.URL).Msg(ae.Message)
		}
		if ae.Code == pd.CodeMoRIIOPairMisconfigured {
			d.Metrics.PDKVTransferFail.Inc()
		}
		return x.reject(ae)
	}
	x.plan = plan
	d.Metrics.PDConnectorMode.WithLabelValues(plan.Mode.String()).Inc()
	x.log.Debug().Str("prefill", pair.Prefill.URL).Str("decode", pair.Decode.URL).Str("mode", plan.Mode.String()).
		Bool("prefill_leg", plan.SendPrefill).Bool("concurrent", plan.Concurrent).Msg("pair selected (sequential)")
	x.acquire(pair.Decode)
	x.dispatched = time.Now()

	if !plan.SendPrefill { // n>1: the handoff is single-consumer, so the decode recomputes
		x.phase = phaseDecodeWait
		return x.releaseDecode(plan.Decode)
	}
	url := pair.Prefill.BaseURL + x.route.UpstreamPath
	if plan.Concurrent {
		// MoRI-IO concurrent WRITE: the decode leg carries minted params now;
		// its answer is held until the prefill's handoff validates.
		release := d.active(pair.Prefill)
		x.prefill = startPrefill(x.ctx, d.Client, url, x.legHeaders(), plan.Prefill, d.RequestTimeout, true, func(l *prefillLeg) {
			if st, terr, ok := l.outcome(); ok {
				d.record(pair.Prefill, "prefill", st, terr)
			}
			release()
		})
		x.watchPrefill(x.prefill)
		x.phase = phaseDecodeWait
		return x.releaseDecode(plan.Decode)
	}

	ctx, cancel := context.WithTimeout(x.ctx, d.RequestTimeout)
	defer cancel()
	release := d.active(pair.Prefill)
	start := time.Now()
	st, _, body, perr := doPost(ctx, d.Client, url, x.legHeaders(), plan.Prefill)
	release()
	x.waited += time.Since(start)
	if x.ctx.Err() != nil {
		return nil // the client left; nothing to answer
	}
	if perr != nil {
		d.record(pair.Prefill, "prefill", 0, true)
		if strings.HasPrefix(perr.Error(), "read response body") {
			return x.reject(pd.PrefillReadError(perr))
		}
		if ctx.Err() == context.DeadlineExceeded {
			perr = timeoutErr{perr, d.RequestTimeout}
		}
		x.log.Warn().Err(perr).Str("prefill", pair.Prefill.URL).Msg("prefill transport error")
		return x.reject(pd.PrefillRequestError(perr))
	}
	d.record(pair.Prefill, "prefill", st, false)
	if st < 200 || st > 299 {
		e := pd.PrefillUpstreamError(st, body)
		x.log.Warn().Int("status", st).Str("prefill", pair.Prefill.URL).Msg("prefill failed")
		return x.reject(e)
	}
	prefillDone := time.Now()
	d.Metrics.PDPrefillDuration.WithLabelValues("pd", x.model, pair.Prefill.Runtime).Observe(prefillDone.Sub(start).Seconds())
	dBody, kvFailed, err := plan.DecodeAfterPrefill(body)
	if err != nil {
		d.Metrics.PDKVTransferFail.Inc()
		x.log.Warn().Err(err).Str("prefill", pair.Prefill.URL).Msg("prefill handoff rejected")
		return x.reject(asAPIError(err, 502, pd.CodeMoRIIOHandoffInvalid))
	}
	if kvFailed {
		d.Metrics.PDKVTransferFail.Inc()
		x.log.Warn().Str("prefill", pair.Prefill.URL).Msg("NIXL prefill returned no kv_transfer_params; the decode recomputes the prompt")
	}
	if e := x.log.Debug(); e.Enabled() {
		e.Str("mode", plan.Mode.String()).Str("handoff", handoffKind(plan, body, kvFailed)).Msg("kv handoff")
	}
	x.phase = phaseDecodeWait
	err = x.releaseDecode(dBody)
	// Prefill completion to decode dispatch: the gateway's share of the handoff.
	d.Metrics.PDKVTransfer.WithLabelValues("pd", x.model, pair.Prefill.Runtime).Observe(time.Since(prefillDone).Seconds())
	return err
}

// handoffKind names what the decode leg got, for debug logs.
func handoffKind(plan *pd.VLLMPlan, prefillBody []byte, kvFailed bool) string {
	switch {
	case kvFailed:
		return "missing"
	case plan.Mode == pd.ModePassthrough:
		if _, ok := pd.HarvestKVTransferParams(prefillBody); ok {
			return "relayed"
		}
		return "none (passthrough)"
	case plan.Mode == pd.ModeMooncake && len(plan.DecodeParams) > 0:
		return "synthesized"
	case plan.Mode == pd.ModeMoRIIO:
		return "validated"
	}
	if _, ok := pd.HarvestKVTransferParams(prefillBody); ok {
		return "relayed"
	}
	return "missing"
}

// seqPrefillError maps a concurrent-WRITE prefill failure (vLLM's codes).
func (x *exchange) seqPrefillError() *apierr.Error {
	st, body, err := x.prefill.result()
	if err != nil {
		return pd.PrefillRequestError(err)
	}
	return pd.PrefillUpstreamError(st, body)
}

type timeoutErr struct {
	err error
	d   time.Duration
}

func (t timeoutErr) Error() string {
	return "timed out after " + t.d.String() + ": " + t.err.Error()
}

func (t timeoutErr) Unwrap() error { return t.err }
