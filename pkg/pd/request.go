package pd

import (
	"bytes"
	"fmt"
	"math"
	"net/http"
	"strings"

	"github.com/smg-project/smg-extproc/pkg/apierr"
)

// MaxBatchSize caps list-valued bootstrap fields. Without it a small body
// (chat "n": 1e9, or millions of one-token prompts) would make us emit
// ~40 bytes of bootstrap lists per element on each leg. Deliberate
// deviation: SMG has no cap.
const MaxBatchSize = 65536

// Request is what routing needs from a client body. Raw is the client's bytes, untouched.
type Request struct {
	Route *Route
	Raw   []byte
	// Stream is top-level "stream": true (always false on NeverStream routes).
	Stream bool
	// BatchSize is 0 for scalar bootstrap fields, else the length of the
	// list-valued ones: /generate input_ids list of lists, or (deliberate
	// deviation from SMG, matching SGLang's mini_lb) a /generate text list;
	// chat n > 1; completions prompt list of strings or of token lists
	// (a list of ints is one prompt, and n is ignored as in SMG).
	BatchSize int
	// Logprobs is true only where the prefill logprobs can be merged:
	// /generate with return_logprob == true. OpenAI-shaped logprobs are
	// never merged, so chat/completions keep it false.
	Logprobs bool
	N        int    // top-level n on chat/completions, default 1
	Model    string // top-level model, "" if absent
	// Text is the request text for text-based policies: /generate text
	// (first element of a list), chat message texts joined by spaces,
	// completions prompt or its first element, messages/responses texts
	// joined by spaces, rerank query.
	Text string

	lay layout
}

// Owned keys are the top-level keys BuildLegs may write.
const (
	ownHost = iota
	ownPort
	ownRoom
	ownRoutedRank
	ownPrefillRank
	ownModel
	numOwned
)

var ownedNames = [numOwned]string{
	ownHost:        "bootstrap_host",
	ownPort:        "bootstrap_port",
	ownRoom:        "bootstrap_room",
	ownRoutedRank:  "routed_dp_rank",
	ownPrefillRank: "disagg_prefill_dp_rank",
	ownModel:       "model",
}

// span is a byte range; e == 0 means unset (no JSON value ends at offset 0).
type span struct{ s, e int }

func (p span) set() bool { return p.e != 0 }

// layout remembers where the owned keys sit so BuildLegs can splice without
// rescanning a body that may be megabytes long.
type layout struct {
	ok     bool
	empty  bool // the object has no members
	dup    bool // an owned key occurs twice: BuildLegs uses the general editor
	insert int  // where appended members go: end of the last value, or after '{'
	own    [numOwned]span
}

// Interpreted fields; the last occurrence wins, as in the engines' parsers.
const (
	fStream = iota
	fN
	fModel
	fReturnLogprob
	fMessages
	fInputIDs
	fText
	fPrompt
	fInput
	fQuery
	numFields
)

func jsonError(err error) *apierr.Error {
	return apierr.Wrap(err, http.StatusBadRequest, apierr.CodeInvalidJSON,
		"Failed to parse the request body as JSON: "+err.Error())
}

func invalidRequest(format string, args ...any) *apierr.Error {
	return apierr.Newf(http.StatusBadRequest, apierr.CodeInvalidRequest, format, args...)
}

