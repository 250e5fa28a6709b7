package vllm

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"

	"github.com/smg-project/smg-extproc/pkg/fake/common"
)

type route int

const (
	routeChat route = iota
	routeCompletions
	routeMessages
	routeResponses
)

func (r route) String() string {
	switch r {
	case routeChat:
		return "/v1/chat/completions"
	case routeCompletions:
		return "/v1/completions"
	case routeMessages:
		return "/v1/messages"
	default:
		return "/v1/responses"
	}
}

// declaresKV reports whether the route's request model declares
// kv_transfer_params (ResponsesRequest does not: the field is ignored there).
func (r route) declaresKV() bool { return r != routeResponses }

type apiError struct {
	status int
	msg    string
}

func (e *apiError) Error() string { return fmt.Sprintf("%d %s", e.status, e.msg) }

func errf(status int, format string, args ...any) *apiError {
	return &apiError{status: status, msg: fmt.Sprintf(format, args...)}
}

func badRequest(format string, args ...any) *apiError { return errf(400, format, args...) }

// errClientGone marks a request whose client went away (nothing to answer).
var errClientGone = &apiError{status: 499, msg: "client disconnected"}

type object map[string]json.RawMessage

// fieldErr is a pydantic-style validation error (vLLM answers 400).
func fieldErr(field, msg, typ string, raw json.RawMessage) *apiError {
	return badRequest("1 validation error: body.%s: %s [type=%s, input_value=%s, input_type=%s]", field, msg, typ, common.InputValue(raw), common.JSONType(raw))
}

func (o object) has(field string) bool {
	raw, ok := o[field]
	return ok && !common.IsNull(raw)
}

func (o object) int(field string) (int64, bool, *apiError) {
	raw, ok := o[field]
	if !ok || common.IsNull(raw) {
		return 0, false, nil
	}
	v, err := strconv.ParseInt(string(bytes.TrimSpace(raw)), 10, 64)
	if err != nil {
		return 0, false, fieldErr(field, "Input should be a valid integer", "int_parsing", raw)
	}
	return v, true, nil
}

func (o object) bool(field string) (bool, *apiError) {
	raw, ok := o[field]
	if !ok || common.IsNull(raw) {
		return false, nil
	}
	var b bool
	if err := json.Unmarshal(raw, &b); err != nil {
		return false, fieldErr(field, "Input should be a valid boolean", "bool_parsing", raw)
	}
	return b, nil
}

