package pd

// MoRI-IO over HTTP (SMG §2.4, spec "MoRI-IO (HTTP)"): worker labels, the
// refusals made before either leg is contacted, the kv_transfer_params the
// legs carry and the validation of the handoff the prefill returns.

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"unicode"

	"github.com/smg-project/smg-extproc/pkg/apierr"
)

// MoRI-IO error codes.
const (
	CodeMoRIIOPairMisconfigured = "moriio_pair_misconfigured" // 503
	CodeMoRIIOFanoutUnsupported = "moriio_fanout_unsupported" // 400
	CodeMoRIIORequestIDReserved = "moriio_request_id_reserved"
	CodeMoRIIORouteUnsupported  = "moriio_route_unsupported" // 501
	CodeMoRIIOHandoffInvalid    = "moriio_handoff_invalid"   // 502
)

// MoRI-IO worker labels and their defaults (vLLM's MoRIIOConstants).
const (
	LabelMoRIIOMode          = "moriio_mode"
	LabelMoRIIOHost          = "moriio_host"
	LabelMoRIIOHandshakePort = "moriio_handshake_port"
	LabelMoRIIONotifyPort    = "moriio_notify_port"
	LabelMoRIIOWriteDispatch = "moriio_write_dispatch"
	LabelTPSize              = "tp_size"
	LabelDPSize              = "dp_size"

	DefaultMoRIIOHandshakePort = 6301
	DefaultMoRIIONotifyPort    = 61005
)

// MoRIIOMode is the transfer direction; both legs must use the same one.
type MoRIIOMode uint8

const (
	MoRIIORead  MoRIIOMode = iota + 1 // decode pulls after the prefill leg returns
	MoRIIOWrite                       // prefill pushes into blocks decode allocated
)

func (m MoRIIOMode) String() string {
	switch m {
	case MoRIIORead:
		return "read"
	case MoRIIOWrite:
		return "write"
	}
	return "unknown"
}

// MoRIIOEndpoint is one worker's MoRI-IO side channel, from its labels.
type MoRIIOEndpoint struct {
	Mode          MoRIIOMode
	Host          string // moriio_host, else the worker URL host
	HandshakePort int    // moriio_handshake_port, default 6301
	NotifyPort    int    // moriio_notify_port, default 61005
	TPSize        int    // tp_size label, 0 when unset
	DPSize        int    // always 1: DP>1 is refused
	// Concurrent is moriio_write_dispatch == "concurrent" (default
	// "sequential"); it matters only on the decode worker of a WRITE pair.
	Concurrent bool
}

// MoRIIOPair is a validated prefill/decode MoRI-IO pair.
type MoRIIOPair struct {
	Prefill, Decode MoRIIOEndpoint
	Mode            MoRIIOMode
	// Concurrent: WRITE with the decode worker labeled concurrent; both legs
	// are dispatched at once with decode params minted up front.
	Concurrent bool
}

