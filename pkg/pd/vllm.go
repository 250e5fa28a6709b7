package pd

// vLLM sequential dispatch over HTTP (SMG §2): the connector mode, the two
// leg bodies, the kv_transfer_params handoff between them and the
// sequential-path error codes. Everything here is pure: the caller sends the
// legs, this file only decides what they carry.

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/smg-project/smg-extproc/pkg/apierr"
)

// KV connector names as registered (kv_connector), matched exactly.
const (
	NixlConnector     = "NixlConnector"
	MooncakeConnector = "MooncakeConnector"
	MoRIIOConnector   = "MoRIIOConnector"
)

// DefaultMooncakeBootstrapPort is used in remote_bootstrap_addr when the
// prefill worker was registered without a bootstrap port.
const DefaultMooncakeBootstrapPort = 8998

// Sequential-path error codes (SMG §2.3, §6.3).
const (
	CodePrefillUpstreamError = "prefill_upstream_error"
	CodePrefillRequestFailed = "prefill_request_failed"
	CodePrefillReadFailed    = "prefill_read_failed"
	CodeDecodeRequestFailed  = "decode_request_failed"
)

// ConnectorMode is how a vLLM attempt hands the KV cache from prefill to
// decode.
type ConnectorMode uint8

const (
	ModePassthrough ConnectorMode = iota // no tag; relay whatever prefill returns
	ModeNixl                             // tag prefill, relay its params
	ModeMooncake                         // mint transfer_id, synthesize decode params
	ModeMoRIIO                           // MoRI-IO: validated handoff, never recompute
)

// String is the smg_pd_kv_connector_mode_total mode label.
func (m ConnectorMode) String() string {
	switch m {
	case ModeNixl:
		return "nixl"
	case ModeMooncake:
		return "mooncake"
	case ModeMoRIIO:
		return "moriio"
	}
	return "passthrough"
}

// ConnectorModeOf maps one worker's kv_connector by exact match; anything
// else (MultiConnector, a different spelling, "") is passthrough.
func ConnectorModeOf(kvConnector string) ConnectorMode {
	switch kvConnector {
	case NixlConnector:
		return ModeNixl
	case MooncakeConnector:
		return ModeMooncake
	case MoRIIOConnector:
		return ModeMoRIIO
	}
	return ModePassthrough
}

// PairConnectorMode is the mode of a prefill/decode pair: the prefill's
// connector decides, except that a MoRI-IO decode worker always takes the
// MoRI-IO path (its engine never recomputes, so it must never run without
// a handoff). A MoRI-IO prefill also gives ModeMoRIIO; the pair check then
// refuses a non-MoRI-IO decode.
func PairConnectorMode(prefillConnector, decodeConnector string) ConnectorMode {
	if decodeConnector == MoRIIOConnector {
		return ModeMoRIIO
	}
	return ConnectorModeOf(prefillConnector)
}

// VLLMWorker is what the vLLM path needs from a worker record
// (workers.Worker fields of the same names).
type VLLMWorker struct {
	URL           string // as registered; used in refusal reasons only
	KVConnector   string
	KVEngineID    string
	BootstrapHost string // URL host, IPv6 in brackets
	BootstrapPort *int
	DPRank        *int
	DPSize        *int
	Labels        map[string]string
}

// MooncakeEngineID is the KV engine id a Mooncake handoff is minted for:
// KVEngineID ("" = unknown), or "<id>_dp<rank>" when the DP size (DPSize,
// else the dp_size label) is > 1, which needs a pinned DPRank. An unpinned
// DP>1 worker, or a dp_size label that is not a positive integer (with
// DPSize unset), gives none: decode then recomputes.
func MooncakeEngineID(w VLLMWorker) (string, bool) {
	if w.KVEngineID == "" {
		return "", false
	}
	dp := 1
	if w.DPSize != nil {
		dp = *w.DPSize
	} else if v, ok := w.Labels["dp_size"]; ok {
		n, ok := parseDecimal(v)
		if !ok || n < 1 {
			return "", false // unknown DP topology: fail closed
		}
		dp = n
	}
	if dp <= 1 {
		return w.KVEngineID, true
	}
	if w.DPRank == nil {
		return "", false
	}
	return w.KVEngineID + "_dp" + strconv.Itoa(*w.DPRank), true
}

