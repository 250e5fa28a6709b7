package extproc

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"github.com/rs/zerolog"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/smg-project/smg-extproc/pkg/apierr"
	"github.com/smg-project/smg-extproc/pkg/metrics"
	"github.com/smg-project/smg-extproc/pkg/pairing"
	"github.com/smg-project/smg-extproc/pkg/pd"
	"github.com/smg-project/smg-extproc/pkg/policy"
	"github.com/smg-project/smg-extproc/pkg/xds"
)

// Response header names the gateway sets.
const (
	hdrRoutedWorker = "x-smg-routed-worker-id"
	hdrRequestID    = "x-request-id"
	// hdrEnvoyReply marks Envoy's local replies (set by local_reply_config).
	hdrEnvoyReply = "x-smg-envoy-reply"
)

type phase int

const (
	phaseHeaders    phase = iota // waiting for request headers
	phaseBody                    // waiting for the request body
	phaseDecodeWait              // body answered, decode in flight, no response head yet
	phaseRespBody                // response body buffered for a rewrite
	phaseDone                    // answered; waiting for Envoy to end the stream
)

type respMode int

const (
	respPass respMode = iota
	respDecodeError
	respMergeLogprobs
	respMergeStream
	respReplaceBody // rewrite Envoy's own reply body in place (x.replaceErr)
)

// exchange is one client request as seen through one ext_proc stream.
type exchange struct {
	s      *Server
	ctx    context.Context
	stream extprocv3.ExternalProcessor_ProcessServer
	log    zerolog.Logger

	phase   phase
	route   *pd.Route
	reqHdr  map[string]string // lower-cased request headers
	reqID   string
	req     *pd.Request
	pair    pairing.Pair
	prefill *prefillLeg
	// mu serialises the handler goroutine and the prefill watcher (stream
	// sends and state).
	mu sync.Mutex
	// busy is time spent in handlers; waited is the part spent waiting for
	// the prefill. busy − waited is what the gateway itself adds.
	busy, waited time.Duration
	dispatched   time.Time
	mode         respMode
	decodeStatus int
	releases     []func()
	model        string
	committed    bool
	prefillLP    []byte // prefill input_token_logprobs for a streamed merge
	attemptKey   string
	attempt      *attemptState // nil when retries are off
	seq          bool          // vLLM sequential dispatch (its own error codes)
	replaceErr   *apierr.Error
	plan         *pd.VLLMPlan
}

func newExchange(s *Server, ctx context.Context, stream extprocv3.ExternalProcessor_ProcessServer) *exchange {
	return &exchange{s: s, ctx: ctx, stream: stream, log: s.d.Log}
}

// watchPrefill answers the client as soon as the prefill fails while Envoy
// waits on the decode's head (ext_proc accepts an ImmediateResponse at any
// time); Envoy then resets the decode leg.
func (x *exchange) watchPrefill(l *prefillLeg) {
	go func() {
		select {
		case <-l.head:
		case <-x.ctx.Done():
			return
		}
		if !l.failed() {
			return
		}
		x.mu.Lock()
		defer x.mu.Unlock()
		if err := x.onPrefillFailedEarly(); err != nil {
			x.log.Debug().Err(err).Msg("prefill failure answer not sent")
		}
	}()
}

// finish runs when the stream ends: the client is gone or the response is complete.
func (x *exchange) finish() {
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.route != nil && x.busy > 0 {
		x.s.d.Metrics.GatewayProcessing.WithLabelValues(x.route.Endpoint).Observe((x.busy - x.waited).Seconds())
	}
	x.phase = phaseDone // a late prefill watcher must not answer
	if x.prefill != nil && !x.committed {
		x.prefill.abort()
	}
	if x.attempt != nil {
		x.attempt.mu.Lock()
		// Keep it while a redirect is in flight or a newer attempt owns it:
		// the next attempt's stream may start before this one's ends.
		keep := x.attempt.redirected || x.attempt.owner != x
		x.attempt.mu.Unlock()
		if !keep {
			x.s.attempts.del(x.attemptKey)
		}
	}
	for _, r := range x.releases {
		r()
	}
}

