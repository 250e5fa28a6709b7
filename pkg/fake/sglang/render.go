package sglang

import (
	"context"
	"encoding/json"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/smg-project/smg-extproc/pkg/fake/common"
)

// writeErr writes e with the envelope SGLang uses on that route.
func writeErr(w http.ResponseWriter, rt route, e *apiError) {
	common.WriteJSON(w, e.status, errBody(rt, e))
}

func errBody(rt route, e *apiError) any {
	phrase := http.StatusText(e.status)
	if rt == routeResponses {
		return common.NestedError(e.status, phrase, e.msg)
	}
	if e.kind == errValidation {
		return common.ObjectError(e.status, phrase, e.msg)
	}
	if e.status == http.StatusBadRequest {
		if rt == routeGenerate {
			return common.MessageError(e.msg)
		}
		return common.ObjectError(e.status, "BadRequest", e.msg)
	}
	return common.ObjectError(e.status, strconv.Itoa(e.status), e.msg)
}

type responder struct {
	s       *Server
	w       http.ResponseWriter
	req     *request
	cfg     Config
	kv      string
	sse     *common.SSE
	id      string
	created int64
	start   time.Time
}

func newResponder(s *Server, w http.ResponseWriter, req *request, cfg Config) *responder {
	return &responder{
		s: s, w: w, req: req, cfg: cfg, id: req.rid,
		created: time.Now().Unix(), start: time.Now(),
		sse: common.NewSSE(w, cfg.PerTokenDelay > 0 || cfg.EarlyStreamHead || cfg.HoldBodyOpen > 0),
	}
}

func (p *responder) headSent() bool { return p.sse.Started() }

func (p *responder) setKVHeader() {
	if p.kv != "" {
		p.w.Header().Set(HeaderFakeKV, p.kv)
	}
}

// startStream sends the 200 text/event-stream head now.
func (p *responder) startStream() {
	p.setKVHeader()
	p.sse.Start()
	_ = p.sse.Flush()
}

func (p *responder) flush() { _ = p.sse.Flush() }

func (p *responder) hold() bool { return p.cfg.Mode == Prefill && p.cfg.HoldBodyOpen > 0 }

// fail reports e: as a status + JSON body before the head, in-stream after.
func (p *responder) fail(e *apiError) {
	if !p.headSent() {
		writeErr(p.w, p.req.route, e)
		return
	}
	switch p.req.route {
	case routeGenerate:
		idx := 0
		_ = p.sse.Data(genOut{Text: "", OutputIDs: []int{}, MetaInfo: genMeta{
			ID:            p.id,
			FinishReason:  map[string]any{"type": "abort", "message": e.msg, "status_code": e.status},
			WeightVersion: "default",
		}, Index: indexPtr(p.req.batch, idx)})
		_ = p.sse.Done()
	case routeMessages:
		_ = p.sse.Event("error", map[string]any{"type": "error", "error": map[string]any{"type": "api_error", "message": e.msg}})
	case routeResponses:
		_ = p.sse.Event("error", map[string]any{"type": "error", "code": strconv.Itoa(e.status), "message": e.msg})
	default:
		_ = p.sse.Data(map[string]any{"error": map[string]any{"message": e.msg, "type": strconv.Itoa(e.status), "code": e.status}})
		_ = p.sse.Done()
	}
	p.flush()
}

// writeJSON writes a non-streamed 200 body (no Content-Length when the body
// is to be held open).
func (p *responder) writeJSON(v any) error {
	p.setKVHeader()
	if !p.hold() {
		common.WriteJSON(p.w, http.StatusOK, v)
		return nil
	}
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	p.w.Header().Set("Content-Type", "application/json")
	p.w.WriteHeader(http.StatusOK)
	_, err = p.w.Write(b)
	return err
}

func indexPtr(batch bool, i int) *int {
	if !batch {
		return nil
	}
	return &i
}

// ---- shared token helpers ----

type logprobEntry [3]any

func (p *responder) finishLength(n int) any {
	if p.cfg.Mode == Prefill {
		return map[string]any{"type": "length", "length": 0}
	}
	return map[string]any{"type": "length", "length": n}
}

func promptLogprobs(tokens []int) []logprobEntry {
	out := make([]logprobEntry, len(tokens))
	for i, t := range tokens {
		var lp any
		if v := common.PromptLogprob(tokens, i); v != nil {
			lp = *v
		}
		out[i] = logprobEntry{lp, t, nil}
	}
	return out
}