// ParseRequest validates body as JSON (one linear pass, UTF-8 checked) and
// scans the fields routing needs. Errors are *apierr.Error with status 400:
// json_parse_error for empty or malformed bodies, invalid_request for a
// non-object body or a wrongly typed field the gateway interprets.
func ParseRequest(route *Route, body []byte) (*Request, error) {
	if route == nil {
		return nil, apierr.New(http.StatusInternalServerError, apierr.CodeInternal, "pd: ParseRequest called without a route")
	}
	if len(body) == 0 {
		return nil, jsonError(errAt("empty body", 0))
	}
	open := skipWS(body, 0)
	if open >= len(body) {
		return nil, jsonError(errEOF(open))
	}
	if body[open] != '{' {
		if err := checkDoc(body); err != nil {
			return nil, jsonError(err)
		}
		return nil, invalidRequest("Request body must be a JSON object")
	}

	req := &Request{Route: route, Raw: body, N: 1}
	lay := &req.lay
	lay.insert = open + 1
	own := func(o int, m member) {
		if lay.own[o].set() {
			lay.dup = true
			return
		}
		lay.own[o] = span{m.vs, m.ve}
	}
	var f [numFields]span
	it := newObjIter(body, open)
	for it.next() {
		m := it.m
		lay.insert = m.ve
		switch string(m.keyBytes(body)) {
		case "stream":
			f[fStream] = span{m.vs, m.ve}
		case "n":
			f[fN] = span{m.vs, m.ve}
		case "model":
			f[fModel] = span{m.vs, m.ve}
			own(ownModel, m)
		case "return_logprob":
			f[fReturnLogprob] = span{m.vs, m.ve}
		case "messages":
			f[fMessages] = span{m.vs, m.ve}
		case "input_ids":
			f[fInputIDs] = span{m.vs, m.ve}
		case "text":
			f[fText] = span{m.vs, m.ve}
		case "prompt":
			f[fPrompt] = span{m.vs, m.ve}
		case "input":
			f[fInput] = span{m.vs, m.ve}
		case "query":
			f[fQuery] = span{m.vs, m.ve}
		case "bootstrap_host":
			own(ownHost, m)
		case "bootstrap_port":
			own(ownPort, m)
		case "bootstrap_room":
			own(ownRoom, m)
		case "routed_dp_rank":
			own(ownRoutedRank, m)
		case "disagg_prefill_dp_rank":
			own(ownPrefillRank, m)
		}
	}
	if it.err != nil {
		return nil, jsonError(it.err)
	}
	if j := skipWS(body, it.end); j != len(body) {
		return nil, jsonError(errChar(body[j], "after top-level value", j))
	}
	lay.empty = it.n == 0
	lay.ok = true

	if err := req.interpret(&f); err != nil {
		return nil, err
	}
	return req, nil
}

// interpret applies the route's schema to the recorded field spans.
func (req *Request) interpret(f *[numFields]span) error {
	b := req.Raw
	val := func(i int) []byte { return b[f[i].s:f[i].e] }

	if f[fModel].set() {
		switch v := val(fModel); v[0] {
		case '"':
			req.Model = decodeString(v)
		case 'n':
		default:
			return invalidRequest("model must be a string")
		}
	}
	if !req.Route.NeverStream && f[fStream].set() {
		v, ok := optBool(val(fStream))
		if !ok {
			return invalidRequest("stream must be a boolean")
		}
		req.Stream = v
	}

	var pieceBuf [16]span
	pieces := pieceBuf[:0]
	var err error
	switch req.Route.kind() {
	case kindGenerate:
		if f[fReturnLogprob].set() {
			v, ok := optBool(val(fReturnLogprob))
			if !ok {
				return invalidRequest("return_logprob must be a boolean")
			}
			req.Logprobs = v
		}
		if pieces, err = req.scanGenerate(f, pieces); err != nil {
			return err
		}
	case kindChat:
		if err := req.scanN(f); err != nil {
			return err
		}
		if req.N > 1 {
			req.BatchSize = req.N
		}
		if pieces, err = messagesText(b, f[fMessages], pieces, true); err != nil {
			return err
		}
	case kindCompletions:
		if err := req.scanN(f); err != nil {
			return err
		}
		if pieces, err = req.scanPrompt(f, pieces); err != nil {
			return err
		}
	case kindMessages, kindCountTokens:
		if pieces, err = messagesText(b, f[fMessages], pieces, false); err != nil {
			return err
		}
	case kindResponses:
		if pieces, err = responsesText(b, f[fInput], pieces); err != nil {
			return err
		}
	case kindRerank:
		if f[fQuery].set() {
			switch v := val(fQuery); v[0] {
			case '"':
				pieces = appendPiece(pieces, f[fQuery])
			case 'n':
			default:
				return invalidRequest("query must be a string")
			}
		}
	}
	if req.BatchSize > MaxBatchSize {
		return invalidRequest("batch size %d exceeds the maximum of %d", req.BatchSize, MaxBatchSize)
	}
	req.Text = joinPieces(b, pieces)
	return nil
}

func (req *Request) scanN(f *[numFields]span) error {
	if !f[fN].set() {
		return nil
	}
	v := req.Raw[f[fN].s:f[fN].e]
	if string(v) == "null" {
		return nil
	}
	n, ok := positiveInt(v)
	if !ok {
		return invalidRequest("n must be a positive integer")
	}
	req.N = n
	return nil
}

