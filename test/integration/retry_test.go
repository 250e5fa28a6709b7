package integration

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/smg-project/smg-extproc/pkg/fake/sglang"
)

// TestRetriesRepairBothLegs: a decode that fails with 500 is retried as a
// whole new attempt — new pair, freshly minted room, new prefill leg — and
// the client gets 200 from the healthy decode.
func TestRetriesRepairBothLegs(t *testing.T) {
	p := startFake(t, fastFake(sglang.Prefill))
	bad := fastFake(sglang.Decode)
	bad.FailStatus, bad.FailBody = 500, `{"error":{"message":"decode exploded"}}`
	d1 := startFake(t, bad)
	d2 := startFake(t, fastFake(sglang.Decode))
	gw := startGateway(t, gwOpts{
		Prefills: []prefillSpec{{URL: p.URL(), Port: fmt.Sprint(p.BootstrapPort())}},
		Decodes:  []string{d1.URL(), d2.URL()},
		Extra:    []string{"--policy", "round_robin", "--retry-max-retries", "3", "--retry-initial-backoff-ms", "20"},
	})
	for i := 0; i < 4; i++ {
		p.Reset()
		d1.Reset()
		d2.Reset()
		stream := i%2 == 1
		r := post(t, gw.URL+"/v1/chat/completions", fmt.Sprintf(`{"messages":[{"role":"user","content":"retry me %d"}],"max_tokens":3,"stream":%t}`, i, stream), nil)
		require.Equal(t, 200, r.Status, "request %d: %s", i, r.Body)
		assert.Equal(t, d2.URL(), r.Header.Get("x-smg-routed-worker-id"))
		assert.Equal(t, "transferred", r.Header.Get("X-Fake-KV"))

		// Every attempt minted its own room; the prefill saw one leg per attempt.
		rooms := map[string]bool{}
		for _, rq := range append(d1.Requests(), d2.Requests()...) {
			var m map[string]json.RawMessage
			require.NoError(t, json.Unmarshal(rq.Body, &m))
			room := string(m["bootstrap_room"])
			assert.False(t, rooms[room], "a retry reused room %s", room)
			rooms[room] = true
			assert.Empty(t, rq.Header.Get("X-Envoy-Original-Url"), "redirect headers must not reach a decode")
			assert.Empty(t, rq.RawQuery, "the attempt key must not reach a decode")
		}
		assert.Len(t, p.Requests(), len(d1.Requests())+len(d2.Requests()), "one prefill leg per attempt")
		assert.Len(t, d2.Requests(), 1)
	}

	t.Run("exhausted-retries-return-the-last-error", func(t *testing.T) {
		d1.Reset() // Reset restores a fake's start-up config, so it comes first
		d2.Reset()
		d2.UpdateConfig(func(c *sglang.Config) { c.FailStatus, c.FailBody = 503, `{"error":{"message":"also down"}}` })
		defer d2.UpdateConfig(func(c *sglang.Config) { c.FailStatus, c.FailBody = 0, "" })
		r := post(t, gw.URL+"/v1/completions", `{"prompt":"x","max_tokens":2}`, nil)
		require.True(t, r.Status == 500 || r.Status == 503, "status %d: %s", r.Status, r.Body)
		code, _, _ := errorBody(t, r)
		assert.True(t, strings.HasPrefix(code, "decode_"), code)
		assert.Equal(t, 3, len(d1.Requests())+len(d2.Requests()), "3 attempts in all")
	})

	t.Run("non-retryable-status-is-returned-at-once", func(t *testing.T) {
		d1.Reset()
		d2.Reset()
		d1.UpdateConfig(func(c *sglang.Config) { c.FailStatus, c.FailBody = 400, `{"error":{"message":"bad input"}}` })
		d2.UpdateConfig(func(c *sglang.Config) { c.FailStatus, c.FailBody = 400, `{"error":{"message":"bad input"}}` })
		r := post(t, gw.URL+"/v1/completions", `{"prompt":"x","max_tokens":2}`, nil)
		require.Equal(t, 400, r.Status)
		assert.Equal(t, 1, len(d1.Requests())+len(d2.Requests()))
	})
}