func fullText(tokens []common.Token) (string, []int) {
	var b strings.Builder
	ids := make([]int, len(tokens))
	for i, t := range tokens {
		b.WriteString(t.Piece(i))
		ids[i] = t.ID
	}
	return b.String(), ids
}

func (p *responder) inputLogprobs(o *outcome) *[]logprobEntry {
	if !p.req.logprobs {
		return nil
	}
	var lp []logprobEntry
	if p.cfg.Mode == Decode && o.kv != "none" {
		lp = []logprobEntry{} // decode computes no prompt rows
	} else {
		lp = promptLogprobs(o.item.tokens)
	}
	return &lp
}

func (p *responder) promptTokens() int {
	n := 0
	for _, pr := range p.req.prompts {
		n += len(pr)
	}
	return n
}

func maxLen(outs []outcome) int {
	m := 0
	for _, o := range outs {
		m = max(m, len(o.tokens))
	}
	return m
}

// render writes the successful response for outs.
func (p *responder) render(ctx context.Context, outs []outcome) error {
	total := 0
	for _, o := range outs {
		total += len(o.tokens)
	}
	p.s.genTokens.Add(int64(total))
	if p.req.route == routeRerank {
		return p.writeJSON(p.rerank())
	}
	if !p.req.stream {
		if p.cfg.Mode != Prefill {
			if err := common.Sleep(ctx, p.cfg.PerTokenDelay*time.Duration(max(maxLen(outs)-1, 0))); err != nil {
				return err
			}
		}
		switch p.req.route {
		case routeGenerate:
			return p.writeJSON(p.generate(outs))
		case routeChat:
			return p.writeJSON(p.chat(outs))
		case routeCompletions:
			return p.writeJSON(p.completions(outs))
		case routeMessages:
			return p.writeJSON(p.messages(&outs[0]))
		default:
			return p.writeJSON(p.responses(&outs[0]))
		}
	}
	p.setKVHeader()
	var err error
	switch p.req.route {
	case routeGenerate:
		err = p.streamGenerate(ctx, outs)
	case routeChat, routeCompletions:
		err = p.streamOpenAI(ctx, outs)
	case routeMessages:
		err = p.streamMessages(ctx, &outs[0])
	default:
		err = p.streamResponses(ctx, &outs[0])
	}
	if err == nil {
		p.flush()
	}
	return err
}

// step waits the per-token delay before output position t > 0.
func (p *responder) step(ctx context.Context, t int) error {
	if t == 0 || p.cfg.Mode == Prefill || p.cfg.PerTokenDelay <= 0 {
		return nil
	}
	return common.Sleep(ctx, p.cfg.PerTokenDelay)
}

// ---- /generate ----

type genMeta struct {
	ID                  string          `json:"id"`
	FinishReason        any             `json:"finish_reason"`
	PromptTokens        int             `json:"prompt_tokens"`
	CompletionTokens    int             `json:"completion_tokens"`
	CachedTokens        int             `json:"cached_tokens"`
	WeightVersion       string          `json:"weight_version"`
	E2ELatency          float64         `json:"e2e_latency"`
	InputTokenLogprobs  *[]logprobEntry `json:"input_token_logprobs,omitempty"`
	OutputTokenLogprobs *[]logprobEntry `json:"output_token_logprobs,omitempty"`
}

type genOut struct {
	Text      string  `json:"text"`
	OutputIDs []int   `json:"output_ids"`
	MetaInfo  genMeta `json:"meta_info"`
	Index     *int    `json:"index,omitempty"`
}

func (p *responder) genItem(o *outcome) genOut {
	text, ids := fullText(o.tokens)
	m := genMeta{
		ID: o.item.rid, FinishReason: p.finishLength(len(o.tokens)),
		PromptTokens: len(o.item.tokens), CompletionTokens: len(o.tokens), CachedTokens: o.cached,
		WeightVersion: "default", E2ELatency: time.Since(p.start).Seconds(),
	}
	if p.req.logprobs {
		m.InputTokenLogprobs = p.inputLogprobs(o)
		out := make([]logprobEntry, len(o.tokens))
		for i, t := range o.tokens {
			out[i] = logprobEntry{t.Logprob, t.ID, nil}
		}
		m.OutputTokenLogprobs = &out
	}
	return genOut{Text: text, OutputIDs: ids, MetaInfo: m}
}