// scanGenerate finds the /generate batch size and text.
func (req *Request) scanGenerate(f *[numFields]span, pieces []span) ([]span, error) {
	b := req.Raw
	if s := f[fInputIDs]; s.set() {
		switch b[s.s] {
		case 'n':
		case '[':
			if first := skipWS(b, s.s+1); b[first] == '[' {
				n, err := countElems(b, s.s, '[')
				if err != nil {
					return nil, invalidRequest("input_ids must be a list of integers or a list of integer lists")
				}
				req.BatchSize = n
			}
		default:
			return nil, invalidRequest("input_ids must be an array")
		}
	}
	if s := f[fText]; s.set() {
		switch b[s.s] {
		case 'n':
		case '"':
			pieces = appendPiece(pieces, s)
		case '[':
			n, err := countElems(b, s.s, '"')
			if err != nil {
				return nil, invalidRequest("text must be a string or an array of strings")
			}
			if n > 0 {
				pieces = appendPiece(pieces, firstElem(b, s.s))
				if req.BatchSize == 0 {
					req.BatchSize = n
				}
			}
		default:
			return nil, invalidRequest("text must be a string or an array of strings")
		}
	}
	return pieces, nil
}

// scanPrompt finds the completions batch size and text.
func (req *Request) scanPrompt(f *[numFields]span, pieces []span) ([]span, error) {
	s := f[fPrompt]
	if !s.set() {
		return pieces, nil
	}
	b := req.Raw
	const msg = "prompt must be a string, an array of strings, an array of integers, or an array of integer arrays"
	switch b[s.s] {
	case 'n':
	case '"':
		pieces = appendPiece(pieces, s)
	case '[':
		first := skipWS(b, s.s+1)
		switch c := b[first]; {
		case c == ']':
		case c == '"' || c == '[':
			n, err := countElems(b, s.s, c)
			if err != nil {
				return nil, invalidRequest(msg)
			}
			req.BatchSize = n
			if c == '"' {
				pieces = appendPiece(pieces, firstElem(b, s.s))
			}
		case c == '-' || isDigit(c):
			if _, err := countElems(b, s.s, '0'); err != nil {
				return nil, invalidRequest(msg)
			}
		default:
			return nil, invalidRequest(msg)
		}
	default:
		return nil, invalidRequest(msg)
	}
	return pieces, nil
}

// countElems counts the elements of the (validated) array at b[open] and
// checks they all start with kind: '"' strings, '[' arrays, '0' numbers.
func countElems(b []byte, open int, kind byte) (int, error) {
	it := trustedArrIter(b, open)
	for it.next() {
		c := b[it.vs]
		if kind == '0' {
			if c != '-' && !isDigit(c) {
				return 0, errAt("mixed element types", it.vs)
			}
		} else if c != kind {
			return 0, errAt("mixed element types", it.vs)
		}
	}
	return it.n, it.err
}

// firstElem returns the span of the first element of a non-empty array.
func firstElem(b []byte, open int) span {
	it := trustedArrIter(b, open)
	it.next()
	return span{it.vs, it.ve}
}

// optBool accepts true, false and null (false).
func optBool(v []byte) (val, ok bool) {
	switch string(v) {
	case "true":
		return true, true
	case "false", "null":
		return false, true
	}
	return false, false
}

// positiveInt parses a JSON integer literal in [1, 2^31-1]. Fractions and
// exponents are refused rather than rounded (serde refuses them for SMG's
// u32 too); the digits are read directly, never through float64.
func positiveInt(v []byte) (int, bool) {
	if len(v) == 0 || len(v) > 10 {
		return 0, false
	}
	var n int64
	for _, c := range v {
		if !isDigit(c) {
			return 0, false
		}
		n = n*10 + int64(c-'0')
	}
	if n < 1 || n > math.MaxInt32 {
		return 0, false
	}
	return int(n), true
}

// appendPiece records the contents (without quotes) of the string value at
// sp if it is non-empty.
func appendPiece(pieces []span, sp span) []span {
	if sp.e-sp.s > 2 {
		pieces = append(pieces, span{sp.s + 1, sp.e - 1})
	}
	return pieces
}

// joinPieces decodes the string pieces joined by single spaces with one
// allocation: unescaping never makes a JSON string longer.
func joinPieces(b []byte, pieces []span) string {
	switch len(pieces) {
	case 0:
		return ""
	case 1:
		if raw := b[pieces[0].s:pieces[0].e]; bytes.IndexByte(raw, '\\') < 0 {
			return string(raw)
		}
	}
	n := len(pieces) - 1
	for _, p := range pieces {
		n += p.e - p.s
	}
	var sb strings.Builder
	sb.Grow(n)
	for i, p := range pieces {
		if i > 0 {
			sb.WriteByte(' ')
		}
		unescapeTo(&sb, b[p.s:p.e])
	}
	return sb.String()
}

