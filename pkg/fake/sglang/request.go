package sglang

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"mime"
	"strconv"
	"strings"

	"github.com/smg-project/smg-extproc/pkg/fake/common"
)

type route int

const (
	routeGenerate route = iota
	routeChat
	routeCompletions
	routeMessages
	routeResponses
	routeRerank
	routeCountTokens
)

func (r route) String() string {
	switch r {
	case routeGenerate:
		return "/generate"
	case routeChat:
		return "/v1/chat/completions"
	case routeCompletions:
		return "/v1/completions"
	case routeMessages:
		return "/v1/messages"
	case routeResponses:
		return "/v1/responses"
	case routeRerank:
		return "/v1/rerank"
	default:
		return "/v1/messages/count_tokens"
	}
}

// errKind selects the error envelope.
type errKind int

const (
	// errValidation: FastAPI/pydantic request validation (400, "Bad Request").
	errValidation errKind = iota
	// errAbort: a scheduler abort or ValueError (400 or 500).
	errAbort
)

type apiError struct {
	status int
	kind   errKind
	msg    string
}

func (e *apiError) Error() string { return fmt.Sprintf("%d %s", e.status, e.msg) }

func validationErr(format string, args ...any) *apiError {
	return &apiError{status: 400, kind: errValidation, msg: fmt.Sprintf(format, args...)}
}

func abortErr(status int, format string, args ...any) *apiError {
	return &apiError{status: status, kind: errAbort, msg: fmt.Sprintf(format, args...)}
}

// item is one expanded request (one prompt × one sample) with its bootstrap triple.
type item struct {
	k        int // position in SGLang's expanded order: k = sample*B + batchIdx
	batchIdx int
	sample   int
	rid      string
	tokens   []int
	hash     uint64

	room       uint64
	hasRoom    bool
	host       string
	hasHost    bool
	port       int
	healthForm bool // room 0 + host 2.2.2.2: complete locally
	stall      bool // lax duplicate: wait for the timeout like the real engine
}

type request struct {
	route      route
	rid        string
	model      string
	stream     bool
	batch      bool // /generate or /v1/completions with a list of prompts
	b, n       int
	prompts    [][]int
	maxTokens  int
	logprobs   bool
	usageChunk bool // stream_options.include_usage

	// rerank
	query       []int
	docs        []string
	docTokens   [][]int
	returnDocs  bool
	hasAnyBoots bool // any bootstrap_* key present (count_tokens strictness)

	items []item
}

type object map[string]json.RawMessage

func fieldErr(field, msg string, raw json.RawMessage) *apiError {
	return validationErr("1 validation error: body.%s: %s [input_value=%s, input_type=%s]", field, msg, common.InputValue(raw), common.JSONType(raw))
}

// intField parses an optional integer field; ok=false when absent or null.
func intField(o object, field string) (int64, bool, *apiError) {
	raw, present := o[field]
	if !present || common.IsNull(raw) {
		return 0, false, nil
	}
	v, err := strconv.ParseInt(string(bytes.TrimSpace(raw)), 10, 64)
	if err != nil {
		return 0, false, fieldErr(field, "Input should be a valid integer", raw)
	}
	return v, true, nil
}

func boolField(o object, field string) (bool, *apiError) {
	raw, present := o[field]
	if !present || common.IsNull(raw) {
		return false, nil
	}
	var b bool
	if err := json.Unmarshal(raw, &b); err != nil {
		return false, fieldErr(field, "Input should be a valid boolean", raw)
	}
	return b, nil
}