func (x *exchange) send(r *extprocv3.ProcessingResponse) error { return x.stream.Send(r) }

func (x *exchange) handle(m *extprocv3.ProcessingRequest) error {
	switch v := m.Request.(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		return x.onRequestHeaders(v.RequestHeaders)
	case *extprocv3.ProcessingRequest_RequestBody:
		return x.onRequestBody(v.RequestBody)
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		return x.onResponseHeaders(v.ResponseHeaders)
	case *extprocv3.ProcessingRequest_ResponseBody:
		return x.onResponseBody(v.ResponseBody)
	case *extprocv3.ProcessingRequest_RequestTrailers:
		return x.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{RequestTrailers: &extprocv3.TrailersResponse{}}})
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		return x.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{ResponseTrailers: &extprocv3.TrailersResponse{}}})
	}
	return nil
}

func (x *exchange) onRequestHeaders(h *extprocv3.HttpHeaders) error {
	x.reqHdr = make(map[string]string, len(h.GetHeaders().GetHeaders()))
	for _, hv := range h.GetHeaders().GetHeaders() {
		v := string(hv.RawValue)
		if v == "" {
			v = hv.Value
		}
		x.reqHdr[strings.ToLower(hv.Key)] = v
	}
	path := x.reqHdr[":path"]
	if i := strings.IndexByte(path, '?'); i >= 0 {
		x.resumeAttempt(path[i+1:])
		path = path[:i]
	}
	route, ok := pd.LookupRoute(path)
	if !ok {
		// Envoy sends only PD routes here; anything else is a configuration error.
		x.route = &pd.Route{ClientPath: path, Endpoint: "other", IDPrefix: "req-"}
		x.reqID = pd.RequestID(x.route, x.getHdr)
		return x.reject(apierr.Newf(404, apierr.CodeNotFound, "No route for %s", path))
	}
	x.route = route
	x.reqID = pd.RequestID(route, x.getHdr)
	if x.attempt != nil && x.attempt.reqID != "" {
		x.reqID = x.attempt.reqID // a retry keeps the client request's id
	}
	x.log = x.s.d.Log.With().Str("request_id", x.reqID).Str("route", route.ClientPath).Logger()
	if h.EndOfStream {
		return x.reject(apierr.New(400, apierr.CodeInvalidJSON, "Failed to parse the request body as JSON: empty body"))
	}
	if cl, err := strconv.ParseInt(x.reqHdr["content-length"], 10, 64); err == nil && cl > x.s.d.MaxPayloadSize {
		return x.reject(tooLarge(x.s.d.MaxPayloadSize))
	}
	x.phase = phaseBody
	return x.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{
		RequestHeaders: &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{HeaderMutation: x.allowlistMutation()}},
	}})
}

// resumeAttempt links a redirected request to its earlier attempts. Only keys
// the gateway minted resolve, so a client-sent parameter changes nothing.
func (x *exchange) resumeAttempt(query string) {
	for _, kv := range strings.Split(query, "&") {
		k, v, _ := strings.Cut(kv, "=")
		if k != attemptParam {
			continue
		}
		if st := x.s.attempts.get(v); st != nil {
			st.mu.Lock()
			st.redirected = false
			st.recorded = false
			st.owner = x
			st.mu.Unlock()
			x.attempt, x.attemptKey = st, v
		}
		return
	}
}

func tooLarge(limit int64) *apierr.Error {
	return apierr.Newf(413, apierr.CodePayloadTooLarge, "Request body exceeds the maximum payload size of %d bytes", limit)
}

func (x *exchange) getHdr(name string) string { return x.reqHdr[name] }

// allowlistMutation removes every client header SMG would not forward to a leg.
func (x *exchange) allowlistMutation() *extprocv3.HeaderMutation {
	var rm []string
	for k := range x.reqHdr {
		// x-forwarded-proto is Envoy's own and its internal redirects (retries) need it.
		if strings.HasPrefix(k, ":") || k == "host" || k == "content-length" || k == "transfer-encoding" || k == "x-forwarded-proto" || pd.ForwardHeader(k) {
			continue
		}
		rm = append(rm, k)
	}
	return &extprocv3.HeaderMutation{RemoveHeaders: rm}
}