// decodeString decodes a validated JSON string literal (with quotes).
func decodeString(raw []byte) string {
	inner := raw[1 : len(raw)-1]
	if bytes.IndexByte(inner, '\\') < 0 {
		return string(inner)
	}
	var sb strings.Builder
	sb.Grow(len(inner))
	unescapeTo(&sb, inner)
	return sb.String()
}

// stringIs reports whether the JSON value raw is the string want.
func stringIs(raw []byte, want ...string) bool {
	if len(raw) < 2 || raw[0] != '"' {
		return false
	}
	inner := raw[1 : len(raw)-1]
	if bytes.IndexByte(inner, '\\') >= 0 {
		inner = []byte(decodeString(raw))
	}
	for _, w := range want {
		if string(inner) == w {
			return true
		}
	}
	return false
}

// messagesText collects chat/Anthropic message texts: string contents,
// "text" parts of array contents and (chat) assistant reasoning_content.
func messagesText(b []byte, s span, pieces []span, chat bool) ([]span, error) {
	if !s.set() {
		return pieces, nil
	}
	if b[s.s] != '[' {
		return nil, invalidRequest("messages must be an array")
	}
	it := trustedArrIter(b, s.s)
	for it.next() {
		if b[it.vs] != '{' {
			continue
		}
		var content, reasoning span
		mi := trustedObjIter(b, it.vs)
		for mi.next() {
			switch string(mi.m.keyBytes(b)) {
			case "content":
				content = span{mi.m.vs, mi.m.ve}
			case "reasoning_content":
				if chat {
					reasoning = span{mi.m.vs, mi.m.ve}
				}
			}
		}
		pieces = contentText(b, content, pieces, "text", "text")
		if reasoning.set() && b[reasoning.s] == '"' {
			pieces = appendPiece(pieces, reasoning)
		}
	}
	return pieces, it.err
}

// responsesText collects /v1/responses input text: a string input, or the
// string contents and input_text/output_text parts of input items.
func responsesText(b []byte, s span, pieces []span) ([]span, error) {
	if !s.set() {
		return pieces, nil
	}
	switch b[s.s] {
	case 'n':
		return pieces, nil
	case '"':
		return appendPiece(pieces, s), nil
	case '[':
	default:
		return nil, invalidRequest("input must be a string or an array")
	}
	it := trustedArrIter(b, s.s)
	for it.next() {
		if b[it.vs] != '{' {
			continue
		}
		var content span
		mi := trustedObjIter(b, it.vs)
		for mi.next() {
			if string(mi.m.keyBytes(b)) == "content" {
				content = span{mi.m.vs, mi.m.ve}
			}
		}
		pieces = contentText(b, content, pieces, "input_text", "output_text")
	}
	return pieces, it.err
}

// contentText handles a message content: a string, or an array of parts
// whose "type" is typeA or typeB and whose "text" is a string.
func contentText(b []byte, c span, pieces []span, typeA, typeB string) []span {
	if !c.set() {
		return pieces
	}
	switch b[c.s] {
	case '"':
		return appendPiece(pieces, c)
	case '[':
	default:
		return pieces
	}
	it := trustedArrIter(b, c.s)
	for it.next() {
		if b[it.vs] != '{' {
			continue
		}
		var typ, text span
		pi := trustedObjIter(b, it.vs)
		for pi.next() {
			switch string(pi.m.keyBytes(b)) {
			case "type":
				typ = span{pi.m.vs, pi.m.ve}
			case "text":
				text = span{pi.m.vs, pi.m.ve}
			}
		}
		if typ.set() && text.set() && b[text.s] == '"' && stringIs(b[typ.s:typ.e], typeA, typeB) {
			pieces = appendPiece(pieces, text)
		}
	}
	return pieces
}

// String summarizes the request for logs without the body.
func (req *Request) String() string {
	path := ""
	if req.Route != nil {
		path = req.Route.ClientPath
	}
	return fmt.Sprintf("pd.Request{route=%s stream=%t batch=%d n=%d logprobs=%t model=%q bytes=%d}",
		path, req.Stream, req.BatchSize, req.N, req.Logprobs, req.Model, len(req.Raw))
}
