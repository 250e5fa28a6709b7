package integration

import (
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestLargePromptAndConcurrency: a 10 MiB prompt crosses Envoy, the ext_proc
// stream and both legs intact; 200 concurrent requests all pair, with no room
// ever reused (the strict fakes reject a duplicate room).
func TestLargePromptAndConcurrency(t *testing.T) {
	s := newStack(t)

	t.Run("10MiB-prompt", func(t *testing.T) {
		s.reset()
		words := strings.Repeat("lorem ipsum dolor sit amet ", 10<<20/27+1)
		body := fmt.Sprintf(`{"model":"fake-model","messages":[{"role":"user","content":%q}],"max_tokens":2}`, words)
		require.Greater(t, len(body), 10<<20)
		r := post(t, s.GW.URL+"/v1/chat/completions", body, nil)
		require.Equal(t, 200, r.Status, "body: %.300s", r.Body)
		pr := onlyRequest(t, "prefill", s.P.Requests())
		dr := onlyRequest(t, "decode", s.D.Requests())
		assert.Equal(t, len(pr.Body), len(dr.Body))
		assert.True(t, strings.HasPrefix(string(dr.Body), body[:len(body)-1]), "decode body keeps the client's 10 MiB verbatim")
	})

	t.Run("200-concurrent", func(t *testing.T) {
		s.reset()
		const n = 200
		var wg sync.WaitGroup
		statuses := make([]int, n)
		for i := 0; i < n; i++ {
			wg.Add(1)
			go func(i int) {
				defer wg.Done()
				stream := i%2 == 0
				body := fmt.Sprintf(`{"messages":[{"role":"user","content":"request number %d"}],"max_tokens":3,"stream":%t}`, i, stream)
				r := post(t, s.GW.URL+"/v1/chat/completions", body, nil)
				statuses[i] = r.Status
			}(i)
		}
		wg.Wait()
		for i, st := range statuses {
			assert.Equal(t, 200, st, "request %d", i)
		}
		rooms := map[string]bool{}
		for _, r := range s.P.Requests() {
			var m map[string]json.RawMessage
			require.NoError(t, json.Unmarshal(r.Body, &m))
			room := string(m["bootstrap_room"])
			assert.False(t, rooms[room], "room %s reused", room)
			rooms[room] = true
		}
		assert.Len(t, rooms, n)
		assert.Len(t, s.D.Requests(), n)
	})
}

// TestDPRankedWorkers: URL@rank workers get SGLang's DP keys and are called
// without the suffix.
func TestDPRankedWorkers(t *testing.T) {
	p := startFake(t, fastFake("prefill"))
	d := startFake(t, fastFake("decode"))
	gw := startGateway(t, gwOpts{
		Prefills: []prefillSpec{{URL: p.URL() + "@0", Port: fmt.Sprint(p.BootstrapPort())}},
		Decodes:  []string{d.URL() + "@0"},
	})
	r := post(t, gw.URL+"/generate", `{"text":"dp ranks","sampling_params":{"max_new_tokens":2}}`, nil)
	require.Equal(t, 200, r.Status, "body: %s", r.Body)
	assert.Equal(t, d.URL()+"@0", r.Header.Get("x-smg-routed-worker-id"))
	pb := legBody(t, onlyRequest(t, "prefill", p.Requests()))
	db := legBody(t, onlyRequest(t, "decode", d.Requests()))
	assert.Equal(t, json.Number("0"), pb["routed_dp_rank"])
	assert.NotContains(t, pb, "disagg_prefill_dp_rank")
	assert.Equal(t, json.Number("0"), db["disagg_prefill_dp_rank"])
	assert.Equal(t, json.Number("0"), db["routed_dp_rank"])
	assert.Equal(t, "/generate", onlyRequest(t, "prefill", p.Requests()).Path)
}