// legHeaders are the headers the gateway's own legs carry.
func (x *exchange) legHeaders() http.Header {
	h := make(http.Header, 4)
	for k, v := range x.reqHdr {
		if !strings.HasPrefix(k, ":") && pd.ForwardHeader(k) {
			h[http.CanonicalHeaderKey(k)] = []string{v}
		}
	}
	h.Set("Content-Type", "application/json")
	// An explicit empty User-Agent stops Go from adding its own: legs carry only the allowlist.
	h["User-Agent"] = []string{""}
	return h
}

func (x *exchange) onRequestBody(b *extprocv3.HttpBody) error {
	if x.phase != phaseBody {
		return nil // duplicate end-of-stream chunks are ignored
	}
	if !b.EndOfStream {
		// BUFFERED mode delivers one message; a partial one means misconfiguration.
		return x.reject(apierr.New(500, apierr.CodeInternal, "ext_proc received a partial request body; request_body_mode must be BUFFERED"))
	}
	d := x.s.d
	if int64(len(b.Body)) > d.MaxPayloadSize {
		return x.reject(tooLarge(d.MaxPayloadSize))
	}
	req, err := pd.ParseRequest(x.route, b.Body)
	if err != nil {
		d.Metrics.RouterRequests.WithLabelValues("http", "pd", "http", "unknown", x.route.Endpoint, "false").Inc()
		return x.reject(asAPIError(err, 400, apierr.CodeInvalidRequest))
	}
	x.req = req
	x.model = req.Model
	if x.model == "" {
		x.model = "unknown"
	}
	if x.attempt == nil { // one count per client request, not per retry attempt
		d.Metrics.RouterRequests.WithLabelValues("http", "pd", "http", x.model, x.route.Endpoint, strconv.FormatBool(req.Stream)).Inc()
	}
	preq := policy.Request{Text: req.Text, RoutingKey: x.reqHdr["x-smg-routing-key"],
		TargetWorker: x.reqHdr["x-smg-target-worker"], Authorization: x.reqHdr["authorization"],
		ForwardedFor: x.reqHdr["x-forwarded-for"], Cookie: x.reqHdr["cookie"], Model: req.Model}
	// The pair index follows membership; Sync is one pointer compare when nothing changed.
	d.Selector.Sync(d.Registry.Snapshot)
	if x.route.PrefillOnly {
		return x.countTokens(preq)
	}
	pair, aerr := d.Selector.SelectPair(preq)
	if aerr != nil {
		x.log.Warn().Str("code", aerr.Code).Msg(aerr.Message)
		return x.reject(aerr)
	}
	x.pair = pair
	d.Metrics.WorkerSelection.WithLabelValues("prefill", "http", x.model, d.Selector.Prefill.Name()).Inc()
	d.Metrics.WorkerSelection.WithLabelValues("decode", "http", x.model, d.Selector.Decode.Name()).Inc()
	if sequentialPair(pair) {
		return x.sequential(req)
	}

	n := 1
	if req.BatchSize > 0 {
		n = req.BatchSize
	}
	rooms, err := pd.MintRooms(n)
	if err != nil {
		return x.reject(apierr.Wrap(err, 500, apierr.CodeInternal, "Failed to mint bootstrap room"))
	}
	pBody, dBody, err := pd.BuildLegs(req, pd.Bootstrap{Host: pair.Prefill.BootstrapHost, Port: pair.Prefill.BootstrapPort, Rooms: rooms},
		pd.DPRanks{Prefill: pair.Prefill.DPRank, Decode: pair.Decode.DPRank})
	if err != nil {
		d.Metrics.PDBootstrapFail.Inc()
		return x.reject(apierr.Wrap(err, 500, apierr.CodeSerializationFailed, "Failed to serialize request"))
	}
	x.log.Debug().Str("prefill", pair.Prefill.URL).Str("decode", pair.Decode.URL).Uints64("rooms", rooms).Msg("pair selected")

	x.acquire(pair.Decode)
	prefillRelease := d.active(pair.Prefill)
	runtime := pair.Prefill.Runtime
	model := x.model
	// Non-streamed requests and logprob merges wait for the whole prefill body.
	keepBody := req.Logprobs
	x.dispatched = time.Now()
	x.prefill = startPrefill(x.ctx, d.Client, pair.Prefill.BaseURL+x.route.UpstreamPath, x.legHeaders(), pBody,
		d.RequestTimeout, keepBody, func(l *prefillLeg) {
			if st, terr, ok := l.outcome(); ok {
				d.record(pair.Prefill, "prefill", st, terr)
			}
			prefillRelease()
			if !l.failed() {
				d.Metrics.PDPrefillDuration.WithLabelValues("pd", model, runtime).Observe(time.Since(l.started).Seconds())
			}
		})
	x.watchPrefill(x.prefill)
	x.phase = phaseDecodeWait

	return x.releaseDecode(dBody)
}