// MintTransferID returns "xfer-" + a hyphenated UUIDv7 from crypto/rand.
func MintTransferID() (string, error) {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("pd: mint transfer id: %w", err)
	}
	return transferIDFrom(time.Now(), b), nil
}

func transferIDFrom(now time.Time, b [16]byte) string {
	ms := uint64(now.UnixMilli())
	for i := 0; i < 6; i++ {
		b[i] = byte(ms >> (40 - 8*i))
	}
	b[6] = b[6]&0x0f | 0x70 // version 7
	b[8] = b[8]&0x3f | 0x80 // RFC 9562 variant
	var out [5 + 36]byte
	copy(out[:], "xfer-")
	h := out[5:]
	hex.Encode(h[0:8], b[0:4])
	h[8] = '-'
	hex.Encode(h[9:13], b[4:6])
	h[13] = '-'
	hex.Encode(h[14:18], b[6:8])
	h[18] = '-'
	hex.Encode(h[19:23], b[8:10])
	h[23] = '-'
	hex.Encode(h[24:36], b[10:16])
	return string(out[:])
}

// VLLMAttempt is the per-attempt input of BuildVLLMLegs.
type VLLMAttempt struct {
	Prefill, Decode VLLMWorker
	// TransferID is MintTransferID's value for this attempt. It is used only
	// where a handoff is minted (Mooncake with an engine id, MoRI-IO); those
	// modes fail without it.
	TransferID string
	// Model, when non-empty and different from Request.Model, replaces the
	// value of an existing top-level "model" on both legs (never added), as
	// Bootstrap.Model does.
	Model string
	// XRequestIDs are the X-Request-Id header values forwarded to the legs,
	// checked for MoRI-IO peer markers.
	XRequestIDs []string
}

// HandoffKind says what the decode leg takes from the prefill response.
type HandoffKind uint8

const (
	// HandoffNone: the decode body is final before prefill runs (no relay,
	// n > 1, Mooncake); the prefill response body is not consulted.
	HandoffNone HandoffKind = iota
	// HandoffRelay: NIXL and passthrough relay the prefill's top-level
	// kv_transfer_params verbatim when it has an object there.
	HandoffRelay
	// HandoffMoRIIO: the prefill's kv_transfer_params must pass
	// ValidateMoRIIOHandoff, else the request fails with 502.
	HandoffMoRIIO
)

// VLLMPlan is what one vLLM attempt sends.
type VLLMPlan struct {
	Mode ConnectorMode
	// SendPrefill is SMG's relay gate, n <= 1 (top-level "n" as an unsigned
	// integer, anything else counts as 1). When false there is no prefill
	// leg, Prefill is nil and Decode is sent as is.
	SendPrefill bool
	// Prefill is the sanitized prefill leg body.
	Prefill []byte
	// Decode is the decode leg body before the handoff: the client's bytes
	// (model rewritten), plus DecodeParams when those were minted up front.
	// It may alias Request.Raw.
	Decode []byte
	// DecodeParams are the kv_transfer_params minted for decode up front
	// (Mooncake with an engine id, concurrent MoRI-IO WRITE), else nil.
	DecodeParams []byte
	// TransferID is the minted id the legs carry, "" when none.
	TransferID string
	Handoff    HandoffKind
	// MoRIIO is the resolved pair on the MoRI-IO path, else nil.
	MoRIIO *MoRIIOPair
	// Concurrent: MoRI-IO WRITE with concurrent dispatch. Both legs go out
	// at once; the decode response may be forwarded only after
	// DecodeAfterPrefill accepts the prefill response.
	Concurrent bool

	trusted bool // Decode was validated by ParseRequest
}

// nixlPrefillParams tags the NIXL prefill leg.
const nixlPrefillParams = `{"do_remote_decode":true,"do_remote_prefill":false}`