// ParseMoRIIOEndpoint reads a worker's MoRI-IO labels. Label values are
// trimmed; an empty value counts as unset. The error is the reason, for
// the log. Refused: a worker that is not MoRIIOConnector, moriio_mode
// missing or not read/write (case-insensitive), a port that is not in
// 1-65535, tp_size not a positive integer, a moriio_write_dispatch other
// than sequential/concurrent (case-insensitive), DP > 1 (DPSize, else the
// dp_size label, which must be a positive integer), a per-rank worker
// (DPRank set), and an empty host.
func ParseMoRIIOEndpoint(w VLLMWorker) (MoRIIOEndpoint, error) {
	var e MoRIIOEndpoint
	if w.KVConnector != MoRIIOConnector {
		return e, fmt.Errorf("%s is not a %s worker (kv_connector %q)", w.URL, MoRIIOConnector, w.KVConnector)
	}
	label := func(name string) (string, bool) {
		v := strings.TrimSpace(w.Labels[name])
		return v, v != ""
	}
	switch v, _ := label(LabelMoRIIOMode); strings.ToLower(v) {
	case "read":
		e.Mode = MoRIIORead
	case "write":
		e.Mode = MoRIIOWrite
	default:
		return e, fmt.Errorf("%s: label %s must be \"read\" or \"write\", got %q", w.URL, LabelMoRIIOMode, v)
	}
	if w.DPRank != nil {
		return e, fmt.Errorf("%s: per-rank worker (dp rank %d): MoRI-IO PD does not support data parallelism", w.URL, *w.DPRank)
	}
	e.DPSize = 1
	if w.DPSize != nil {
		e.DPSize = *w.DPSize
	} else if v, ok := label(LabelDPSize); ok {
		n, ok := parseDecimal(v)
		if !ok || n < 1 {
			return e, fmt.Errorf("%s: label %s is not a positive integer: %q", w.URL, LabelDPSize, v)
		}
		e.DPSize = n
	}
	if e.DPSize != 1 {
		return e, fmt.Errorf("%s: dp_size %d: MoRI-IO PD does not support data parallelism", w.URL, e.DPSize)
	}
	port := func(name string, def int) (int, error) {
		v, ok := label(name)
		if !ok {
			return def, nil
		}
		if n, ok := parseDecimal(v); ok && n >= 1 && n <= 65535 {
			return n, nil
		}
		return 0, fmt.Errorf("%s: label %s is not a port: %q", w.URL, name, v)
	}
	var err error
	if e.HandshakePort, err = port(LabelMoRIIOHandshakePort, DefaultMoRIIOHandshakePort); err != nil {
		return e, err
	}
	if e.NotifyPort, err = port(LabelMoRIIONotifyPort, DefaultMoRIIONotifyPort); err != nil {
		return e, err
	}
	if v, ok := label(LabelTPSize); ok {
		n, ok := parseDecimal(v)
		if !ok || n < 1 {
			return e, fmt.Errorf("%s: label %s is not a positive integer: %q", w.URL, LabelTPSize, v)
		}
		e.TPSize = n
	}
	switch v, _ := label(LabelMoRIIOWriteDispatch); strings.ToLower(v) {
	case "", "sequential":
	case "concurrent":
		e.Concurrent = true
	default:
		return e, fmt.Errorf("%s: label %s must be \"sequential\" or \"concurrent\", got %q", w.URL, LabelMoRIIOWriteDispatch, v)
	}
	e.Host = w.BootstrapHost
	if v, ok := label(LabelMoRIIOHost); ok {
		e.Host = v
	}
	if e.Host == "" {
		return e, fmt.Errorf("%s: no MoRI-IO host (set label %s)", w.URL, LabelMoRIIOHost)
	}
	return e, nil
}

// ResolveMoRIIOPair validates a pair on the MoRI-IO path. A refusal is a
// 503 moriio_pair_misconfigured *apierr.Error whose Cause is the reason:
// either endpoint refused by ParseMoRIIOEndpoint, modes differ, or, in
// WRITE mode, the decode side channel is unreachable from the prefill (see
// moriioWriteTargetError).
func ResolveMoRIIOPair(p, d VLLMWorker) (MoRIIOPair, error) {
	pe, err := ParseMoRIIOEndpoint(p)
	if err != nil {
		return MoRIIOPair{}, moriioMisconfigured("prefill " + err.Error())
	}
	de, err := ParseMoRIIOEndpoint(d)
	if err != nil {
		return MoRIIOPair{}, moriioMisconfigured("decode " + err.Error())
	}
	if pe.Mode != de.Mode {
		return MoRIIOPair{}, moriioMisconfigured(fmt.Sprintf("prefill %s is in %s mode but decode %s is in %s mode", p.URL, pe.Mode, d.URL, de.Mode))
	}
	pair := MoRIIOPair{Prefill: pe, Decode: de, Mode: pe.Mode}
	if pe.Mode == MoRIIOWrite {
		if reason := moriioWriteTargetError(pe, de); reason != "" {
			return MoRIIOPair{}, moriioMisconfigured(reason)
		}
		pair.Concurrent = de.Concurrent
	}
	return pair, nil
}