func (p *responder) generate(outs []outcome) any {
	if !p.req.batch && len(outs) == 1 {
		return p.genItem(&outs[0])
	}
	list := make([]genOut, len(outs))
	for i := range outs {
		list[i] = p.genItem(&outs[i])
	}
	return list
}

func (p *responder) streamGenerate(ctx context.Context, outs []outcome) error {
	type cum struct {
		text    string
		ids     []int
		offsets []int
	}
	cs := make([]cum, len(outs))
	for i := range outs {
		text, ids := fullText(outs[i].tokens)
		offs := make([]int, len(outs[i].tokens)+1)
		for j, t := range outs[i].tokens {
			offs[j+1] = offs[j] + len(t.Piece(j))
		}
		cs[i] = cum{text, ids, offs}
	}
	multi := p.req.batch || len(outs) > 1
	n := maxLen(outs)
	for t := 0; t < n; t++ {
		if err := p.step(ctx, t); err != nil {
			return err
		}
		for i := range outs {
			o := &outs[i]
			if t >= len(o.tokens) {
				continue
			}
			final := t == len(o.tokens)-1
			m := genMeta{
				ID: o.item.rid, PromptTokens: len(o.item.tokens), CompletionTokens: t + 1,
				CachedTokens: o.cached, WeightVersion: "default", E2ELatency: time.Since(p.start).Seconds(),
			}
			if final {
				m.FinishReason = p.finishLength(len(o.tokens))
			}
			if p.req.logprobs {
				if t == 0 {
					m.InputTokenLogprobs = p.inputLogprobs(o)
				} else {
					m.InputTokenLogprobs = &[]logprobEntry{}
				}
				m.OutputTokenLogprobs = &[]logprobEntry{{o.tokens[t].Logprob, o.tokens[t].ID, nil}}
			}
			c := &cs[i]
			if err := p.sse.Data(genOut{Text: c.text[:c.offsets[t+1]], OutputIDs: c.ids[:t+1], MetaInfo: m, Index: indexPtr(multi, o.item.k)}); err != nil {
				return err
			}
		}
	}
	return p.sse.Done()
}

// ---- OpenAI chat / completions ----

