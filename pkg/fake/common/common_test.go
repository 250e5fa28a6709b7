package common_test

import (
	"context"
	"encoding/json"
	"hash/crc32"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/smg-project/smg-extproc/pkg/fake/common"
)

func TestTokenize(t *testing.T) {
	cases := []struct {
		text string
		want []int
	}{
		{"", []int{}},
		{"  ", []int{}},
		{"hello", []int{int(crc32.ChecksumIEEE([]byte("hello")) % 50000)}},
		{"a  b\n\tc", []int{common.TokenID("a"), common.TokenID("b"), common.TokenID("c")}},
	}
	for _, tc := range cases {
		t.Run(tc.text, func(t *testing.T) {
			assert.Equal(t, tc.want, common.Tokenize(tc.text))
		})
	}
}

func TestGenerationIsDeterministic(t *testing.T) {
	h := common.HashTokens(common.Tokenize("the same prompt"))
	cases := []struct {
		name      string
		a, b      []common.Token
		wantEqual bool
	}{
		{"same prompt same sample", common.Generate(h, 0, 10), common.Generate(h, 0, 10), true},
		{"prefix property", common.Generate(h, 0, 10)[:3], common.Generate(h, 0, 3), true},
		{"other sample", common.Generate(h, 0, 10), common.Generate(h, 1, 10), false},
		{"other prompt", common.Generate(h, 0, 10), common.Generate(common.HashTokens(common.Tokenize("another")), 0, 10), false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if tc.wantEqual {
				assert.Equal(t, tc.a, tc.b)
			} else {
				assert.NotEqual(t, tc.a, tc.b)
			}
		})
	}
	for _, tok := range common.Generate(h, 0, 50) {
		assert.Equal(t, common.TokenID(tok.Word), tok.ID, "output ids follow the tokenizer")
		assert.Less(t, tok.Logprob, 0.0)
		assert.NotContains(t, tok.Word, " ")
	}
	assert.NotEqual(t, common.HashTokens([]int{1, 2}), common.HashTokens([]int{2, 1}))
	assert.NotEqual(t, common.HashTokens(nil), common.HashTokens([]int{0}))
	assert.Nil(t, common.PromptLogprob([]int{1, 2}, 0))
	assert.NotNil(t, common.PromptLogprob([]int{1, 2}, 1))
	s := common.Score([]int{1}, []int{2})
	assert.Greater(t, s, 0.0)
	assert.Less(t, s, 1.0)
}

func TestLogsAreBounded(t *testing.T) {
	el := common.NewEventLog(3)
	for i := 0; i < 5; i++ {
		el.Add(common.Event{Leg: "x", Outcome: string(rune('a' + i))})
	}
	evs := el.Snapshot()
	require.Len(t, evs, 3)
	assert.Equal(t, []string{"c", "d", "e"}, []string{evs[0].Outcome, evs[1].Outcome, evs[2].Outcome})
	assert.Equal(t, uint64(5), evs[2].Seq)
	assert.Equal(t, uint64(2), el.Dropped())
	el.Reset()
	assert.Empty(t, el.Snapshot())

	rl := common.NewRequestLog(2)
	for i := 0; i < 3; i++ {
		r := httptest.NewRequest(http.MethodPost, "/generate?x=1", nil)
		r.Header.Set("X-Test", "v")
		rl.Record(r, []byte(`{"i":`+string(rune('0'+i))+`}`), time.Now())
	}
	reqs := rl.Snapshot()
	require.Len(t, reqs, 2)
	assert.Equal(t, uint64(3), rl.Total())
	assert.Equal(t, "x=1", reqs[0].RawQuery)
	b, err := json.Marshal(reqs[1])
	require.NoError(t, err)
	assert.Contains(t, string(b), `"body_json":{"i":2}`)
	var back common.RecordedRequest
	require.NoError(t, json.Unmarshal(b, &back))
	assert.Equal(t, reqs[1].Body, back.Body)
	assert.Equal(t, "v", back.Header.Get("X-Test"))
}

func TestSSEAndSleep(t *testing.T) {
	rec := httptest.NewRecorder()
	s := common.NewSSE(rec, true)
	require.NoError(t, s.Data(map[string]int{"a": 1}))
	require.NoError(t, s.Event("ping", map[string]int{"b": 2}))
	require.NoError(t, s.Done())
	assert.Equal(t, "text/event-stream", rec.Header().Get("Content-Type"))
	assert.Equal(t, "data: {\"a\":1}\n\nevent: ping\ndata: {\"b\":2}\n\ndata: [DONE]\n\n", rec.Body.String())

	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	assert.ErrorIs(t, common.Sleep(ctx, time.Hour), context.Canceled)
	assert.NoError(t, common.Sleep(context.Background(), time.Millisecond))

	rec = httptest.NewRecorder()
	common.WriteJSON(rec, http.StatusTeapot, common.ObjectError(418, "x", "m"))
	assert.Equal(t, http.StatusTeapot, rec.Code)
	assert.JSONEq(t, `{"object":"error","message":"m","type":"x","param":null,"code":418}`, rec.Body.String())
	assert.True(t, strings.HasPrefix(rec.Header().Get("Content-Type"), "application/json"))
}