// nsValue is one metadata namespace holding a single string key.
func nsValue(k, v string) *structpb.Value {
	return structpb.NewStructValue(&structpb.Struct{Fields: map[string]*structpb.Value{k: structpb.NewStringValue(v)}})
}

// releaseDecode answers the request-body phase: Envoy sends dBody to the
// chosen decode (named in envoy.lb metadata) on the upstream route.
func (x *exchange) releaseDecode(dBody []byte) error {
	d := x.s.d
	pair := x.pair
	// Built directly: structpb.NewStruct would walk two map[string]any per request.
	md := &structpb.Struct{Fields: map[string]*structpb.Value{
		xds.MetadataNamespace: nsValue(xds.MetadataKey, pair.Decode.Addr),
	}}
	if !d.Retry.Disabled {
		if x.attempt == nil {
			x.attemptKey = newAttemptKey()
			x.attempt = &attemptState{authority: x.reqHdr[":authority"], path: x.route.ClientPath, owner: x, reqID: x.reqID}
			x.s.attempts.put(x.attemptKey, x.attempt)
		}
		x.attempt.mu.Lock()
		x.attempt.attempts++
		x.attempt.decode = pair.Decode
		x.attempt.expires = time.Now().Add(2*d.RequestTimeout + time.Minute)
		x.attempt.mu.Unlock()
		md.Fields[MetadataNamespace] = nsValue(mdAttemptKey, x.attemptKey)
	}
	set := []*corev3.HeaderValueOption{
		hv(":path", x.route.UpstreamPath),
		hv("content-type", "application/json"),
		hv("content-length", strconv.Itoa(len(dBody))),
	}
	if d.DestinationHeader {
		set = append(set, hv(xds.MetadataKey, pair.Decode.Addr))
	}
	return x.send(&extprocv3.ProcessingResponse{
		Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{
			HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: set},
			BodyMutation:   &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: dBody}},
		}}},
		DynamicMetadata: md,
	})
}

func (x *exchange) acquire(w *workersT) {
	x.releases = append(x.releases, x.s.d.active(w))
}

// onPrefillFailedEarly answers with the prefill's error while the decode head
// has not arrived; Envoy then resets the decode leg.
func (x *exchange) onPrefillFailedEarly() error {
	if x.phase != phaseDecodeWait || !x.prefill.failed() {
		return nil
	}
	if x.seq {
		return x.reject(x.seqPrefillError())
	}
	return x.reject(x.prefillError())
}

func (x *exchange) prefillError() *apierr.Error {
	st, body, err := x.prefill.result()
	if err != nil {
		x.log.Warn().Err(err).Str("prefill", x.pair.Prefill.URL).Msg("prefill transport error")
		return pd.TransportError(err)
	}
	e := pd.PrefillError(st, body)
	x.log.Warn().Int("status", st).Str("prefill", x.pair.Prefill.URL).Str("code", e.Code).Msg("prefill failed")
	return e
}