type usage struct {
	PromptTokens        int `json:"prompt_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	TotalTokens         int `json:"total_tokens"`
	PromptTokensDetails any `json:"prompt_tokens_details"`
}

func (p *responder) usage(outs []outcome) usage {
	c := 0
	for _, o := range outs {
		c += len(o.tokens)
	}
	pt := p.promptTokens()
	return usage{PromptTokens: pt, CompletionTokens: c, TotalTokens: pt + c}
}

// choiceIndex is OpenAI's choice order: prompt-major (i*n + j).
func (p *responder) choiceIndex(it *item) int { return it.batchIdx*p.req.n + it.sample }

func (p *responder) ordered(outs []outcome) []*outcome {
	list := make([]*outcome, len(outs))
	for i := range outs {
		list[i] = &outs[i]
	}
	sort.SliceStable(list, func(a, b int) bool { return p.choiceIndex(list[a].item) < p.choiceIndex(list[b].item) })
	return list
}

type chatMessage struct {
	Role             string  `json:"role"`
	Content          string  `json:"content"`
	ReasoningContent *string `json:"reasoning_content"`
	ToolCalls        any     `json:"tool_calls"`
}

type chatChoice struct {
	Index        int         `json:"index"`
	Message      chatMessage `json:"message"`
	Logprobs     any         `json:"logprobs"`
	FinishReason string      `json:"finish_reason"`
	MatchedStop  any         `json:"matched_stop"`
}

type chatCompletion struct {
	ID       string         `json:"id"`
	Object   string         `json:"object"`
	Created  int64          `json:"created"`
	Model    string         `json:"model"`
	Choices  []chatChoice   `json:"choices"`
	Usage    usage          `json:"usage"`
	Metadata map[string]any `json:"metadata"`
}

type chatLogprob struct {
	Token       string  `json:"token"`
	Logprob     float64 `json:"logprob"`
	Bytes       []int   `json:"bytes"`
	TopLogprobs []any   `json:"top_logprobs"`
}

func chatLogprobs(tokens []common.Token, from int) map[string]any {
	content := make([]chatLogprob, 0, len(tokens))
	for i, t := range tokens {
		content = append(content, chatLogprob{Token: t.Piece(from + i), Logprob: t.Logprob, TopLogprobs: []any{}})
	}
	return map[string]any{"content": content}
}

func completionLogprobs(tokens []common.Token, from, offset int) map[string]any {
	toks := make([]string, len(tokens))
	lps := make([]float64, len(tokens))
	offs := make([]int, len(tokens))
	for i, t := range tokens {
		toks[i] = t.Piece(from + i)
		lps[i] = t.Logprob
		offs[i] = offset
		offset += len(toks[i])
	}
	return map[string]any{"tokens": toks, "token_logprobs": lps, "top_logprobs": nil, "text_offset": offs}
}

func (p *responder) chat(outs []outcome) any {
	resp := chatCompletion{
		ID: p.id, Object: "chat.completion", Created: p.created, Model: p.req.model,
		Usage: p.usage(outs), Metadata: map[string]any{"weight_version": "default"},
	}
	for _, o := range p.ordered(outs) {
		text, _ := fullText(o.tokens)
		c := chatChoice{Index: p.choiceIndex(o.item), Message: chatMessage{Role: "assistant", Content: text}, FinishReason: "length"}
		if p.req.logprobs {
			c.Logprobs = chatLogprobs(o.tokens, 0)
		}
		resp.Choices = append(resp.Choices, c)
	}
	return resp
}

type completionChoice struct {
	Index        int    `json:"index"`
	Text         string `json:"text"`
	Logprobs     any    `json:"logprobs"`
	FinishReason any    `json:"finish_reason"`
	MatchedStop  any    `json:"matched_stop"`
}

type completion struct {
	ID      string             `json:"id"`
	Object  string             `json:"object"`
	Created int64              `json:"created"`
	Model   string             `json:"model"`
	Choices []completionChoice `json:"choices"`
	Usage   usage              `json:"usage"`
}

func (p *responder) completions(outs []outcome) any {
	resp := completion{ID: p.id, Object: "text_completion", Created: p.created, Model: p.req.model, Usage: p.usage(outs)}
	for _, o := range p.ordered(outs) {
		text, _ := fullText(o.tokens)
		c := completionChoice{Index: p.choiceIndex(o.item), Text: text, FinishReason: "length"}
		if p.req.logprobs {
			c.Logprobs = completionLogprobs(o.tokens, 0, 0)
		}
		resp.Choices = append(resp.Choices, c)
	}
	return resp
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
	MatchedStop  any        `json:"matched_stop"`
}

type streamChunk struct {
	ID      string         `json:"id"`
	Object  string         `json:"object"`
	Created int64          `json:"created"`
	Model   string         `json:"model"`
	Choices []streamChoice `json:"choices"`
	Usage   *usage         `json:"usage,omitempty"`
}

func (p *responder) streamOpenAI(ctx context.Context, outs []outcome) error {
	chat := p.req.route == routeChat
	object := "text_completion"
	if chat {
		object = "chat.completion.chunk"
	}
	ordered := p.ordered(outs)
	chunk := func(c streamChoice) error {
		return p.sse.Data(streamChunk{ID: p.id, Object: object, Created: p.created, Model: p.req.model, Choices: []streamChoice{c}})
	}
	if chat {
		for _, o := range ordered {
			if err := chunk(streamChoice{Index: p.choiceIndex(o.item), Delta: &chatDelta{Role: "assistant"}}); err != nil {
				return err
			}
		}
	}
	offsets := make([]int, len(ordered))
	n := maxLen(outs)
	for t := 0; t < n; t++ {
		if err := p.step(ctx, t); err != nil {
			return err
		}
		for i, o := range ordered {
			if t >= len(o.tokens) {
				continue
			}
			piece := o.tokens[t].Piece(t)
			c := streamChoice{Index: p.choiceIndex(o.item)}
			if t == len(o.tokens)-1 {
				c.FinishReason = "length"
			}
			if chat {
				c.Delta = &chatDelta{Content: piece}
				if p.req.logprobs {
					c.Logprobs = chatLogprobs(o.tokens[t:t+1], t)
				}
			} else {
				c.Text = &piece
				if p.req.logprobs {
					c.Logprobs = completionLogprobs(o.tokens[t:t+1], t, offsets[i])
				}
			}
			offsets[i] += len(piece)
			if err := chunk(c); err != nil {
				return err
			}
		}
	}
	if p.req.usageChunk {
		u := p.usage(outs)
		if err := p.sse.Data(streamChunk{ID: p.id, Object: object, Created: p.created, Model: p.req.model, Choices: []streamChoice{}, Usage: &u}); err != nil {
			return err
		}
	}
	return p.sse.Done()
}

// ---- /v1/messages (Anthropic) ----

func (p *responder) messageObj(o *outcome, text string, stop any, outTokens int) map[string]any {
	return map[string]any{
		"id": "msg_" + p.id, "type": "message", "role": "assistant", "model": p.req.model,
		"content":     []any{map[string]any{"type": "text", "text": text}},
		"stop_reason": stop, "stop_sequence": nil,
		"usage": map[string]any{"input_tokens": len(o.item.tokens), "output_tokens": outTokens},
	}
}

func (p *responder) messages(o *outcome) any {
	text, _ := fullText(o.tokens)
	return p.messageObj(o, text, "max_tokens", len(o.tokens))
}

func (p *responder) streamMessages(ctx context.Context, o *outcome) error {
	start := p.messageObj(o, "", nil, 0)
	start["content"] = []any{}
	if err := p.sse.MessageStart(start); err != nil {
		return err
	}
	for t, tok := range o.tokens {
		if err := p.step(ctx, t); err != nil {
			return err
		}
		if err := p.sse.MessageText(tok.Piece(t)); err != nil {
			return err
		}
	}
	return p.sse.MessageEnd("max_tokens", nil, map[string]any{"output_tokens": len(o.tokens)})
}

// ---- /v1/responses ----

func (p *responder) responseObj(o *outcome, status string, text *string) map[string]any {
	output := []any{}
	if text != nil {
		output = append(output, map[string]any{
			"type": "message", "id": "msg_" + p.id, "status": "completed", "role": "assistant",
			"content": []any{map[string]any{"type": "output_text", "text": *text, "annotations": []any{}}},
		})
	}
	r := map[string]any{
		"id": "resp_" + p.id, "object": "response", "created_at": p.created, "status": status,
		"model": p.req.model, "output": output, "incomplete_details": nil, "error": nil,
	}
	if text != nil {
		r["usage"] = map[string]any{"input_tokens": len(o.item.tokens), "output_tokens": len(o.tokens), "total_tokens": len(o.item.tokens) + len(o.tokens)}
	}
	return r
}

func (p *responder) responses(o *outcome) any {
	text, _ := fullText(o.tokens)
	return p.responseObj(o, "completed", &text)
}

func (p *responder) streamResponses(ctx context.Context, o *outcome) error {
	ev := p.sse.SequencedEvents()
	if err := ev("response.created", map[string]any{"response": p.responseObj(o, "in_progress", nil)}); err != nil {
		return err
	}
	for t, tok := range o.tokens {
		if err := p.step(ctx, t); err != nil {
			return err
		}
		if err := ev("response.output_text.delta", map[string]any{"item_id": "msg_" + p.id, "output_index": 0, "content_index": 0, "delta": tok.Piece(t)}); err != nil {
			return err
		}
	}
	text, _ := fullText(o.tokens)
	if err := ev("response.output_text.done", map[string]any{"item_id": "msg_" + p.id, "output_index": 0, "content_index": 0, "text": text}); err != nil {
		return err
	}
	return ev("response.completed", map[string]any{"response": p.responseObj(o, "completed", &text)})
}

// ---- /v1/rerank ----

func (p *responder) rerank() any {
	type result struct {
		Score    float64        `json:"score"`
		Document *string        `json:"document,omitempty"`
		Index    int            `json:"index"`
		MetaInfo map[string]any `json:"meta_info"`
	}
	out := make([]result, len(p.req.docs))
	for i := range p.req.docs {
		r := result{
			Score: common.Score(p.req.query, p.req.docTokens[i]), Index: i,
			MetaInfo: map[string]any{"id": p.id, "prompt_tokens": len(p.req.query) + len(p.req.docTokens[i]), "weight_version": "default"},
		}
		if p.req.returnDocs {
			d := p.req.docs[i]
			r.Document = &d
		}
		out[i] = r
	}
	sort.SliceStable(out, func(a, b int) bool { return out[a].Score > out[b].Score })
	return out
}