// BuildVLLMLegs builds the legs of one vLLM attempt (SMG §2.2, §2.4).
//
// The prefill leg is the client's bytes, edited in one pass: "stream":false,
// "stream_options" and "min_tokens" removed, an existing "n" set to 1, the
// route's one-token cap (chat with "max_completion_tokens":
// max_completion_tokens:1 and "max_tokens" removed; /v1/responses:
// max_output_tokens:1; otherwise max_tokens:1), the canonical model, and the
// mode's kv_transfer_params (NIXL: the tag; Mooncake with engine id: the tag
// plus transfer_id; MoRI-IO: see MoRIIOPrefillParams, plus
// "ignore_eos":true with "stop" and "stop_token_ids" removed). The decode
// leg is the client's bytes with only the model rewritten, plus the params
// minted up front where the mode has them.
//
// On the MoRI-IO path the request and the pair are checked first; refusals
// are *apierr.Error (501 moriio_route_unsupported, 400
// moriio_fanout_unsupported, 400 moriio_request_id_reserved, 503
// moriio_pair_misconfigured, in that order). Any other error is internal.
func BuildVLLMLegs(req *Request, a VLLMAttempt) (*VLLMPlan, error) {
	if req == nil || req.Route == nil {
		return nil, errors.New("pd: build vLLM legs: request without route")
	}
	f, err := scanVLLMFields(req)
	if err != nil {
		return nil, fmt.Errorf("pd: build vLLM legs: %w", err)
	}
	plan := &VLLMPlan{
		Mode:        PairConnectorMode(a.Prefill.KVConnector, a.Decode.KVConnector),
		SendPrefill: vllmN(f.n) <= 1,
		trusted:     req.lay.ok,
	}
	needID := func() error {
		if a.TransferID == "" {
			return fmt.Errorf("pd: build vLLM legs: %s mode needs a transfer id", plan.Mode)
		}
		plan.TransferID = a.TransferID
		return nil
	}
	var prefillParams []byte
	switch plan.Mode {
	case ModeMoRIIO:
		if err := checkMoRIIORequest(req.Route, &f, a.XRequestIDs); err != nil {
			return nil, err
		}
		pair, err := ResolveMoRIIOPair(a.Prefill, a.Decode)
		if err != nil {
			return nil, err
		}
		if err := needID(); err != nil {
			return nil, err
		}
		plan.MoRIIO, plan.Handoff, plan.Concurrent = &pair, HandoffMoRIIO, pair.Concurrent
		prefillParams = MoRIIOPrefillParams(a.TransferID, pair.Decode, nil)
		if pair.Concurrent {
			plan.DecodeParams = MoRIIODecodeParams(a.TransferID, pair.Prefill, nil)
		}
	case ModeNixl:
		if plan.SendPrefill {
			prefillParams, plan.Handoff = []byte(nixlPrefillParams), HandoffRelay
		}
	case ModeMooncake:
		if id, ok := MooncakeEngineID(a.Prefill); ok && plan.SendPrefill {
			if err := needID(); err != nil {
				return nil, err
			}
			prefillParams = mooncakePrefillParams(a.TransferID)
			port := DefaultMooncakeBootstrapPort
			if a.Prefill.BootstrapPort != nil {
				port = *a.Prefill.BootstrapPort
			}
			plan.DecodeParams = mooncakeDecodeParams(a.TransferID, id, a.Prefill.BootstrapHost, port)
		}
	default:
		if plan.SendPrefill {
			plan.Handoff = HandoffRelay
		}
	}

	var model []byte
	if a.Model != "" && a.Model != req.Model && req.hasKey(ownModel) {
		model = appendJSONString(nil, a.Model)
	}

	if plan.SendPrefill {
		if plan.Prefill, err = req.vllmPrefill(&f, model, prefillParams, plan.Mode == ModeMoRIIO); err != nil {
			return nil, fmt.Errorf("pd: build vLLM prefill leg: %w", err)
		}
	}

	var dset [2]KV
	set := dset[:0]
	if model != nil {
		set = append(set, KV{Key: "model", Value: model})
	}
	if plan.DecodeParams != nil {
		set = append(set, KV{Key: "kv_transfer_params", Value: plan.DecodeParams})
	}
	plan.Decode = req.Raw
	if len(set) > 0 {
		if plan.Decode, err = editObject(req.Raw, set, nil, req.lay.ok); err != nil {
			return nil, fmt.Errorf("pd: build vLLM decode leg: %w", err)
		}
	}
	return plan, nil
}