func (x *exchange) onResponseHeaders(h *extprocv3.HttpHeaders) error {
	if x.phase != phaseDecodeWait {
		return x.send(headersContinue(nil))
	}
	st, envoyReply := 0, false
	for _, hv := range h.GetHeaders().GetHeaders() {
		switch hv.Key {
		case ":status":
			v := string(hv.RawValue)
			if v == "" {
				v = hv.Value
			}
			st, _ = strconv.Atoi(v)
		case hdrEnvoyReply:
			envoyReply = true
		}
	}
	x.decodeStatus = st
	recorded := false
	if x.attempt != nil {
		x.attempt.mu.Lock()
		recorded = x.attempt.recorded
		x.attempt.mu.Unlock()
	}
	if envoyReply {
		// Envoy answered itself (decode unreachable, timed out, ...), already
		// in SMG's error format: count a failed decode leg, drop the prefill.
		if !recorded {
			x.s.d.record(x.pair.Decode, "decode", st, true)
		}
		if x.seq && st == 502 && !h.EndOfStream {
			// vLLM's code for a decode that could not be reached: rewrite
			// Envoy's reply in place (a second local reply would be re-mapped).
			if x.prefill != nil {
				x.prefill.abort()
			}
			x.replaceErr = pd.DecodeRequestError(fmt.Errorf("decode %s unreachable (Envoy answered %d)", x.pair.Decode.URL, st))
			x.mode, x.phase = respReplaceBody, phaseRespBody
			x.countError(st)
			return x.send(&extprocv3.ProcessingResponse{
				Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{
					Response: &extprocv3.CommonResponse{HeaderMutation: &extprocv3.HeaderMutation{
						SetHeaders: []*corev3.HeaderValueOption{hv(hdrRequestID, x.reqID)}, RemoveHeaders: []string{hdrEnvoyReply},
					}},
				}},
				ModeOverride: &filterv3.ProcessingMode{ResponseBodyMode: filterv3.ProcessingMode_BUFFERED, ResponseHeaderMode: filterv3.ProcessingMode_SEND},
			})
		}
		x.phase = phaseDone
		x.prefill.abort()
		x.countError(st)
		x.log.Warn().Int("status", st).Str("decode", x.pair.Decode.URL).Msg("decode leg failed in Envoy")
		return x.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{
			Response: &extprocv3.CommonResponse{HeaderMutation: &extprocv3.HeaderMutation{
				SetHeaders: []*corev3.HeaderValueOption{hv(hdrRequestID, x.reqID)}, RemoveHeaders: []string{hdrEnvoyReply},
			}},
		}}})
	}
	if !recorded { // the per-try processor records each try itself
		x.s.d.record(x.pair.Decode, "decode", st, false)
	}
	d := x.s.d
	if st < 200 || st > 299 {
		// Decode errors win over prefill errors (SMG order). Buffer the body to rewrite it.
		if h.EndOfStream {
			return x.decodeErrorReply(nil)
		}
		x.mode = respDecodeError
		x.phase = phaseRespBody
		return x.send(&extprocv3.ProcessingResponse{
			Response:     &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{}},
			ModeOverride: &filterv3.ProcessingMode{ResponseBodyMode: filterv3.ProcessingMode_BUFFERED, ResponseHeaderMode: filterv3.ProcessingMode_SEND},
		})
	}
	d.Metrics.PDTTFT.WithLabelValues("pd", x.model, x.pair.Prefill.Runtime).Observe(time.Since(x.dispatched).Seconds())
	if x.prefill != nil {
		if err := x.awaitPrefill(); err != nil || x.phase == phaseDone {
			return err
		}
	}
	x.committed = true
	if x.prefill != nil {
		x.prefill.detach()
	}
	d.Metrics.RouterDuration.WithLabelValues("http", "pd", "http", x.model, x.route.Endpoint).Observe(time.Since(x.dispatched).Seconds())
	set := []*corev3.HeaderValueOption{hv(hdrRoutedWorker, x.pair.Decode.URL), hv(hdrRequestID, x.reqID)}
	if x.req.Stream {
		set = append(set, hv("content-type", "text/event-stream"))
	}
	resp := &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{
		Response: &extprocv3.CommonResponse{HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: set}},
	}}}
	switch {
	case x.req.Logprobs && !x.seq && !x.req.Stream && !h.EndOfStream:
		x.mode = respMergeLogprobs
		x.phase = phaseRespBody
		resp.ModeOverride = &filterv3.ProcessingMode{ResponseBodyMode: filterv3.ProcessingMode_BUFFERED, ResponseHeaderMode: filterv3.ProcessingMode_SEND}
	case x.req.Logprobs && !x.seq && x.req.Stream && !h.EndOfStream && x.streamMergeSource() != nil:
		// Only a prefill that answered one JSON document (not SSE) has logprobs to prepend.
		x.mode = respMergeStream
		x.phase = phaseRespBody
		resp.ModeOverride = &filterv3.ProcessingMode{ResponseBodyMode: filterv3.ProcessingMode_STREAMED, ResponseHeaderMode: filterv3.ProcessingMode_SEND}
	default:
		x.phase = phaseDone
	}
	return x.send(resp)
}