func (o object) string(field string) (string, bool, *apiError) {
	raw, ok := o[field]
	if !ok || common.IsNull(raw) {
		return "", false, nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err != nil {
		return "", false, fieldErr(field, "Input should be a valid string", "string_type", raw)
	}
	return s, true, nil
}

func (o object) object(field string) (object, *apiError) {
	raw, ok := o[field]
	if !ok || common.IsNull(raw) {
		return nil, nil
	}
	var sub object
	if common.FirstByte(raw) != '{' || json.Unmarshal(raw, &sub) != nil {
		return nil, fieldErr(field, "Input should be a valid dictionary", "dict_type", raw)
	}
	if sub == nil {
		sub = object{}
	}
	return sub, nil
}

// kvParams is a request's kv_transfer_params object (nil: absent or null).
type kvParams object

func (k kvParams) has(key string) bool { return object(k).has(key) }

// flag is true only for a JSON true.
func (k kvParams) flag(key string) bool {
	raw, ok := k[key]
	return ok && string(bytes.TrimSpace(raw)) == "true"
}

// str returns a string value; ok is false when absent, null or not a string.
func (k kvParams) str(key string) (string, bool) {
	raw, ok := k[key]
	if !ok || common.FirstByte(raw) != '"' {
		return "", false
	}
	var s string
	if json.Unmarshal(raw, &s) != nil {
		return "", false
	}
	return s, true
}

// intLike parses a number or a decimal string (present=false when absent or null).
func (k kvParams) intLike(key string) (v int64, present bool, ok bool) {
	raw, found := k[key]
	if !found || common.IsNull(raw) {
		return 0, false, false
	}
	lit := string(bytes.TrimSpace(raw))
	if common.FirstByte(raw) == '"' {
		var s string
		if json.Unmarshal(raw, &s) != nil {
			return 0, true, false
		}
		lit = strings.TrimSpace(s)
	}
	n, err := strconv.ParseInt(lit, 10, 64)
	if err != nil {
		return 0, true, false
	}
	return n, true, true
}

// request is one parsed generation request.
type request struct {
	route      route
	rid        string // X-Request-Id, else body request_id, else a uuid
	ridFrom    string // header | body | generated
	model      string
	stream     bool
	usageChunk bool // stream_options.include_usage
	contUsage  bool // stream_options.continuous_usage_stats
	prompts    [][]int
	batch      bool // a list of prompts
	embeds     bool // prompt_embeds given
	n          int
	beam       bool // use_beam_search
	maxTokens  int
	capField   string // the cap field that set maxTokens ("" if defaulted)
	minTokens  int
	stop       []string
	stopIDs    []int
	ignoreEOS  bool
	logprobs   bool
	kv         kvParams // nil when absent, null, or ignored by the route
	kvIgnored  bool     // present but the route does not declare it
	dpRank     int
	system     bool // messages: a system prompt was given
}

// parseRequest parses and validates an engine request body.
func parseRequest(rt route, r *http.Request, body []byte, cfg Config) (*request, *apiError) {
	var o object
	if common.FirstByte(body) != '{' || json.Unmarshal(body, &o) != nil {
		return nil, badRequest("1 validation error: body: Input should be a valid dictionary or object to extract fields from [type=model_attributes_type, input_type=%s]", common.JSONType(body))
	}
	req := &request{route: rt, n: 1, model: cfg.Model}
	var e *apiError
	if m, ok, err := o.string("model"); err != nil {
		return nil, err
	} else if ok && m != "" {
		req.model = m
	} else if rt == routeMessages {
		return nil, fieldErr("model", "Field required", "missing", nil)
	}
	if req.stream, e = o.bool("stream"); e != nil {
		return nil, e
	}

	// request id: header wins, then the body's request_id, then a uuid.
	switch bodyRID, ok, err := o.string("request_id"); {
	case err != nil:
		return nil, err
	case r.Header.Get("X-Request-Id") != "":
		req.rid, req.ridFrom = r.Header.Get("X-Request-Id"), "header"
	case ok && bodyRID != "":
		req.rid, req.ridFrom = bodyRID, "body"
	default:
		req.rid, req.ridFrom = strings.ReplaceAll(uuidString(), "-", ""), "generated"
	}

	req.dpRank = cfg.DPRank
	if h := r.Header.Get("X-data-parallel-rank"); h != "" {
		v, err := strconv.Atoi(strings.TrimSpace(h))
		if err != nil || v < 0 || v >= cfg.DPSize {
			return nil, badRequest("data_parallel_rank %q is out of range [0, %d).", h, cfg.DPSize)
		}
		req.dpRank = v
	}

	if raw, ok := o["kv_transfer_params"]; ok && !common.IsNull(raw) {
		if !rt.declaresKV() {
			req.kvIgnored = true
		} else {
			if common.FirstByte(raw) != '{' {
				return nil, fieldErr("kv_transfer_params", "Input should be a valid dictionary", "dict_type", raw)
			}
			var kv kvParams
			if json.Unmarshal(raw, &kv) != nil {
				return nil, fieldErr("kv_transfer_params", "Input should be a valid dictionary", "dict_type", raw)
			}
			if kv == nil {
				kv = kvParams{}
			}
			req.kv = kv
		}
	}

	switch rt {
	case routeChat:
		e = parseChat(o, req)
	case routeCompletions:
		e = parseCompletions(o, req)
	case routeMessages:
		e = parseMessages(o, req)
	default:
		e = parseResponses(o, req)
	}
	if e != nil {
		return nil, e
	}
	if e = parseSampling(o, req, cfg); e != nil {
		return nil, e
	}
	return req, nil
}

// parseSampling reads the fields shared by the OpenAI routes.
func parseSampling(o object, req *request, cfg Config) *apiError {
	var e *apiError
	caps := map[route][]string{
		routeChat:        {"max_completion_tokens", "max_tokens"},
		routeCompletions: {"max_tokens"},
		routeMessages:    {"max_tokens"},
		routeResponses:   {"max_output_tokens"},
	}[req.route]
	req.maxTokens = cfg.DefaultMaxTokens
	for _, f := range caps {
		v, ok, err := o.int(f)
		if err != nil {
			return err
		}
		if ok {
			if v < 1 {
				return badRequest("%s must be at least 1, got %d.", f, v)
			}
			req.maxTokens, req.capField = int(min(v, 1<<16)), f
			break
		}
	}
	if req.route == routeMessages && req.capField == "" {
		return fieldErr("max_tokens", "Field required", "missing", nil)
	}
	if req.route != routeMessages && req.route != routeResponses {
		if v, ok, err := o.int("n"); err != nil {
			return err
		} else if ok {
			if v < 1 {
				return badRequest("n must be at least 1, got %d.", v)
			}
			req.n = int(min(v, 128))
		}
		if req.beam, e = o.bool("use_beam_search"); e != nil {
			return e
		}
		so, err := o.object("stream_options")
		if err != nil {
			return err
		}
		if so != nil {
			if !req.stream {
				return badRequest("Stream options can only be defined when `stream=True`.")
			}
			if req.usageChunk, e = so.bool("include_usage"); e != nil {
				return e
			}
			if req.contUsage, e = so.bool("continuous_usage_stats"); e != nil {
				return e
			}
		}
	}
	for _, f := range []string{"min_tokens", "min_completion_tokens"} {
		v, ok, err := o.int(f)
		if err != nil {
			return err
		}
		if ok {
			if v < 0 {
				return badRequest("%s must be greater than or equal to 0, got %d.", f, v)
			}
			if req.capField != "" && int(v) > req.maxTokens {
				return badRequest("min_tokens must be less than or equal to max_tokens=%d, got %d.", req.maxTokens, v)
			}
			req.minTokens = int(v)
		}
	}
	stopField := "stop"
	if req.route == routeMessages {
		stopField = "stop_sequences"
	}
	if raw, ok := o[stopField]; ok && !common.IsNull(raw) {
		var one string
		var many []string
		switch {
		case json.Unmarshal(raw, &one) == nil:
			if one != "" {
				req.stop = []string{one}
			}
		case json.Unmarshal(raw, &many) == nil:
			for _, s := range many {
				if s != "" {
					req.stop = append(req.stop, s)
				}
			}
		default:
			return fieldErr(stopField, "Input should be a valid string or list of strings", "string_type", raw)
		}
	}
	if raw, ok := o["stop_token_ids"]; ok && !common.IsNull(raw) {
		if json.Unmarshal(raw, &req.stopIDs) != nil {
			return fieldErr("stop_token_ids", "Input should be a valid list of integers", "list_type", raw)
		}
	}
	if req.ignoreEOS, e = o.bool("ignore_eos"); e != nil {
		return e
	}
	switch req.route {
	case routeChat:
		req.logprobs, e = o.bool("logprobs")
	case routeCompletions:
		if raw, ok := o["logprobs"]; ok && !common.IsNull(raw) {
			if _, _, e = o.int("logprobs"); e == nil {
				req.logprobs = true
			}
		}
	}
	return e
}

// contentText extracts text from a string or an array of content parts.
func contentText(raw json.RawMessage, field string) (string, *apiError) {
	text, ok := common.ContentText(raw)
	if !ok {
		return "", fieldErr(field, "Input should be a valid string or list of content parts", "list_type", raw)
	}
	return text, nil
}

func messagesText(o object, field string) (string, *apiError) {
	raw, ok := o[field]
	if !ok || common.IsNull(raw) {
		return "", fieldErr(field, "Field required", "missing", nil)
	}
	var msgs []object
	if common.FirstByte(raw) != '[' || json.Unmarshal(raw, &msgs) != nil {
		return "", fieldErr(field, "Input should be a valid list", "list_type", raw)
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

func parseChat(o object, req *request) *apiError {
	text, err := messagesText(o, "messages")
	if err != nil {
		return err
	}
	req.prompts = [][]int{common.Tokenize(text)}
	return nil
}

func parseCompletions(o object, req *request) *apiError {
	if o.has("prompt_embeds") {
		req.embeds = true
	}
	raw, ok := o["prompt"]
	if !ok || common.IsNull(raw) {
		if req.embeds {
			req.prompts = [][]int{{}}
			return nil
		}
		return badRequest("Either prompt or prompt_embeds must be provided and non-empty.")
	}
	var s string
	var strs []string
	var ids []int
	var many [][]int
	switch {
	case json.Unmarshal(raw, &s) == nil:
		req.prompts = [][]int{common.Tokenize(s)}
	case common.FirstByte(raw) == '[' && json.Unmarshal(raw, &strs) == nil && len(strs) > 0:
		for _, t := range strs {
			req.prompts = append(req.prompts, common.Tokenize(t))
		}
	case json.Unmarshal(raw, &ids) == nil && len(ids) > 0:
		req.prompts = [][]int{ids}
	case json.Unmarshal(raw, &many) == nil && len(many) > 0:
		req.prompts = many
	default:
		return badRequest("Either prompt or prompt_embeds must be provided and non-empty.")
	}
	req.batch = len(req.prompts) > 1
	return nil
}

func parseMessages(o object, req *request) *apiError {
	text, err := messagesText(o, "messages")
	if err != nil {
		return err
	}
	system, err := contentText(o["system"], "system")
	if err != nil {
		return err
	}
	if system != "" {
		text = system + "\n" + text
		req.system = true
	}
	req.prompts = [][]int{common.Tokenize(text)}
	return nil
}

func parseResponses(o object, req *request) *apiError {
	raw, ok := o["input"]
	if !ok || common.IsNull(raw) {
		return fieldErr("input", "Field required", "missing", nil)
	}
	var text string
	if json.Unmarshal(raw, &text) != nil {
		var items []json.RawMessage
		if json.Unmarshal(raw, &items) != nil {
			return fieldErr("input", "Input should be a valid string or list of input items", "list_type", raw)
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
				return fieldErr(fmt.Sprintf("input.%d", i), "Input should be a valid input item", "model_type", it)
			}
			if c, ok := io["content"]; ok {
				t, err := contentText(c, fmt.Sprintf("input.%d.content", i))
				if err != nil {
					return err
				}
				texts = append(texts, t)
			} else if t, ok, _ := io.string("text"); ok {
				texts = append(texts, t)
			}
		}
		text = strings.Join(texts, "\n")
	}
	if instr, ok, err := o.string("instructions"); err != nil {
		return err
	} else if ok && instr != "" {
		text = instr + "\n" + text
	}
	req.prompts = [][]int{common.Tokenize(text)}
	return nil
}

// respID is the OpenAI response id: chatcmpl-<rid>, cmpl-<rid>, msg_<rid>
// or resp_<rid>.
func (req *request) respID() string {
	switch req.route {
	case routeChat:
		return "chatcmpl-" + req.rid
	case routeCompletions:
		return "cmpl-" + req.rid
	case routeMessages:
		return "msg_" + req.rid
	default:
		if strings.HasPrefix(req.rid, "resp_") {
			return req.rid
		}
		return "resp_" + req.rid
	}
}

// internalID is the engine's request id for prompt i: the response id,
// "-<i>" for completions, and a random 8-hex suffix (different on every
// worker, as vLLM's InputProcessor.assign_request_id does).
func (req *request) internalID(i int) string {
	id := req.respID()
	if req.route == routeCompletions {
		id += "-" + strconv.Itoa(i)
	}
	return id + "-" + randHex(4)
}

// single reports whether the request is one sequence (the PD legs' rule).
func (req *request) single() (bool, string) {
	switch {
	case req.n > 1:
		return false, fmt.Sprintf("n=%d", req.n)
	case req.beam:
		return false, "use_beam_search"
	case req.batch:
		return false, fmt.Sprintf("a batch of %d prompts", len(req.prompts))
	case req.embeds:
		return false, "prompt_embeds"
	}
	return true, ""
}

func (req *request) promptTokens() int {
	n := 0
	for _, p := range req.prompts {
		n += len(p)
	}
	return n
}