// moriioLocalOnly reports whether host reaches only its own machine:
// localhost, or a loopback or unspecified IP (IPv6 with or without brackets).
func moriioLocalOnly(host string) bool {
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip := net.ParseIP(strings.TrimSuffix(strings.TrimPrefix(host, "["), "]"))
	return ip != nil && (ip.IsLoopback() || ip.IsUnspecified())
}

// moriioWriteTargetError explains why a WRITE prefill told to push to
// decode would not reach it: a local-only decode host while the prefill is
// not; under concurrent dispatch (decode dials the prefill's labeled side
// channel) a local-only prefill host while the decode is not; or both legs
// on one host (equal, or both local-only) sharing the handshake or notify
// port. "" when reachable.
func moriioWriteTargetError(p, d MoRIIOEndpoint) string {
	pl, dl := moriioLocalOnly(p.Host), moriioLocalOnly(d.Host)
	switch {
	case dl && !pl:
		return fmt.Sprintf("decode MoRI-IO host %s is loopback or unspecified but the prefill is at %s; set label %s on the decode worker", d.Host, p.Host, LabelMoRIIOHost)
	case d.Concurrent && pl && !dl:
		return fmt.Sprintf("prefill MoRI-IO host %s is loopback or unspecified but the decode, dispatched concurrently, is at %s; set label %s on the prefill worker", p.Host, d.Host, LabelMoRIIOHost)
	case (p.Host == d.Host || pl && dl) && (p.HandshakePort == d.HandshakePort || p.NotifyPort == d.NotifyPort):
		return fmt.Sprintf("prefill and decode share the MoRI-IO side channel on %s (handshake %d/%d, notify %d/%d); label distinct ports",
			d.Host, p.HandshakePort, d.HandshakePort, p.NotifyPort, d.NotifyPort)
	}
	return ""
}

// Request-id substrings the MoRI-IO connector reads a peer address from,
// ahead of the explicit kv_transfer_params fields.
const (
	moriioPrefillMarker = "___prefill_addr_"
	moriioDecodeMarker  = "___decode_addr_"
)

func hasMoRIIOPeerMarker(id string) bool {
	return strings.Contains(id, moriioPrefillMarker) || strings.Contains(id, moriioDecodeMarker)
}

// CheckMoRIIORequest applies the per-request MoRI-IO refusals, in order:
// 501 moriio_route_unsupported (only chat and completions); 400
// moriio_fanout_unsupported (n > 1, a completions prompt list of more than
// one prompt, a prompt_embeds list of more than one element,
// use_beam_search true); 400 moriio_request_id_reserved (an X-Request-Id
// value or the body's string request_id containing ___prefill_addr_ or
// ___decode_addr_). BuildVLLMLegs runs it on the MoRI-IO path.
func CheckMoRIIORequest(req *Request, xRequestIDs []string) error {
	if req == nil || req.Route == nil {
		return errors.New("pd: check MoRI-IO request: request without route")
	}
	f, err := scanVLLMFields(req)
	if err != nil {
		return fmt.Errorf("pd: check MoRI-IO request: %w", err)
	}
	return checkMoRIIORequest(req.Route, &f, xRequestIDs)
}