func (x *exchange) streamMergeSource() []byte {
	x.prefill.mu.Lock()
	body := x.prefill.body
	x.prefill.mu.Unlock()
	x.prefillLP = pd.PrefillLogprobs(body)
	return x.prefillLP
}

// awaitPrefill waits, at the decode's 2xx head, for what the answer needs
// from the prefill: its head (streams without logprobs) or its whole body.
// It answers the client itself (phase done) when the prefill failed.
func (x *exchange) awaitPrefill() error {
	wait := x.prefill.done
	if x.req.Stream && !x.req.Logprobs && x.plan == nil {
		wait = x.prefill.head
	}
	t0 := time.Now()
	select {
	case <-wait:
	case <-x.ctx.Done():
		x.phase = phaseDone
		return nil
	}
	x.waited += time.Since(t0)
	<-x.prefill.head
	if x.prefill.failed() {
		if x.seq {
			return x.reject(x.seqPrefillError())
		}
		return x.reject(x.prefillError())
	}
	if wait != x.prefill.done {
		return nil
	}
	x.prefill.mu.Lock()
	body, berr := x.prefill.body, x.prefill.bodyErr
	x.prefill.mu.Unlock()
	if x.plan != nil { // MoRI-IO concurrent WRITE: release the decode's answer only on a valid handoff
		if berr != nil {
			return x.reject(pd.PrefillReadError(berr))
		}
		if _, _, err := x.plan.DecodeAfterPrefill(body); err != nil {
			x.s.d.Metrics.PDKVTransferFail.Inc()
			x.log.Warn().Err(err).Msg("prefill handoff rejected; dropping the decode leg")
			return x.reject(asAPIError(err, 502, pd.CodeMoRIIOHandoffInvalid))
		}
		return nil
	}
	if berr != nil {
		x.log.Warn().Err(berr).Msg("prefill body read failed; continuing with the decode response")
	}
	return nil
}

func (x *exchange) onResponseBody(b *extprocv3.HttpBody) error {
	if x.phase == phaseRespBody && x.mode == respMergeStream {
		out := pd.MergeLogprobsChunk(x.prefillLP, b.Body)
		return x.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: &extprocv3.BodyResponse{
			Response: &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: out}}},
		}}})
	}
	if x.phase != phaseRespBody || !b.EndOfStream {
		return x.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: &extprocv3.BodyResponse{}}})
	}
	switch x.mode {
	case respReplaceBody:
		x.phase = phaseDone
		e := x.replaceErr
		out := e.Body()
		return x.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: &extprocv3.BodyResponse{
			Response: &extprocv3.CommonResponse{
				HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{
					hv("content-type", "application/json"), hv("content-length", strconv.Itoa(len(out))), hv(apierr.HeaderErrorCode, e.Code),
				}},
				BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: out}},
			},
		}}})
	case respDecodeError:
		return x.decodeErrorReply(b.Body)
	case respMergeLogprobs:
		x.phase = phaseDone
		x.prefill.mu.Lock()
		pbody := x.prefill.body
		x.prefill.mu.Unlock()
		out := b.Body
		if merged, ok := pd.MergeLogprobs(pbody, b.Body); ok {
			out = merged
		}
		return x.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: &extprocv3.BodyResponse{
			Response: &extprocv3.CommonResponse{
				HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{
					hv("content-type", "application/json"), hv("content-length", strconv.Itoa(len(out))),
				}},
				BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: out}},
			},
		}}})
	}
	return x.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: &extprocv3.BodyResponse{}}})
}