// vllmPrefill writes the sanitized prefill body in one edit pass.
func (req *Request) vllmPrefill(f *vllmFields, model, params []byte, moriio bool) ([]byte, error) {
	var setBuf [8]KV
	var removeBuf [8]string
	set := append(setBuf[:0], KV{Key: "stream", Value: []byte("false")})
	remove := append(removeBuf[:0], "stream_options", "min_tokens")
	if f.n != nil {
		set = append(set, KV{Key: "n", Value: []byte("1")})
	}
	switch k := req.Route.kind(); {
	case k == kindChat && f.maxCompletionTokens != nil:
		set = append(set, KV{Key: "max_completion_tokens", Value: []byte("1")})
		remove = append(remove, "max_tokens")
	case k == kindResponses:
		set = append(set, KV{Key: "max_output_tokens", Value: []byte("1")})
	default:
		set = append(set, KV{Key: "max_tokens", Value: []byte("1")})
	}
	if model != nil {
		set = append(set, KV{Key: "model", Value: model})
	}
	if moriio {
		set = append(set, KV{Key: "ignore_eos", Value: []byte("true")})
		remove = append(remove, "stop", "stop_token_ids")
	}
	if params != nil {
		set = append(set, KV{Key: "kv_transfer_params", Value: params})
	}
	return editObject(req.Raw, set, remove, req.lay.ok)
}

// DecodeAfterPrefill returns the decode body for a 2xx prefill response
// body (SMG §2.3 step 3). kvTransferFailed is true when a NIXL prefill
// returned no kv_transfer_params (count smg_pd_kv_transfer_failures_total;
// decode recomputes). On the MoRI-IO path the handoff is validated (with the
// ports the decode was told under concurrent dispatch) and a failure is a
// 502 moriio_handoff_invalid *apierr.Error; under concurrent dispatch the
// returned body is the decode body already sent.
func (p *VLLMPlan) DecodeAfterPrefill(prefillBody []byte) (decode []byte, kvTransferFailed bool, err error) {
	switch p.Handoff {
	case HandoffRelay:
		raw, ok := HarvestKVTransferParams(prefillBody)
		if !ok {
			return p.Decode, p.Mode == ModeNixl, nil
		}
		out, err := p.withParams(raw)
		return out, false, err
	case HandoffMoRIIO:
		raw, ok := HarvestKVTransferParams(prefillBody)
		if !ok {
			return nil, false, moriioHandoffInvalid("prefill response carries no kv_transfer_params object")
		}
		var expect *[2]int
		if p.Concurrent && p.MoRIIO != nil {
			expect = &[2]int{p.MoRIIO.Prefill.HandshakePort, p.MoRIIO.Prefill.NotifyPort}
		}
		if err := ValidateMoRIIOHandoff(raw, p.TransferID, expect, nil); err != nil {
			return nil, false, err
		}
		if p.Concurrent {
			return p.Decode, false, nil
		}
		out, err := p.withParams(raw)
		return out, false, err
	}
	return p.Decode, false, nil
}

// withParams sets kv_transfer_params (validated by HarvestKVTransferParams)
// on the decode body.
func (p *VLLMPlan) withParams(raw []byte) ([]byte, error) {
	out, err := editObject(p.Decode, []KV{{Key: "kv_transfer_params", Value: raw}}, nil, p.trusted)
	if err != nil {
		return nil, fmt.Errorf("pd: build vLLM decode leg: %w", err)
	}
	return out, nil
}

// HarvestKVTransferParams returns the raw bytes of the top-level
// "kv_transfer_params" of a prefill response (the last one if repeated),
// byte for byte and aliasing prefillBody. ok is false when the body is not
// a valid JSON object, or the key is missing or not an object (null
// included).
func HarvestKVTransferParams(prefillBody []byte) (raw []byte, ok bool) {
	raw, ok = TopLevel(prefillBody, "kv_transfer_params")
	if !ok || raw[0] != '{' {
		return nil, false
	}
	return raw, true
}

// DecodeBody returns clientBody with the top-level "kv_transfer_params" set
// to params verbatim (replacing a client value), or clientBody itself when
// params is empty. Both must be valid JSON; the result never aliases
// clientBody when params is set.
func DecodeBody(clientBody, params []byte) ([]byte, error) {
	if len(params) == 0 {
		return clientBody, nil
	}
	return SetTopLevel(clientBody, KV{Key: "kv_transfer_params", Value: params})
}

func mooncakePrefillParams(transferID string) []byte {
	out := make([]byte, 0, 80+len(transferID))
	out = append(out, `{"do_remote_decode":true,"do_remote_prefill":false,"transfer_id":`...)
	out = appendJSONString(out, transferID)
	return append(out, '}')
}