func checkMoRIIORequest(route *Route, f *vllmFields, xRequestIDs []string) error {
	kind := route.kind()
	if kind != kindChat && kind != kindCompletions {
		return apierr.Newf(http.StatusNotImplemented, CodeMoRIIORouteUnsupported,
			"MoRI-IO PD supports only /v1/chat/completions and /v1/completions, not %s", route.ClientPath)
	}
	fanout := func(what string) error {
		return apierr.New(http.StatusBadRequest, CodeMoRIIOFanoutUnsupported,
			"MoRI-IO PD hands one KV cache to one decode request; "+what+" is not supported")
	}
	if vllmN(f.n) > 1 {
		return fanout("n > 1")
	}
	if kind == kindCompletions && jsonListLen(f.prompt, true) > 1 {
		return fanout("a batched prompt")
	}
	if jsonListLen(f.promptEmbeds, false) > 1 {
		return fanout("a batched prompt_embeds")
	}
	if string(f.useBeamSearch) == "true" {
		return fanout("use_beam_search")
	}
	reserved := false
	for _, v := range xRequestIDs {
		reserved = reserved || hasMoRIIOPeerMarker(v)
	}
	if len(f.requestID) > 0 && f.requestID[0] == '"' && hasMoRIIOPeerMarker(decodeString(f.requestID)) {
		reserved = true
	}
	if reserved {
		return apierr.New(http.StatusBadRequest, CodeMoRIIORequestIDReserved,
			"Request ids must not contain the MoRI-IO peer-address markers ___prefill_addr_ or ___decode_addr_")
	}
	return nil
}

// jsonListLen is the element count of a validated JSON array value, 0 for
// anything else. With prompts set, a list of numbers is one tokenized
// prompt (1), and only lists of strings or lists count element by element.
func jsonListLen(v []byte, prompts bool) int {
	if len(v) == 0 || v[0] != '[' {
		return 0
	}
	it := trustedArrIter(v, 0)
	n := 0
	for it.next() {
		if n == 0 && prompts {
			if c := v[it.vs]; c != '"' && c != '[' {
				return 1
			}
		}
		n++
	}
	return n
}

// MoRIIOPrefillParams are the prefill leg's kv_transfer_params:
// {"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,
// "remote_block_ids":null,"transfer_id":…,"remote_dp_size":<decode dp>}
// plus "remote_dp_rank" when pinned, "remote_tp_size" when the decode has a
// tp_size label, and in WRITE mode the decode's side channel
// ("remote_host","remote_handshake_port","remote_notify_port").
func MoRIIOPrefillParams(transferID string, decode MoRIIOEndpoint, pinnedRank *int) []byte {
	out := make([]byte, 0, 256+len(transferID)+len(decode.Host))
	out = append(out, `{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"transfer_id":`...)
	out = appendJSONString(out, transferID)
	out = moriioTail(out, decode, pinnedRank, decode.Mode == MoRIIOWrite)
	return append(out, '}')
}

// MoRIIODecodeParams are the decode leg's kv_transfer_params minted up front
// for concurrent WRITE dispatch:
// {"do_remote_decode":false,"do_remote_prefill":true,"remote_engine_id":null,
// "remote_block_ids":null,"transfer_id":…,"remote_dp_size":<prefill dp>,
// "remote_host","remote_handshake_port","remote_notify_port" of the prefill}
// plus "remote_dp_rank" when pinned and the prefill's tp_size label as
// "remote_tp_size".
func MoRIIODecodeParams(transferID string, prefill MoRIIOEndpoint, pinnedRank *int) []byte {
	out := make([]byte, 0, 256+len(transferID)+len(prefill.Host))
	out = append(out, `{"do_remote_decode":false,"do_remote_prefill":true,"remote_engine_id":null,"remote_block_ids":null,"transfer_id":`...)
	out = appendJSONString(out, transferID)
	out = moriioTail(out, prefill, pinnedRank, true)
	return append(out, '}')
}

func moriioTail(out []byte, peer MoRIIOEndpoint, pinnedRank *int, sideChannel bool) []byte {
	dp := peer.DPSize
	if dp < 1 {
		dp = 1
	}
	out = append(out, `,"remote_dp_size":`...)
	out = strconv.AppendInt(out, int64(dp), 10)
	if pinnedRank != nil {
		out = append(out, `,"remote_dp_rank":`...)
		out = strconv.AppendInt(out, int64(*pinnedRank), 10)
	}
	if peer.TPSize > 0 {
		out = append(out, `,"remote_tp_size":`...)
		out = strconv.AppendInt(out, int64(peer.TPSize), 10)
	}
	if sideChannel {
		out = append(out, `,"remote_host":`...)
		out = appendJSONString(out, peer.Host)
		out = append(out, `,"remote_handshake_port":`...)
		out = strconv.AppendInt(out, int64(peer.HandshakePort), 10)
		out = append(out, `,"remote_notify_port":`...)
		out = strconv.AppendInt(out, int64(peer.NotifyPort), 10)
	}
	return out
}

