package vllm

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"reflect"
	"strings"
	"time"

	"github.com/smg-project/smg-extproc/pkg/fake/common"
)

// transferToken is the first token a handoff carries to the decode.
type transferToken struct {
	ID      int     `json:"id"`
	Word    string  `json:"word"`
	Logprob float64 `json:"logprob"`
}

func toTransfer(t common.Token) *transferToken {
	return &transferToken{ID: t.ID, Word: t.Word, Logprob: t.Logprob}
}

func (t *transferToken) token() *common.Token {
	return &common.Token{ID: t.ID, Word: t.Word, Logprob: t.Logprob}
}

// readResult is what a prefill's side channel answers a decode's read
// (NIXL read, Mooncake pull, MoRI-IO READ) or pushes (MoRI-IO WRITE).
type readResult struct {
	Status     string         `json:"status"` // ok | failed
	Reason     string         `json:"reason,omitempty"`
	FirstToken *transferToken `json:"first_token,omitempty"`
}

// readRequest is a decode's read of a held handoff.
type readRequest struct {
	EngineID   string          `json:"remote_engine_id"`
	RequestID  string          `json:"remote_request_id,omitempty"`
	TransferID string          `json:"transfer_id,omitempty"`
	BlockIDs   json.RawMessage `json:"remote_block_ids,omitempty"`
	TPSize     json.RawMessage `json:"tp_size,omitempty"`
	PromptHash string          `json:"prompt_hash"`
	PromptLen  int             `json:"prompt_len"`
	RID        string          `json:"rid,omitempty"`
	Decode     string          `json:"decode,omitempty"`
}

func readFail(w http.ResponseWriter, status int, format string, args ...any) {
	common.WriteJSON(w, status, readResult{Status: "failed", Reason: fmt.Sprintf(format, args...)})
}

func readOK(w http.ResponseWriter, t common.Token) {
	common.WriteJSON(w, http.StatusOK, readResult{Status: "ok", FirstToken: toTransfer(t)})
}

func decodeBody(r *http.Request, v any) error {
	return json.NewDecoder(io.LimitReader(r.Body, 1<<20)).Decode(v)
}

// callJSON sends a JSON request (body nil: GET) and decodes a JSON answer
// into out. It returns the status, or an error for transport failures and
// undecodable answers.
func (s *Server) callJSON(ctx context.Context, method, url string, body, out any) (int, error) {
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return 0, err
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, url, rd)
	if err != nil {
		return 0, err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := s.client.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return resp.StatusCode, err
	}
	if out != nil {
		if err := json.Unmarshal(raw, out); err != nil {
			return resp.StatusCode, fmt.Errorf("%s %s: %d %s", method, url, resp.StatusCode, strings.TrimSpace(string(raw)))
		}
	}
	return resp.StatusCode, nil
}

// read posts a readRequest-like body and turns the answer into a token or a
// load failure reason.
func (s *Server) read(ctx context.Context, url string, body any) (*common.Token, string) {
	var res readResult
	status, err := s.callJSON(ctx, http.MethodPost, url, body, &res)
	switch {
	case err != nil && ctx.Err() != nil:
		return nil, "timed out: " + err.Error()
	case err != nil:
		return nil, err.Error()
	case status != http.StatusOK || res.Status != "ok" || res.FirstToken == nil:
		if res.Reason == "" {
			res.Reason = fmt.Sprintf("side channel answered %d", status)
		}
		return nil, res.Reason
	}
	return res.FirstToken.token(), ""
}

// newBlockIDs returns one list of random block ids per KV-cache group,
// ceil(promptLen/blockSize) (at least 1) long.
func newBlockIDs(promptLen int, cfg Config) [][]int {
	n := max((promptLen+cfg.BlockSize-1)/cfg.BlockSize, 1)
	out := make([][]int, cfg.KVGroups)
	for g := range out {
		out[g] = make([]int, n)
		for i := range out[g] {
			out[g][i] = rand.IntN(1 << 20)
		}
	}
	return out
}

// normJSON re-decodes v's JSON form into generic values, so that a value
// issued by the fake and one echoed by a gateway compare with DeepEqual.
func normJSON(v any) any {
	var b []byte
	switch x := v.(type) {
	case json.RawMessage:
		b = x
	default:
		var err error
		if b, err = json.Marshal(v); err != nil {
			return nil
		}
	}
	var out any
	if json.Unmarshal(b, &out) != nil {
		return nil
	}
	return out
}

func sameJSON(a, b any) bool { return reflect.DeepEqual(normJSON(a), normJSON(b)) }

// nonEmptyList reports whether raw is a JSON list with at least one element.
func nonEmptyList(raw json.RawMessage) bool {
	var l []json.RawMessage
	return common.FirstByte(raw) == '[' && json.Unmarshal(raw, &l) == nil && len(l) > 0
}

// memory is a bounded FIFO map of ids that left a table (consumed, expired,
// failed) to the reason, so that a late or repeated use fails with a
// precise message.
type memory struct {
	m     map[string]string
	order []string
	limit int
}

func newMemory(limit int) memory { return memory{m: map[string]string{}, limit: limit} }

func (m *memory) add(id, reason string) {
	if _, ok := m.m[id]; !ok {
		m.order = append(m.order, id)
		if len(m.order) > m.limit {
			delete(m.m, m.order[0])
			m.order = m.order[1:]
		}
	}
	m.m[id] = reason
}

func (m *memory) get(id string) (string, bool) {
	r, ok := m.m[id]
	return r, ok
}

func (m *memory) reset() {
	m.m = map[string]string{}
	m.order = nil
}

// HeldHandoff is one handoff held by a prefill (or a MoRI-IO / Mooncake
// transfer known to it) in GET /_fake/state.
type HeldHandoff struct {
	Key      string `json:"key"` // remote_request_id (NIXL) or transfer_id
	RID      string `json:"rid,omitempty"`
	Stage    string `json:"stage"`
	Rank     int    `json:"dp_rank"`
	EngineID string `json:"engine_id,omitempty"`
	Claimed  bool   `json:"claimed,omitempty"`
	SinceMS  int64  `json:"since_ms"`
}

func sinceMS(t time.Time) int64 { return time.Since(t).Milliseconds() }