func stringField(o object, field string) (string, bool, *apiError) {
	raw, present := o[field]
	if !present || common.IsNull(raw) {
		return "", false, nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err != nil {
		return "", false, fieldErr(field, "Input should be a valid string", raw)
	}
	return s, true, nil
}

func objectField(o object, field string) (object, *apiError) {
	raw, present := o[field]
	if !present || common.IsNull(raw) {
		return nil, nil
	}
	var sub object
	if common.FirstByte(raw) != '{' || json.Unmarshal(raw, &sub) != nil {
		return nil, fieldErr(field, "Input should be a valid dictionary", raw)
	}
	return sub, nil
}

// checkContentType mirrors SGLang's validate_json_request.
func checkContentType(ct string) *apiError {
	mt, _, err := mime.ParseMediaType(ct)
	if err != nil || mt != "application/json" {
		return validationErr("1 validation error: header.content-type: Unsupported Media Type: Only 'application/json' is allowed [input_value=%q]", ct)
	}
	return nil
}

// parseRequest parses and validates an engine request body. It does not
// apply the PD checks (missing room, duplicates) that depend on the mode.
func parseRequest(rt route, body []byte, cfg Config, fallbackRID string) (*request, *apiError) {
	var o object
	if common.FirstByte(body) != '{' || json.Unmarshal(body, &o) != nil {
		return nil, validationErr("1 validation error: body: Input should be a valid dictionary or object to extract fields from [input_type=%s]", common.JSONType(body))
	}
	req := &request{route: rt, b: 1, n: 1, model: cfg.Model, returnDocs: true}
	for _, k := range []string{"bootstrap_host", "bootstrap_port", "bootstrap_room"} {
		if _, ok := o[k]; ok {
			req.hasAnyBoots = true
		}
	}
	if m, ok, err := stringField(o, "model"); err != nil {
		return nil, err
	} else if ok && m != "" {
		req.model = m
	}
	var err *apiError
	if req.stream, err = boolField(o, "stream"); err != nil {
		return nil, err
	}
	req.rid = fallbackRID
	if raw, ok := o["rid"]; ok && !common.IsNull(raw) {
		var s string
		var list []string
		switch {
		case json.Unmarshal(raw, &s) == nil:
			req.rid = s
		case json.Unmarshal(raw, &list) == nil && len(list) > 0:
			req.rid = list[0]
		default:
			return nil, fieldErr("rid", "Input should be a valid string", raw)
		}
	}

	maxTokens := int64(-1)
	switch rt {
	case routeGenerate:
		err = parseGenerate(o, req, &maxTokens)
	case routeChat:
		err = parseChat(o, req, &maxTokens)
	case routeCompletions:
		err = parseCompletions(o, req, &maxTokens)
	case routeMessages, routeCountTokens:
		err = parseMessages(o, req, &maxTokens)
		req.n = 1
	case routeResponses:
		err = parseResponses(o, req, &maxTokens)
	case routeRerank:
		err = parseRerank(o, req)
		req.stream = false
	}
	if err != nil {
		return nil, err
	}
	if maxTokens < 0 {
		maxTokens = int64(cfg.DefaultMaxTokens)
	}
	req.maxTokens = int(min(max(maxTokens, 1), 1<<16))
	if req.n < 1 {
		return nil, abortErr(400, "n must be at least 1, got %d", req.n)
	}
	if rt == routeCountTokens {
		return req, nil
	}
	if err := expandItems(o, req, cfg); err != nil {
		return nil, err
	}
	return req, nil
}

func capField(o object, field string, dst *int64) *apiError {
	v, ok, err := intField(o, field)
	if err != nil {
		return err
	}
	if ok {
		if v < 0 {
			return abortErr(400, "%s must be at least 0, got %d", field, v)
		}
		*dst = v
	}
	return nil
}

func nField(o object, req *request) *apiError {
	v, ok, err := intField(o, "n")
	if err != nil {
		return err
	}
	if ok {
		if v < 1 || v > 1024 {
			return abortErr(400, "n must be in [1, 1024], got %d", v)
		}
		req.n = int(v)
	}
	return nil
}

func parseGenerate(o object, req *request, maxTokens *int64) *apiError {
	text, hasText := o["text"]
	ids, hasIDs := o["input_ids"]
	hasText = hasText && !common.IsNull(text)
	hasIDs = hasIDs && !common.IsNull(ids)
	if hasText == hasIDs {
		return abortErr(400, "Either text, input_ids or input_embeds should be provided.")
	}
	if hasText {
		var s string
		var list []string
		switch {
		case json.Unmarshal(text, &s) == nil:
			req.prompts = [][]int{common.Tokenize(s)}
		case json.Unmarshal(text, &list) == nil:
			if len(list) == 0 {
				return abortErr(400, "text must not be an empty list")
			}
			req.batch = true
			for _, t := range list {
				req.prompts = append(req.prompts, common.Tokenize(t))
			}
		default:
			return fieldErr("text", "Input should be a valid string or list of strings", text)
		}
	} else {
		var one []int
		var many [][]int
		switch {
		case json.Unmarshal(ids, &one) == nil:
			req.prompts = [][]int{one}
		case json.Unmarshal(ids, &many) == nil:
			if len(many) == 0 {
				return abortErr(400, "input_ids must not be an empty list")
			}
			req.batch = true
			req.prompts = many
		default:
			return fieldErr("input_ids", "Input should be a valid list of integers or list of lists", ids)
		}
	}
	req.b = len(req.prompts)
	sp, err := objectField(o, "sampling_params")
	if err != nil {
		return err
	}
	if sp != nil {
		if err := capField(sp, "max_new_tokens", maxTokens); err != nil {
			return err
		}
		if err := nField(sp, req); err != nil {
			return err
		}
	}
	if raw, ok := o["return_logprob"]; ok && !common.IsNull(raw) {
		var b bool
		var list []bool
		switch {
		case json.Unmarshal(raw, &b) == nil:
			req.logprobs = b
		case json.Unmarshal(raw, &list) == nil:
			for _, v := range list {
				req.logprobs = req.logprobs || v
			}
		default:
			return fieldErr("return_logprob", "Input should be a valid boolean", raw)
		}
	}
	return nil
}

func streamOptions(o object, req *request) *apiError {
	so, err := objectField(o, "stream_options")
	if err != nil {
		return err
	}
	if so != nil {
		req.usageChunk, err = boolField(so, "include_usage")
	}
	return err
}

// contentText extracts text from a string or an array of content parts.
func contentText(raw json.RawMessage, field string) (string, *apiError) {
	text, ok := common.ContentText(raw)
	if !ok {
		return "", fieldErr(field, "Input should be a valid string or list of content parts", raw)
	}
	return text, nil
}

func messagesText(o object, field string, required bool) (string, *apiError) {
	raw, ok := o[field]
	if !ok || common.IsNull(raw) {
		if required {
			return "", fieldErr(field, "Field required", nil)
		}
		return "", nil
	}
	var msgs []object
	if common.FirstByte(raw) != '[' || json.Unmarshal(raw, &msgs) != nil {
		return "", fieldErr(field, "Input should be a valid list of message objects", raw)
	}
	if len(msgs) == 0 && required {
		return "", abortErr(400, "%s must not be empty", field)
	}
	texts := make([]string, 0, len(msgs))
	for i, m := range msgs {
		t, err := contentText(m["content"], fmt.Sprintf("%s.%d.content", field, i))
		if err != nil {
			return "", err
		}
		texts = append(texts, t)
	}
	return strings.Join(texts, "\n"), nil
}

func parseChat(o object, req *request, maxTokens *int64) *apiError {
	text, err := messagesText(o, "messages", true)
	if err != nil {
		return err
	}
	req.prompts = [][]int{common.Tokenize(text)}
	if err := capField(o, "max_tokens", maxTokens); err != nil {
		return err
	}
	if err := capField(o, "max_completion_tokens", maxTokens); err != nil {
		return err
	}
	if err := nField(o, req); err != nil {
		return err
	}
	if req.logprobs, err = boolField(o, "logprobs"); err != nil {
		return err
	}
	return streamOptions(o, req)
}

func parseCompletions(o object, req *request, maxTokens *int64) *apiError {
	raw, ok := o["prompt"]
	if !ok || common.IsNull(raw) {
		return fieldErr("prompt", "Field required", nil)
	}
	var s string
	var strs []string
	var ids []int
	var many [][]int
	switch {
	case json.Unmarshal(raw, &s) == nil:
		req.prompts = [][]int{common.Tokenize(s)}
	case json.Unmarshal(raw, &strs) == nil && (len(strs) > 0 || common.FirstByte(raw) == '['):
		if len(strs) == 0 {
			return abortErr(400, "prompt must not be empty")
		}
		if len(strs) == 1 {
			req.prompts = [][]int{common.Tokenize(strs[0])}
		} else {
			req.batch = true
			for _, t := range strs {
				req.prompts = append(req.prompts, common.Tokenize(t))
			}
		}
	case json.Unmarshal(raw, &ids) == nil:
		req.prompts = [][]int{ids}
	case json.Unmarshal(raw, &many) == nil:
		if len(many) == 1 {
			req.prompts = many
		} else {
			req.batch = true
			req.prompts = many
		}
	default:
		return fieldErr("prompt", "Input should be a string, a list of strings, a list of integers or a list of lists of integers", raw)
	}
	req.b = len(req.prompts)
	if err := capField(o, "max_tokens", maxTokens); err != nil {
		return err
	}
	if err := nField(o, req); err != nil {
		return err
	}
	if raw, ok := o["logprobs"]; ok && !common.IsNull(raw) {
		if _, _, err := intField(o, "logprobs"); err != nil {
			return err
		}
		req.logprobs = true
	}
	return streamOptions(o, req)
}

func parseMessages(o object, req *request, maxTokens *int64) *apiError {
	text, err := messagesText(o, "messages", true)
	if err != nil {
		return err
	}
	system, err := contentText(o["system"], "system")
	if err != nil {
		return err
	}
	if system != "" {
		text = system + "\n" + text
	}
	req.prompts = [][]int{common.Tokenize(text)}
	return capField(o, "max_tokens", maxTokens)
}

func parseResponses(o object, req *request, maxTokens *int64) *apiError {
	raw, ok := o["input"]
	if !ok || common.IsNull(raw) {
		return fieldErr("input", "Field required", nil)
	}
	var text string
	if json.Unmarshal(raw, &text) != nil {
		var items []json.RawMessage
		if json.Unmarshal(raw, &items) != nil {
			return fieldErr("input", "Input should be a valid string or list of input items", raw)
		}
		texts := make([]string, 0, len(items))
		for i, it := range items {
			var s string
			if json.Unmarshal(it, &s) == nil {
				texts = append(texts, s)
				continue
			}
			var io object
			if json.Unmarshal(it, &io) != nil {
				return fieldErr(fmt.Sprintf("input.%d", i), "Input should be a valid input item", it)
			}
			if c, ok := io["content"]; ok {
				t, err := contentText(c, fmt.Sprintf("input.%d.content", i))
				if err != nil {
					return err
				}
				texts = append(texts, t)
			} else if t, ok, _ := stringField(io, "text"); ok {
				texts = append(texts, t)
			}
		}
		text = strings.Join(texts, "\n")
	}
	req.prompts = [][]int{common.Tokenize(text)}
	return capField(o, "max_output_tokens", maxTokens)
}

func parseRerank(o object, req *request) *apiError {
	q, ok, err := stringField(o, "query")
	if err != nil {
		return err
	}
	if !ok {
		return fieldErr("query", "Field required", nil)
	}
	raw, present := o["documents"]
	if !present || common.IsNull(raw) {
		return fieldErr("documents", "Field required", nil)
	}
	if json.Unmarshal(raw, &req.docs) != nil {
		return fieldErr("documents", "Input should be a valid list of strings", raw)
	}
	if len(req.docs) == 0 {
		return abortErr(400, "documents must not be empty")
	}
	if raw, ok := o["return_documents"]; ok && !common.IsNull(raw) {
		if req.returnDocs, err = boolField(o, "return_documents"); err != nil {
			return err
		}
	}
	req.query = common.Tokenize(q)
	all := append([]int(nil), req.query...)
	for _, d := range req.docs {
		t := common.Tokenize(d)
		req.docTokens = append(req.docTokens, t)
		all = append(all, t...)
	}
	req.prompts = [][]int{all}
	return nil
}

// parseRoom parses one bootstrap_room value (strict: a JSON integer literal
// in [0, 2^63-1]; lax: also numeric strings and whole floats, up to 2^64-1).
func parseRoom(raw json.RawMessage, field string, lax bool) (uint64, *apiError) {
	raw = bytes.TrimSpace(raw)
	lit := string(raw)
	typeErr := func() *apiError {
		return validationErr("2 validation errors: body.%s.list[int]: Input should be a valid list [type=list_type]; body.%s.int: Input should be a valid integer, unable to parse %s as an integer [type=int_parsing, input_value=%s]",
			field, field, common.JSONType(raw), lit)
	}
	switch c := common.FirstByte(raw); {
	case c == '"':
		if !lax {
			return 0, typeErr()
		}
		var s string
		if json.Unmarshal(raw, &s) != nil {
			return 0, typeErr()
		}
		lit = strings.TrimSpace(s)
		if lit == "" || strings.ContainsAny(lit, " \t") {
			return 0, typeErr()
		}
	case c == '-' || (c >= '0' && c <= '9'):
	default:
		return 0, typeErr()
	}
	if strings.ContainsAny(lit, ".eE") {
		f, err := strconv.ParseFloat(lit, 64)
		if err != nil || !lax || f != math.Trunc(f) {
			return 0, typeErr()
		}
		if f < 0 || f >= 1<<64 {
			return 0, outOfRange(lit, lax)
		}
		return uint64(f), nil
	}
	if strings.HasPrefix(lit, "-") {
		if _, err := strconv.ParseInt(lit, 10, 64); err != nil && !strings.Contains(err.Error(), "range") {
			return 0, typeErr()
		}
		return 0, outOfRange(lit, lax)
	}
	v, err := strconv.ParseUint(lit, 10, 64)
	if err != nil {
		if ne, ok := err.(*strconv.NumError); ok && ne.Err == strconv.ErrRange {
			return 0, outOfRange(lit, lax)
		}
		return 0, typeErr()
	}
	if !lax && v > math.MaxInt64 {
		return 0, outOfRange(lit, lax)
	}
	return v, nil
}

func outOfRange(lit string, lax bool) *apiError {
	limit := "2^63-1"
	if lax {
		limit = "2^64-1"
	}
	return abortErr(400, "bootstrap_room out of range: %s is not in [0, %s]", lit, limit)
}

// expandList applies SGLang's _normalize_bootstrap_params length rules to a
// list value of length l for k = b*n requests. It returns the index into the
// list for each expanded request.
func expandList(field string, l, b, n int, lax bool) ([]int, *apiError) {
	k := b * n
	idx := make([]int, k)
	switch {
	case l == k:
		for i := range idx {
			idx[i] = i
		}
	case n > 1 && l == b:
		// A list is repeated n times (SGLang), so samples share rooms.
		for i := range idx {
			idx[i] = i % b
		}
	case lax && l > k:
		for i := range idx {
			idx[i] = i
		}
	case lax:
		return nil, abortErr(500, "list index out of range (%s has %d entries for %d requests)", field, l, k)
	default:
		return nil, abortErr(400, "%s list length %d does not match the number of requests %d (batch size %d x n=%d)", field, l, b, n, k)
	}
	return idx, nil
}

func expandItems(o object, req *request, cfg Config) *apiError {
	b, n := len(req.prompts), req.n
	k := b * n
	req.b = b
	req.items = make([]item, k)
	for i := range req.items {
		it := &req.items[i]
		it.k, it.batchIdx, it.sample = i, i%b, i/b
		it.tokens = req.prompts[it.batchIdx]
		it.hash = common.HashTokens(it.tokens)
		it.port = cfg.BootstrapPort
		it.rid = req.rid
		if k > 1 {
			it.rid = fmt.Sprintf("%s-%d", req.rid, i)
		}
	}
	lax := cfg.Lax

	// bootstrap_room
	if raw, ok := o["bootstrap_room"]; ok && !common.IsNull(raw) {
		if common.FirstByte(raw) == '[' {
			var list []json.RawMessage
			if json.Unmarshal(raw, &list) != nil {
				return fieldErr("bootstrap_room", "Input should be a valid list", raw)
			}
			idx, err := expandList("bootstrap_room", len(list), b, n, lax)
			if err != nil {
				return err
			}
			for i := range req.items {
				v := list[idx[i]]
				if common.IsNull(v) {
					continue
				}
				r, err := parseRoom(v, fmt.Sprintf("bootstrap_room.%d", idx[i]), lax)
				if err != nil {
					return err
				}
				req.items[i].room, req.items[i].hasRoom = r, true
			}
		} else {
			r, err := parseRoom(raw, "bootstrap_room", lax)
			if err != nil {
				return err
			}
			limit := uint64(math.MaxInt64)
			if lax {
				limit = math.MaxUint64
			}
			if limit-r < uint64(k-1) {
				return abortErr(400, "bootstrap_room out of range: %d+%d is not in [0, %d]", r, k-1, limit)
			}
			for i := range req.items {
				req.items[i].room, req.items[i].hasRoom = r+uint64(i), true
			}
		}
	}

	// bootstrap_host
	if raw, ok := o["bootstrap_host"]; ok && !common.IsNull(raw) {
		var s string
		var list []*string
		switch {
		case json.Unmarshal(raw, &s) == nil:
			for i := range req.items {
				req.items[i].host, req.items[i].hasHost = s, true
			}
		case json.Unmarshal(raw, &list) == nil:
			idx, err := expandList("bootstrap_host", len(list), b, n, lax)
			if err != nil {
				return err
			}
			for i := range req.items {
				if h := list[idx[i]]; h != nil {
					req.items[i].host, req.items[i].hasHost = *h, true
				}
			}
		default:
			return fieldErr("bootstrap_host", "Input should be a valid string or list of strings", raw)
		}
	}

	// bootstrap_port
	if raw, ok := o["bootstrap_port"]; ok && !common.IsNull(raw) {
		if common.FirstByte(raw) == '[' {
			var list []json.RawMessage
			if json.Unmarshal(raw, &list) != nil {
				return fieldErr("bootstrap_port", "Input should be a valid list", raw)
			}
			idx, err := expandList("bootstrap_port", len(list), b, n, lax)
			if err != nil {
				return err
			}
			for i := range req.items {
				v := list[idx[i]]
				if common.IsNull(v) {
					continue
				}
				p, err := parsePort(v, fmt.Sprintf("bootstrap_port.%d", idx[i]), lax)
				if err != nil {
					return err
				}
				req.items[i].port = p
			}
		} else {
			p, err := parsePort(raw, "bootstrap_port", lax)
			if err != nil {
				return err
			}
			for i := range req.items {
				req.items[i].port = p
			}
		}
	}
	for i := range req.items {
		it := &req.items[i]
		it.healthForm = it.hasRoom && it.room == 0 && it.hasHost && it.host == FakeBootstrapHost
	}
	return nil
}

func parsePort(raw json.RawMessage, field string, lax bool) (int, *apiError) {
	lit := string(bytes.TrimSpace(raw))
	if lax && common.FirstByte(raw) == '"' {
		var s string
		if json.Unmarshal(raw, &s) == nil {
			lit = strings.TrimSpace(s)
		}
	}
	v, err := strconv.ParseInt(lit, 10, 64)
	if err != nil {
		return 0, fieldErr(field, "Input should be a valid integer", raw)
	}
	if v < 0 || v > 65535 {
		return 0, fieldErr(field, "Input should be a valid port number in [0, 65535]", raw)
	}
	return int(v), nil
}

// checkRooms applies the PD checks: missing room and duplicates inside the
// request. Lax duplicates are marked to stall instead.
func checkRooms(req *request, lax bool) *apiError {
	seen := make(map[uint64]struct{}, len(req.items))
	for i := range req.items {
		it := &req.items[i]
		if !it.hasRoom {
			return abortErr(400, "Invalid request: Disaggregated request received without bootstrap room id. req.rid='%s'", it.rid)
		}
		if it.healthForm {
			continue
		}
		if _, dup := seen[it.room]; dup {
			if !lax {
				return abortErr(400, "duplicate bootstrap_room %d", it.room)
			}
			it.stall = true
			continue
		}
		seen[it.room] = struct{}{}
	}
	return nil
}