// Handoff fields ValidateMoRIIOHandoff reads.
const (
	hoDoRemotePrefill = iota
	hoTransferID
	hoEngineID
	hoBlockIDs
	hoHost
	hoHandshakePort
	hoNotifyPort
	hoDPSize
	hoDPSizeLocal
	hoDPRank
	hoTPSize
	hoRemoteTPSize
	numHandoffFields
)

// handoffName is the key of handoff field i.
func handoffName(i int) string {
	switch i {
	case hoDoRemotePrefill:
		return "do_remote_prefill"
	case hoTransferID:
		return "transfer_id"
	case hoEngineID:
		return "remote_engine_id"
	case hoBlockIDs:
		return "remote_block_ids"
	case hoHost:
		return "remote_host"
	case hoHandshakePort:
		return "remote_handshake_port"
	case hoNotifyPort:
		return "remote_notify_port"
	case hoDPSize:
		return "remote_dp_size"
	case hoDPSizeLocal:
		return "remote_dp_size_local"
	case hoDPRank:
		return "remote_dp_rank"
	case hoTPSize:
		return "tp_size"
	case hoRemoteTPSize:
		return "remote_tp_size"
	}
	return ""
}

// ValidateMoRIIOHandoff checks the kv_transfer_params a MoRI-IO prefill
// returned before they reach a decode engine (whose scheduler raises on a
// malformed value). It must be a JSON object (duplicate keys: the last
// wins) with do_remote_prefill true, transfer_id equal to transferID, and
// non-null remote_engine_id (a non-empty string), remote_block_ids (a flat
// list of unsigned integers, or a list of such lists, with at least one
// block), remote_host (a non-empty string without whitespace) and
// remote_handshake_port / remote_notify_port (a port in 1-65535, as a
// number or a decimal string). remote_dp_size, remote_dp_size_local,
// remote_dp_rank, tp_size and remote_tp_size, when present and not null,
// must be unsigned integers, as a number or a decimal string. With
// expectPorts (concurrent WRITE) the two ports must equal
// {handshake, notify}; with pinnedRank, remote_dp_rank must be that number.
// A failure is a 502 moriio_handoff_invalid *apierr.Error whose Cause is
// the reason.
func ValidateMoRIIOHandoff(raw []byte, transferID string, expectPorts *[2]int, pinnedRank *int) error {
	open := skipWS(raw, 0)
	if open >= len(raw) || raw[open] != '{' || !validDoc(raw) {
		return moriioHandoffInvalid("kv_transfer_params is not a JSON object")
	}
	var v [numHandoffFields][]byte
	it := trustedObjIter(raw, open)
	for it.next() {
		key := it.m.keyBytes(raw)
		for i := range numHandoffFields {
			if string(key) == handoffName(i) {
				v[i] = raw[it.m.vs:it.m.ve]
				break
			}
		}
	}
	present := func(i int) bool { return v[i] != nil && string(v[i]) != "null" }
	malformed := func(i int) error {
		return moriioHandoffInvalid(fmt.Sprintf("handoff %s is malformed: %s", handoffName(i), clip(v[i])))
	}

	if string(v[hoDoRemotePrefill]) != "true" {
		return moriioHandoffInvalid("handoff does not ask decode for a remote prefill (do_remote_prefill is not true)")
	}
	if id, ok := jsonStringValue(v[hoTransferID]); !ok || id != transferID {
		return moriioHandoffInvalid(fmt.Sprintf("handoff transfer_id %s does not match the minted %s", clip(v[hoTransferID]), transferID))
	}
	for _, i := range [...]int{hoEngineID, hoBlockIDs, hoHost, hoHandshakePort, hoNotifyPort} {
		if !present(i) {
			return moriioHandoffInvalid("handoff is missing " + handoffName(i))
		}
	}
	if id, ok := jsonStringValue(v[hoEngineID]); !ok || id == "" {
		return malformed(hoEngineID)
	}
	if !moriioBlockIDs(v[hoBlockIDs]) {
		return malformed(hoBlockIDs)
	}
	if h, ok := jsonStringValue(v[hoHost]); !ok || h == "" || strings.IndexFunc(h, unicode.IsSpace) >= 0 {
		return malformed(hoHost)
	}
	var ports [2]int
	for k, i := range [...]int{hoHandshakePort, hoNotifyPort} {
		n, ok := jsonCount(v[i], true)
		if !ok || n < 1 || n > 65535 {
			return malformed(i)
		}
		ports[k] = int(n)
	}
	for _, i := range [...]int{hoDPSize, hoDPSizeLocal, hoDPRank, hoTPSize, hoRemoteTPSize} {
		if present(i) {
			if _, ok := jsonCount(v[i], false); !ok {
				return malformed(i)
			}
		}
	}
	if expectPorts != nil && ports != *expectPorts {
		return moriioHandoffInvalid(fmt.Sprintf("prefill reports MoRI-IO side channel handshake %d / notify %d, but the decode leg was told %d / %d",
			ports[0], ports[1], expectPorts[0], expectPorts[1]))
	}
	if pinnedRank != nil {
		if r, ok := jsonUint(v[hoDPRank]); !ok || *pinnedRank < 0 || r != uint64(*pinnedRank) {
			return moriioHandoffInvalid(fmt.Sprintf("handoff remote_dp_rank %s is not the pinned data-parallel rank %d", clip(v[hoDPRank]), *pinnedRank))
		}
	}
	return nil
}