// mooncakeDecodeParams synthesizes the Mooncake decode params: the connector
// pushes the KV and its prefill returns nothing to relay.
func mooncakeDecodeParams(transferID, engineID, host string, port int) []byte {
	if strings.Contains(host, ":") && !strings.HasPrefix(host, "[") {
		host = "[" + host + "]" // a bare IPv6 literal
	}
	out := make([]byte, 0, 160+len(transferID)+len(engineID)+len(host))
	out = append(out, `{"do_remote_decode":false,"do_remote_prefill":true,"transfer_id":`...)
	out = appendJSONString(out, transferID)
	out = append(out, `,"remote_engine_id":`...)
	out = appendJSONString(out, engineID)
	out = append(out, `,"remote_bootstrap_addr":`...)
	out = appendJSONString(out, "http://"+host+":"+strconv.Itoa(port))
	return append(out, '}')
}

// vllmFields holds the raw values (last occurrence) of the top-level keys
// the vLLM path reads; nil when absent.
type vllmFields struct {
	n, maxCompletionTokens, prompt, promptEmbeds, useBeamSearch, requestID []byte
}

func scanVLLMFields(req *Request) (vllmFields, error) {
	var f vllmFields
	b := req.Raw
	open, err := objectStart(b)
	if err != nil {
		return f, err
	}
	it := newObjIter(b, open)
	it.trusted = req.lay.ok
	for it.next() {
		v := b[it.m.vs:it.m.ve]
		switch string(it.m.keyBytes(b)) {
		case "n":
			f.n = v
		case "max_completion_tokens":
			f.maxCompletionTokens = v
		case "prompt":
			f.prompt = v
		case "prompt_embeds":
			f.promptEmbeds = v
		case "use_beam_search":
			f.useBeamSearch = v
		case "request_id":
			f.requestID = v
		}
	}
	if it.err != nil {
		return f, it.err
	}
	if j := skipWS(b, it.end); j != len(b) {
		return f, errChar(b[j], "after top-level value", j)
	}
	return f, nil
}

// vllmN reads "n" as SMG does: an unsigned integer, else (absent, null,
// negative, fractional, too large) 1.
func vllmN(v []byte) uint64 {
	if n, ok := jsonUint(v); ok {
		return n
	}
	return 1
}

// jsonUint parses a JSON integer literal that fits in a uint64 (what
// serde_json's as_u64 accepts: no sign, fraction or exponent).
func jsonUint(v []byte) (uint64, bool) {
	if len(v) == 0 || len(v) > 20 {
		return 0, false
	}
	for _, c := range v {
		if !isDigit(c) {
			return 0, false
		}
	}
	n, err := strconv.ParseUint(string(v), 10, 64)
	return n, err == nil
}

// parseDecimal parses a label value of ASCII digits (surrounding whitespace
// allowed) into an int.
func parseDecimal(s string) (int, bool) {
	s = strings.TrimSpace(s)
	if s == "" || len(s) > 18 {
		return 0, false
	}
	n := 0
	for i := 0; i < len(s); i++ {
		if !isDigit(s[i]) {
			return 0, false
		}
		n = n*10 + int(s[i]-'0')
	}
	return n, true
}

// PrefillUpstreamError passes a non-2xx vLLM prefill response through with
// its exact status (a status outside 300-599 becomes 502). The message is
// the upstream error.message, else a top-level message, else the raw text.
func PrefillUpstreamError(status int, body []byte) *apierr.Error {
	if status < 300 || status > 599 {
		status = http.StatusBadGateway
	}
	return apierr.New(status, CodePrefillUpstreamError, upstreamMessage(body))
}

// PrefillRequestError is the 502 for a transport failure on the vLLM
// prefill leg (decode is never contacted).
func PrefillRequestError(err error) *apierr.Error {
	return apierr.Wrap(err, http.StatusBadGateway, CodePrefillRequestFailed, "Prefill transport error: "+errText(err))
}

// PrefillReadError is the 502 when a 2xx vLLM prefill body cannot be read.
func PrefillReadError(err error) *apierr.Error {
	return apierr.Wrap(err, http.StatusBadGateway, CodePrefillReadFailed, "Failed to read prefill response: "+errText(err))
}

// DecodeRequestError is the 502 for a transport failure on the vLLM decode
// leg.
func DecodeRequestError(err error) *apierr.Error {
	return apierr.Wrap(err, http.StatusBadGateway, CodeDecodeRequestFailed, "Decode transport error: "+errText(err))
}

func errText(err error) string {
	if err == nil {
		return "<nil>"
	}
	return err.Error()
}
