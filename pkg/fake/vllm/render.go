package vllm

import (
	"context"
	"net/http"
	"time"

	"github.com/smg-project/smg-extproc/pkg/fake/common"
)

// Fake-only response headers.
const (
	// HeaderFakeKV is set on every non-prefill generation response:
	// transferred (KV loaded from a prefill), recomputed (a decode-capable
	// worker with a KV connector computed the prompt itself) or none (no
	// connector, or a kv_producer serving a request without a handoff).
	HeaderFakeKV = "X-Fake-KV"
	// HeaderFakeHandoff is set on prefill-leg responses: issued (a handoff is
	// held for a decode) or none.
	HeaderFakeHandoff = "X-Fake-Handoff"
)

func errorType(status int) string {
	switch {
	case status == http.StatusBadRequest:
		return "BadRequestError"
	case status == http.StatusNotFound:
		return "NotFoundError"
	case status == http.StatusMethodNotAllowed:
		return "MethodNotAllowed"
	case status == http.StatusServiceUnavailable:
		return "ServiceUnavailableError"
	case status >= 500:
		return "InternalServerError"
	}
	return http.StatusText(status)
}

// errBody is vLLM's error envelope on rt: {"error":{"message","type","param",
// "code"}} on the OpenAI routes, Anthropic's on /v1/messages.
func errBody(rt route, e *apiError) any {
	if rt == routeMessages {
		typ := "invalid_request_error"
		switch {
		case e.status == http.StatusNotFound:
			typ = "not_found_error"
		case e.status >= 500:
			typ = "api_error"
		}
		return map[string]any{"type": "error", "error": map[string]any{"type": typ, "message": e.msg}}
	}
	return common.NestedError(e.status, errorType(e.status), e.msg)
}

func writeErr(w http.ResponseWriter, rt route, e *apiError) {
	common.WriteJSON(w, e.status, errBody(rt, e))
}