// decodeErrorReply turns a decode non-2xx into SMG's answer.
func (x *exchange) decodeErrorReply(body []byte) error {
	st := x.decodeStatus
	x.log.Warn().Int("status", st).Str("decode", x.pair.Decode.URL).Msg("decode returned an error")
	if x.prefill != nil {
		x.prefill.abort()
	}
	if x.req != nil && x.req.Stream {
		x.phase = phaseDone
		x.countError(st)
		return x.send(immediate(st, x.commonHeaders("text/event-stream", ""), pd.DecodeStreamErrorFrame(st, body), "smg_decode_stream_error"))
	}
	return x.reject(pd.DecodeError(st, body))
}

// countTokens sends the request to one prefill and relays its answer as is.
func (x *exchange) countTokens(preq policy.Request) error {
	d := x.s.d
	w, aerr := d.Selector.SelectPrefill(preq)
	if aerr != nil {
		return x.reject(aerr)
	}
	release := w.Acquire()
	defer release()
	hdr := x.legHeaders()
	if hdr.Get("Authorization") == "" && w.APIKey != "" {
		hdr.Set("Authorization", "Bearer "+w.APIKey)
	}
	ctx, cancel := context.WithTimeout(x.ctx, d.RequestTimeout)
	defer cancel()
	st, rh, body, err := doPost(ctx, d.Client, w.BaseURL+x.route.UpstreamPath, hdr, x.req.Raw)
	if err != nil {
		x.log.Warn().Err(err).Str("prefill", w.URL).Msg("count_tokens failed")
		return x.reject(apierr.Wrap(err, 502, apierr.CodeCountTokensFailed, "Failed to count tokens on prefill worker: "+err.Error()))
	}
	ct := rh.Get("Content-Type")
	if ct == "" {
		ct = "application/json"
	}
	x.phase = phaseDone
	h := x.commonHeaders(ct, "")
	h.SetHeaders = append(h.SetHeaders, hv(hdrRoutedWorker, w.URL))
	return x.send(immediate(st, h, body, "smg_count_tokens"))
}

// reject answers the client with an SMG error and ends processing.
func (x *exchange) reject(e *apierr.Error) error {
	x.phase = phaseDone
	if x.prefill != nil && !x.committed {
		x.prefill.abort()
	}
	x.countError(e.Status)
	h := x.commonHeaders("application/json", e.Code)
	if e.RetryAfter > 0 {
		h.SetHeaders = append(h.SetHeaders, hv("retry-after", strconv.Itoa(e.RetryAfter)))
	}
	return x.send(immediate(e.Status, h, e.Body(), "smg_"+strings.ReplaceAll(e.Code, " ", "_")))
}

func (x *exchange) countError(status int) {
	if x.route == nil {
		return
	}
	model := x.model
	if model == "" {
		model = "unknown"
	}
	x.s.d.Metrics.RouterErrors.WithLabelValues("http", "pd", "http", model, x.route.Endpoint, metrics.ErrorType(status)).Inc()
}

func (x *exchange) commonHeaders(contentType, code string) *extprocv3.HeaderMutation {
	set := []*corev3.HeaderValueOption{hv("content-type", contentType)}
	if x.reqID != "" {
		set = append(set, hv(hdrRequestID, x.reqID))
	}
	if code != "" && apierr.HeaderSafe(code) {
		set = append(set, hv(apierr.HeaderErrorCode, code))
	}
	return &extprocv3.HeaderMutation{SetHeaders: set}
}

func immediate(status int, h *extprocv3.HeaderMutation, body []byte, details string) *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ImmediateResponse{ImmediateResponse: &extprocv3.ImmediateResponse{
		Status:  &typev3.HttpStatus{Code: typev3.StatusCode(status)},
		Headers: h,
		Body:    body,
		Details: details,
	}}}
}

func headersContinue(m *extprocv3.HeaderMutation) *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{
		Response: &extprocv3.CommonResponse{HeaderMutation: m},
	}}}
}

func hv(k, v string) *corev3.HeaderValueOption {
	return &corev3.HeaderValueOption{
		Header:       &corev3.HeaderValue{Key: k, RawValue: []byte(v)},
		AppendAction: corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD,
	}
}
