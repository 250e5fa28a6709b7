package vllm

import (
	"slices"
	"strings"

	"github.com/smg-project/smg-extproc/pkg/fake/common"
)

// Fake KV states reported in X-Fake-KV.
const (
	kvTransferred = "transferred"
	kvRecomputed  = "recomputed"
	kvNone        = "none"
)

// genParams are the sampling parameters that shape the fake output.
type genParams struct {
	max       int
	stop      []string
	stopIDs   []int
	ignoreEOS bool
	eosAt     int
}

func (req *request) genParams(cfg Config) genParams {
	return genParams{max: req.maxTokens, stop: req.stop, stopIDs: req.stopIDs, ignoreEOS: req.ignoreEOS, eosAt: cfg.EOSAt}
}

// choice is one generated sequence.
type choice struct {
	index      int
	prompt     []int
	tokens     []common.Token // tokens whose text is (at least partly) in the output
	pieces     []string       // the text each token contributes (a stop string cuts it)
	completion int            // completion_tokens (includes a matched EOS / stop token)
	finish     string         // "length" or "stop"
	stopReason any            // nil, the matched stop string, or the stop token id
}

func (c *choice) text() string { return strings.Join(c.pieces, "") }

// generate runs the deterministic fake sampler for one sequence. With first
// set (a transferred handoff), the first token is the prefill's.
func generate(prompt []int, sample int, gp genParams, first *common.Token) choice {
	c := choice{prompt: prompt, finish: "length"}
	g := common.NewGenerator(common.HashTokens(prompt), sample)
	for t := 0; t < gp.max; t++ {
		tok := g.Next()
		if t == 0 && first != nil {
			tok = *first
		}
		c.completion = t + 1
		if gp.eosAt > 0 && t+1 == gp.eosAt && !gp.ignoreEOS {
			c.finish = "stop"
			return c
		}
		if slices.Contains(gp.stopIDs, tok.ID) {
			c.finish, c.stopReason = "stop", tok.ID
			return c
		}
		piece := tok.Piece(t)
		c.tokens = append(c.tokens, tok)
		c.pieces = append(c.pieces, piece)
		if len(gp.stop) == 0 {
			continue
		}
		text := c.text()
		cut, matched := -1, ""
		for _, s := range gp.stop {
			if i := strings.Index(text, s); i >= 0 && (cut < 0 || i < cut) {
				cut, matched = i, s
			}
		}
		if cut >= 0 {
			c.truncate(cut)
			c.finish, c.stopReason = "stop", matched
			return c
		}
	}
	return c
}

// truncate cuts the output text to n bytes (dropping tokens wholly after it).
func (c *choice) truncate(n int) {
	total := 0
	for i, p := range c.pieces {
		if total+len(p) >= n {
			c.pieces[i] = p[:n-total]
			c.pieces = c.pieces[:i+1]
			c.tokens = c.tokens[:i+1]
			return
		}
		total += len(p)
	}
}

// outcome is the result of a generation request.
type outcome struct {
	choices  []choice
	kv       string         // X-Fake-KV ("" on prefill legs)
	handoff  map[string]any // top-level kv_transfer_params (nil → null)
	handoffS string         // X-Fake-Handoff on prefill legs
}

// generateAll runs every (prompt, sample) of req in OpenAI choice order
// (prompt-major). first, when set, seeds choice 0.
func generateAll(req *request, cfg Config, first *common.Token) []choice {
	gp := req.genParams(cfg)
	out := make([]choice, 0, len(req.prompts)*req.n)
	for i, p := range req.prompts {
		for j := 0; j < req.n; j++ {
			var f *common.Token
			if i == 0 && j == 0 {
				f = first
			}
			c := generate(p, j, gp, f)
			c.index = i*req.n + j
			out = append(out, c)
		}
	}
	return out
}