type usage struct {
	PromptTokens        int `json:"prompt_tokens"`
	TotalTokens         int `json:"total_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	PromptTokensDetails any `json:"prompt_tokens_details"`
}

type responder struct {
	s       *Server
	w       http.ResponseWriter
	req     *request
	cfg     Config
	id      string
	created int64
	delay   bool // per-token delays apply (not on prefill legs)
	sse     *common.SSE
}

func newResponder(s *Server, w http.ResponseWriter, req *request, cfg Config, delay bool) *responder {
	return &responder{
		s: s, w: w, req: req, cfg: cfg, id: req.respID(), created: time.Now().Unix(), delay: delay,
		sse: common.NewSSE(w, delay && cfg.PerTokenDelay > 0),
	}
}

func (p *responder) usage(cs []choice) usage {
	c := 0
	for i := range cs {
		c += cs[i].completion
	}
	pt := p.req.promptTokens()
	return usage{PromptTokens: pt, CompletionTokens: c, TotalTokens: pt + c}
}

func maxTokens(cs []choice) int {
	m := 0
	for i := range cs {
		m = max(m, len(cs[i].pieces))
	}
	return m
}

func (p *responder) step(ctx context.Context, t int) error {
	if t == 0 || !p.delay || p.cfg.PerTokenDelay <= 0 {
		return nil
	}
	return common.Sleep(ctx, p.cfg.PerTokenDelay)
}

func (p *responder) setHeaders(o *outcome) {
	if o.kv != "" {
		p.w.Header().Set(HeaderFakeKV, o.kv)
	}
	if o.handoffS != "" {
		p.w.Header().Set(HeaderFakeHandoff, o.handoffS)
	}
}

// render writes the successful response.
func (p *responder) render(ctx context.Context, o *outcome) error {
	total := 0
	for i := range o.choices {
		total += o.choices[i].completion
	}
	p.s.genTok.Add(int64(total))
	p.s.promptTok.Add(int64(p.req.promptTokens()))
	p.setHeaders(o)
	if !p.req.stream {
		if p.delay {
			if err := common.Sleep(ctx, p.cfg.PerTokenDelay*time.Duration(max(maxTokens(o.choices)-1, 0))); err != nil {
				return err
			}
		}
		var v any
		switch p.req.route {
		case routeChat:
			v = p.chat(o)
		case routeCompletions:
			v = p.completions(o)
		case routeMessages:
			v = p.messages(o)
		default:
			v = p.responses(o)
		}
		common.WriteJSON(p.w, http.StatusOK, v)
		return nil
	}
	var err error
	switch p.req.route {
	case routeChat, routeCompletions:
		err = p.streamOpenAI(ctx, o.choices)
	case routeMessages:
		err = p.streamMessages(ctx, &o.choices[0])
	default:
		err = p.streamResponses(ctx, &o.choices[0])
	}
	if err == nil {
		err = p.sse.Flush()
	}
	return err
}

// ---- chat / completions ----

type chatMessage struct {
	Role             string `json:"role"`
	Content          string `json:"content"`
	Refusal          any    `json:"refusal"`
	Annotations      any    `json:"annotations"`
	Audio            any    `json:"audio"`
	FunctionCall     any    `json:"function_call"`
	ToolCalls        []any  `json:"tool_calls"`
	ReasoningContent any    `json:"reasoning_content"`
}

type chatChoice struct {
	Index        int         `json:"index"`
	Message      chatMessage `json:"message"`
	Logprobs     any         `json:"logprobs"`
	FinishReason string      `json:"finish_reason"`
	StopReason   any         `json:"stop_reason"`
}

type chatCompletion struct {
	ID                string       `json:"id"`
	Object            string       `json:"object"`
	Created           int64        `json:"created"`
	Model             string       `json:"model"`
	Choices           []chatChoice `json:"choices"`
	ServiceTier       any          `json:"service_tier"`
	SystemFingerprint any          `json:"system_fingerprint"`
	Usage             usage        `json:"usage"`
	PromptLogprobs    any          `json:"prompt_logprobs"`
	PromptTokenIDs    any          `json:"prompt_token_ids"`
	KVTransferParams  any          `json:"kv_transfer_params"`
}

type chatLogprob struct {
	Token       string  `json:"token"`
	Logprob     float64 `json:"logprob"`
	Bytes       []int   `json:"bytes"`
	TopLogprobs []any   `json:"top_logprobs"`
}

func chatLogprobs(c *choice, from, to int) map[string]any {
	content := make([]chatLogprob, 0, to-from)
	for i := from; i < to; i++ {
		piece := c.pieces[i]
		b := make([]int, len(piece))
		for j := range piece {
			b[j] = int(piece[j])
		}
		content = append(content, chatLogprob{Token: piece, Logprob: c.tokens[i].Logprob, Bytes: b, TopLogprobs: []any{}})
	}
	return map[string]any{"content": content}
}

func completionLogprobs(c *choice, from, to, offset int) map[string]any {
	toks := make([]string, 0, to-from)
	lps := make([]float64, 0, to-from)
	offs := make([]int, 0, to-from)
	for i := from; i < to; i++ {
		toks = append(toks, c.pieces[i])
		lps = append(lps, c.tokens[i].Logprob)
		offs = append(offs, offset)
		offset += len(c.pieces[i])
	}
	return map[string]any{"tokens": toks, "token_logprobs": lps, "top_logprobs": nil, "text_offset": offs}
}

func (p *responder) chat(o *outcome) any {
	resp := chatCompletion{
		ID: p.id, Object: "chat.completion", Created: p.created, Model: p.req.model,
		Choices: make([]chatChoice, 0, len(o.choices)), Usage: p.usage(o.choices), KVTransferParams: kvValue(o.handoff),
	}
	for i := range o.choices {
		c := &o.choices[i]
		cc := chatChoice{
			Index: c.index, FinishReason: c.finish, StopReason: c.stopReason,
			Message: chatMessage{Role: "assistant", Content: c.text(), ToolCalls: []any{}},
		}
		if p.req.logprobs {
			cc.Logprobs = chatLogprobs(c, 0, len(c.pieces))
		}
		resp.Choices = append(resp.Choices, cc)
	}
	return resp
}

type completionChoice struct {
	Index          int    `json:"index"`
	Text           string `json:"text"`
	Logprobs       any    `json:"logprobs"`
	FinishReason   string `json:"finish_reason"`
	StopReason     any    `json:"stop_reason"`
	PromptLogprobs any    `json:"prompt_logprobs"`
}

type completion struct {
	ID                string             `json:"id"`
	Object            string             `json:"object"`
	Created           int64              `json:"created"`
	Model             string             `json:"model"`
	Choices           []completionChoice `json:"choices"`
	ServiceTier       any                `json:"service_tier"`
	SystemFingerprint any                `json:"system_fingerprint"`
	Usage             usage              `json:"usage"`
	KVTransferParams  any                `json:"kv_transfer_params"`
}

func (p *responder) completions(o *outcome) any {
	resp := completion{
		ID: p.id, Object: "text_completion", Created: p.created, Model: p.req.model,
		Choices: make([]completionChoice, 0, len(o.choices)), Usage: p.usage(o.choices), KVTransferParams: kvValue(o.handoff),
	}
	for i := range o.choices {
		c := &o.choices[i]
		cc := completionChoice{Index: c.index, Text: c.text(), FinishReason: c.finish, StopReason: c.stopReason}
		if p.req.logprobs {
			cc.Logprobs = completionLogprobs(c, 0, len(c.pieces), 0)
		}
		resp.Choices = append(resp.Choices, cc)
	}
	return resp
}

// kvValue keeps a nil handoff a JSON null (not an empty object).
func kvValue(h map[string]any) any {
	if h == nil {
		return nil
	}
	return h
}

type chatDelta struct {
	Role    string `json:"role,omitempty"`
	Content string `json:"content"`
}

type streamChoice struct {
	Index        int        `json:"index"`
	Delta        *chatDelta `json:"delta,omitempty"`
	Text         *string    `json:"text,omitempty"`
	Logprobs     any        `json:"logprobs"`
	FinishReason any        `json:"finish_reason"`
	StopReason   any        `json:"stop_reason,omitempty"`
}

type streamChunk struct {
	ID      string         `json:"id"`
	Object  string         `json:"object"`
	Created int64          `json:"created"`
	Model   string         `json:"model"`
	Choices []streamChoice `json:"choices"`
	Usage   *usage         `json:"usage,omitempty"`
}

// streamOpenAI writes chat.completion.chunk / text_completion chunks: for
// chat a role chunk per choice, then one chunk per token and choice (the
// last one carries finish_reason and stop_reason), an optional usage chunk,
// and data: [DONE]. No chunk carries kv_transfer_params.
func (p *responder) streamOpenAI(ctx context.Context, cs []choice) error {
	chat := p.req.route == routeChat
	object := "text_completion"
	if chat {
		object = "chat.completion.chunk"
	}
	emitted := make([]int, len(cs)) // completion tokens so far (continuous usage)
	chunk := func(c streamChoice) error {
		ch := streamChunk{ID: p.id, Object: object, Created: p.created, Model: p.req.model, Choices: []streamChoice{c}}
		if p.req.usageChunk && p.req.contUsage {
			done := 0
			for _, n := range emitted {
				done += n
			}
			pt := p.req.promptTokens()
			ch.Usage = &usage{PromptTokens: pt, CompletionTokens: done, TotalTokens: pt + done}
		}
		return p.sse.Data(ch)
	}
	if chat {
		for i := range cs {
			if err := chunk(streamChoice{Index: cs[i].index, Delta: &chatDelta{Role: "assistant"}}); err != nil {
				return err
			}
		}
	}
	offsets := make([]int, len(cs))
	n := maxTokens(cs)
	for i := range cs {
		if len(cs[i].pieces) == 0 {
			n = max(n, 1) // a choice with no text still sends its finish chunk
		}
	}
	for t := 0; t < n; t++ {
		if err := p.step(ctx, t); err != nil {
			return err
		}
		for i := range cs {
			c := &cs[i]
			last := max(len(c.pieces), 1) - 1
			if t > last {
				continue
			}
			piece := ""
			if t < len(c.pieces) {
				piece = c.pieces[t]
			}
			sc := streamChoice{Index: c.index}
			emitted[i] = t + 1
			if t == last {
				sc.FinishReason, sc.StopReason = c.finish, c.stopReason
				emitted[i] = c.completion
			}
			if chat {
				sc.Delta = &chatDelta{Content: piece}
				if p.req.logprobs && t < len(c.pieces) {
					sc.Logprobs = chatLogprobs(c, t, t+1)
				}
			} else {
				sc.Text = &piece
				if p.req.logprobs && t < len(c.pieces) {
					sc.Logprobs = completionLogprobs(c, t, t+1, offsets[i])
				}
			}
			offsets[i] += len(piece)
			if err := chunk(sc); err != nil {
				return err
			}
		}
	}
	if p.req.usageChunk {
		u := p.usage(cs)
		if err := p.sse.Data(streamChunk{ID: p.id, Object: object, Created: p.created, Model: p.req.model, Choices: []streamChoice{}, Usage: &u}); err != nil {
			return err
		}
	}
	return p.sse.Done()
}

// ---- /v1/messages (Anthropic) ----

func anthropicStop(c *choice) (string, any) {
	switch {
	case c.finish == "length":
		return "max_tokens", nil
	case c.stopReason != nil:
		if s, ok := c.stopReason.(string); ok {
			return "stop_sequence", s
		}
	}
	return "end_turn", nil
}

func (p *responder) messageObj(c *choice, text string, stop, stopSeq any, out int) map[string]any {
	return map[string]any{
		"id": p.id, "type": "message", "role": "assistant", "model": p.req.model,
		"content":     []any{map[string]any{"type": "text", "text": text}},
		"stop_reason": stop, "stop_sequence": stopSeq,
		"usage": map[string]any{"input_tokens": len(c.prompt), "output_tokens": out},
	}
}

func (p *responder) messages(o *outcome) any {
	c := &o.choices[0]
	stop, seq := anthropicStop(c)
	m := p.messageObj(c, c.text(), stop, seq, c.completion)
	m["kv_transfer_params"] = kvValue(o.handoff)
	return m
}

func (p *responder) streamMessages(ctx context.Context, c *choice) error {
	start := p.messageObj(c, "", nil, nil, 0)
	start["content"] = []any{}
	if err := p.sse.MessageStart(start); err != nil {
		return err
	}
	for t, piece := range c.pieces {
		if err := p.step(ctx, t); err != nil {
			return err
		}
		if err := p.sse.MessageText(piece); err != nil {
			return err
		}
	}
	stop, seq := anthropicStop(c)
	return p.sse.MessageEnd(stop, seq, map[string]any{"input_tokens": len(c.prompt), "output_tokens": c.completion})
}

// ---- /v1/responses ----

func (p *responder) responseObj(c *choice, status string, text *string) map[string]any {
	output := []any{}
	if text != nil {
		output = append(output, map[string]any{
			"type": "message", "id": "msg_" + p.req.rid, "status": "completed", "role": "assistant",
			"content": []any{map[string]any{"type": "output_text", "text": *text, "annotations": []any{}, "logprobs": nil}},
		})
	}
	r := map[string]any{
		"id": p.id, "object": "response", "created_at": p.created, "status": status,
		"model": p.req.model, "output": output, "incomplete_details": nil, "error": nil,
	}
	if c.finish == "length" && text != nil {
		r["status"] = "incomplete"
		r["incomplete_details"] = map[string]any{"reason": "max_output_tokens"}
	}
	if text != nil {
		r["usage"] = map[string]any{
			"input_tokens": len(c.prompt), "output_tokens": c.completion, "total_tokens": len(c.prompt) + c.completion,
			"input_tokens_details": map[string]any{"cached_tokens": 0}, "output_tokens_details": map[string]any{"reasoning_tokens": 0},
		}
	}
	return r
}

func (p *responder) responses(o *outcome) any {
	c := &o.choices[0]
	text := c.text()
	return p.responseObj(c, "completed", &text)
}

func (p *responder) streamResponses(ctx context.Context, c *choice) error {
	ev := p.sse.SequencedEvents()
	if err := ev("response.created", map[string]any{"response": p.responseObj(c, "in_progress", nil)}); err != nil {
		return err
	}
	for t, piece := range c.pieces {
		if err := p.step(ctx, t); err != nil {
			return err
		}
		if err := ev("response.output_text.delta", map[string]any{"item_id": "msg_" + p.req.rid, "output_index": 0, "content_index": 0, "delta": piece}); err != nil {
			return err
		}
	}
	text := c.text()
	if err := ev("response.output_text.done", map[string]any{"item_id": "msg_" + p.req.rid, "output_index": 0, "content_index": 0, "text": text}); err != nil {
		return err
	}
	return ev("response.completed", map[string]any{"response": p.responseObj(c, "completed", &text)})
}