// moriioBlockIDs accepts a flat list of unsigned integers with at least one
// element, or a list of lists of them with at least one block overall.
func moriioBlockIDs(v []byte) bool {
	if v[0] != '[' {
		return false
	}
	blocks, flat, nested := 0, false, false
	it := trustedArrIter(v, 0)
	for it.next() {
		e := v[it.vs:it.ve]
		if e[0] == '[' {
			nested = true
			in := trustedArrIter(e, 0)
			for in.next() {
				if _, ok := jsonUint(e[in.vs:in.ve]); !ok {
					return false
				}
				blocks++
			}
			continue
		}
		if _, ok := jsonUint(e); !ok {
			return false
		}
		flat = true
		blocks++
	}
	return blocks > 0 && !(flat && nested)
}

// jsonStringValue decodes a JSON string value; ok is false for any other
// value (or none).
func jsonStringValue(v []byte) (string, bool) {
	if len(v) == 0 || v[0] != '"' {
		return "", false
	}
	return decodeString(v), true
}

// jsonCount reads an unsigned integer written as a JSON number or as a
// decimal string; trim allows whitespace around the digits of a string
// (ports: engines report their configured port as a string).
func jsonCount(v []byte, trim bool) (uint64, bool) {
	s, ok := jsonStringValue(v)
	if !ok {
		return jsonUint(v)
	}
	if trim {
		s = strings.TrimSpace(s)
	}
	return jsonUint([]byte(s))
}

// clip renders a value for a log reason, bounded.
func clip(v []byte) string {
	if v == nil {
		return "none"
	}
	const max = 64
	if len(v) > max {
		return string(v[:max]) + "…"
	}
	return string(v)
}

func moriioMisconfigured(reason string) *apierr.Error {
	return apierr.Wrap(errors.New(reason), http.StatusServiceUnavailable, CodeMoRIIOPairMisconfigured,
		"The selected prefill/decode pair is not configured for MoRI-IO")
}

func moriioHandoffInvalid(reason string) *apierr.Error {
	return apierr.Wrap(errors.New(reason), http.StatusBadGateway, CodeMoRIIOHandoffInvalid,
		"Prefill returned no usable MoRI-IO KV handoff")
}
