package sglang_test

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/smg-project/smg-extproc/pkg/fake/common"
	"github.com/smg-project/smg-extproc/pkg/fake/sglang"
)

const shortTimeout = 300 * time.Millisecond

func short(p, d *sglang.Config) {
	p.BootstrapTimeout = shortTimeout
	d.WaitingTimeout = shortTimeout
}

var chatBody = map[string]any{"model": "m", "messages": []any{map[string]any{"role": "user", "content": "hello world"}}, "max_tokens": 4}

// The §5.1 oracle table: each gateway bug makes the fakes fail as specified.
func TestGatewayBugOracles(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name string
		mut  func(p, d *sglang.Config)
		run  func(t *testing.T, pair pdPair)
	}{
		{
			name: "missing room is 400 on both legs",
			run: func(t *testing.T, pair pdPair) {
				for _, path := range []string{"/generate", "/v1/chat/completions"} {
					body := map[string]any{"text": "a b", "messages": chatBody["messages"], "bootstrap_host": "127.0.0.1", "bootstrap_port": pair.p.BootstrapPort()}
					pr, dr := parallel(t.Context(), pair.p.URL()+path, body, pair.d.URL()+path, body)
					for _, r := range []resp{pr, dr} {
						require.Equal(t, http.StatusBadRequest, r.status, string(r.body))
						assert.Regexp(t, `^Invalid request: Disaggregated request received without bootstrap room id\. req\.rid='.+'$`, r.errMessage(t))
					}
					if path == "/generate" {
						assert.Len(t, dr.json(t), 1, "/generate uses the bare {\"error\":{\"message\"}} envelope")
					} else {
						assert.Equal(t, "error", dr.json(t)["object"])
					}
				}
			},
		},
		{
			name: "different rooms time out on both legs",
			mut:  short,
			run: func(t *testing.T, pair pdPair) {
				a, b := newRoom(), newRoom()
				pr, dr := parallel(t.Context(),
					pair.p.URL()+"/v1/chat/completions", withBoot(chatBody, "127.0.0.1", pair.p.BootstrapPort(), a),
					pair.d.URL()+"/v1/chat/completions", withBoot(chatBody, "127.0.0.1", pair.p.BootstrapPort(), b))
				require.Equal(t, http.StatusInternalServerError, pr.status, string(pr.body))
				require.Equal(t, http.StatusInternalServerError, dr.status, string(dr.body))
				assert.Equal(t, fmt.Sprintf("Request %d timed out after 0.3s in KVPoll.Bootstrapping", a), tail(pr.errMessage(t), a))
				assert.Contains(t, pr.errMessage(t), "Prefill transfer failed for request rank=0")
				assert.Contains(t, dr.errMessage(t), fmt.Sprintf("Decode transfer failed for request rank=0 decode_req.req.rid="))
				assert.Contains(t, dr.errMessage(t), fmt.Sprintf("Request %d timed out after 0.3s in KVPoll.WaitingForInput", b))
				assert.Equal(t, "500", pr.json(t)["type"])
			},
		},
		{
			name: "wrong bootstrap port is a decode handshake 500",
			mut:  short,
			run: func(t *testing.T, pair pdPair) {
				port := freePort(t)
				body := withBoot(chatBody, "127.0.0.1", port, newRoom())
				pr, dr := parallel(t.Context(), pair.p.URL()+"/v1/chat/completions", body, pair.d.URL()+"/v1/chat/completions", body)
				require.Equal(t, http.StatusInternalServerError, dr.status, string(dr.body))
				assert.Contains(t, dr.errMessage(t), "Decode handshake failed for request rank=0")
				assert.Contains(t, dr.errMessage(t), fmt.Sprintf("Could not fetch prefill parallel info from 127.0.0.1:%d after 3 attempts", port))
				require.Equal(t, http.StatusInternalServerError, pr.status, "the prefill never sees a decode")
				assert.Contains(t, pr.errMessage(t), "KVPoll.Bootstrapping")
			},
		},
		{
			name: "missing host dials None and fails the handshake",
			run: func(t *testing.T, pair pdPair) {
				body := map[string]any{"text": "a", "bootstrap_port": pair.p.BootstrapPort(), "bootstrap_room": newRoom()}
				dr := post(t.Context(), pair.d.URL()+"/generate", body)
				require.Equal(t, http.StatusInternalServerError, dr.status, string(dr.body))
				assert.Contains(t, dr.errMessage(t), fmt.Sprintf("from None:%d after 3 attempts", pair.p.BootstrapPort()))
			},
		},
		{
			name: "port omitted while the prefill uses a non-default port",
			mut: func(p, d *sglang.Config) {
				short(p, d)
				d.BootstrapPort = 1 // nothing listens on port 1
			},
			run: func(t *testing.T, pair pdPair) {
				body := map[string]any{"text": "a", "bootstrap_host": "127.0.0.1", "bootstrap_room": newRoom()}
				_, dr := parallel(t.Context(), pair.p.URL()+"/generate", body, pair.d.URL()+"/generate", body)
				require.Equal(t, http.StatusInternalServerError, dr.status, string(dr.body))
				assert.Contains(t, dr.errMessage(t), "from 127.0.0.1:1 after 3 attempts")
			},
		},
		{
			name: "decode only is a 500 after the waiting timeout",
			mut:  short,
			run: func(t *testing.T, pair pdPair) {
				room := newRoom()
				dr := post(t.Context(), pair.d.URL()+"/generate", withBoot(map[string]any{"text": "a"}, "127.0.0.1", pair.p.BootstrapPort(), room))
				require.Equal(t, http.StatusInternalServerError, dr.status, string(dr.body))
				assert.Contains(t, dr.errMessage(t), fmt.Sprintf("KVTransferError(bootstrap_room=%d): Request %d timed out after 0.3s in KVPoll.WaitingForInput", room, room))
				assert.GreaterOrEqual(t, dr.elapsed, shortTimeout)
				assert.Eventually(t, func() bool { return len(pair.p.State().PendingRooms) == 0 }, 5*time.Second, 10*time.Millisecond,
					"the decode's abort cleans the prefill's table")
			},
		},
		{
			name: "prefill only is a 500 after the bootstrap timeout",
			mut:  short,
			run: func(t *testing.T, pair pdPair) {
				room := newRoom()
				pr := post(t.Context(), pair.p.URL()+"/v1/completions", withBoot(map[string]any{"prompt": "a b"}, "127.0.0.1", pair.p.BootstrapPort(), room))
				require.Equal(t, http.StatusInternalServerError, pr.status, string(pr.body))
				assert.Contains(t, pr.errMessage(t), fmt.Sprintf("Prefill transfer failed for request rank=0 req.rid='"))
				assert.Contains(t, pr.errMessage(t), fmt.Sprintf("req.bootstrap_room=%d with exception KVTransferError(bootstrap_room=%d): Request %d timed out after 0.3s in KVPoll.Bootstrapping", room, room, room))
				assert.GreaterOrEqual(t, pr.elapsed, shortTimeout)
				assert.Empty(t, pair.p.State().PendingRooms)
			},
		},
		{
			name: "sequential dispatch deadlocks until the bootstrap timeout",
			mut:  short,
			run: func(t *testing.T, pair pdPair) {
				body := withBoot(map[string]any{"text": "a b c", "stream": true}, "127.0.0.1", pair.p.BootstrapPort(), newRoom())
				pr := post(t.Context(), pair.p.URL()+"/generate", body)
				require.Equal(t, http.StatusInternalServerError, pr.status, string(pr.body))
				assert.GreaterOrEqual(t, pr.elapsed, shortTimeout)
				assert.Contains(t, pr.errMessage(t), "KVPoll.Bootstrapping")
				dr := post(t.Context(), pair.d.URL()+"/generate", body)
				require.Equal(t, http.StatusInternalServerError, dr.status, string(dr.body))
				assert.Contains(t, dr.errMessage(t), "KVPoll.WaitingForInput")
			},
		},
		{
			name: "different prompts are a KV mismatch",
			run: func(t *testing.T, pair pdPair) {
				room := newRoom()
				pr, dr := parallel(t.Context(),
					pair.p.URL()+"/generate", withBoot(map[string]any{"text": "a b c"}, "127.0.0.1", pair.p.BootstrapPort(), room),
					pair.d.URL()+"/generate", withBoot(map[string]any{"text": "x y"}, "127.0.0.1", pair.p.BootstrapPort(), room))
				require.Equal(t, http.StatusOK, pr.status, string(pr.body))
				require.Equal(t, http.StatusInternalServerError, dr.status, string(dr.body))
				assert.Contains(t, dr.errMessage(t), fmt.Sprintf("KV mismatch for room %d", room))
			},
		},
		{
			name: "duplicate rooms in one request are a 400",
			run: func(t *testing.T, pair pdPair) {
				room := newRoom()
				body := map[string]any{"text": []any{"a", "b"}, "bootstrap_host": "127.0.0.1", "bootstrap_port": pair.p.BootstrapPort(), "bootstrap_room": []any{room, room}}
				pr, dr := parallel(t.Context(), pair.p.URL()+"/generate", body, pair.d.URL()+"/generate", body)
				for _, r := range []resp{pr, dr} {
					require.Equal(t, http.StatusBadRequest, r.status, string(r.body))
					assert.Equal(t, fmt.Sprintf("duplicate bootstrap_room %d", room), r.errMessage(t))
				}
			},
		},
		{
			name: "list rooms repeated across n samples collide",
			run: func(t *testing.T, pair pdPair) {
				body := withBoot(chatBody, "127.0.0.1", pair.p.BootstrapPort(), 0)
				body["n"] = 2
				body["bootstrap_room"] = []any{newRoom()}
				body["bootstrap_host"] = []any{"127.0.0.1"}
				r := post(t.Context(), pair.d.URL()+"/v1/chat/completions", body)
				require.Equal(t, http.StatusBadRequest, r.status, string(r.body))
				assert.Contains(t, r.errMessage(t), "duplicate bootstrap_room")
			},
		},
		{
			name: "a room pending on the worker is a duplicate",
			run: func(t *testing.T, pair pdPair) {
				room := newRoom()
				body := withBoot(map[string]any{"text": "a"}, "127.0.0.1", pair.p.BootstrapPort(), room)
				first := make(chan resp, 1)
				go func() { first <- post(t.Context(), pair.p.URL()+"/generate", body) }()
				require.Eventually(t, func() bool { return len(pair.p.State().PendingRooms) == 1 }, 5*time.Second, 5*time.Millisecond)
				r := post(t.Context(), pair.p.URL()+"/generate", body)
				require.Equal(t, http.StatusBadRequest, r.status, string(r.body))
				assert.Equal(t, fmt.Sprintf("duplicate bootstrap_room %d", room), r.errMessage(t))
				// Complete the first pairing, then reuse the room: still a duplicate.
				dr := post(t.Context(), pair.d.URL()+"/generate", body)
				require.Equal(t, http.StatusOK, dr.status, string(dr.body))
				require.Equal(t, http.StatusOK, (<-first).status)
				pr, dr := parallel(t.Context(), pair.p.URL()+"/generate", body, pair.d.URL()+"/generate", body)
				assert.Equal(t, http.StatusBadRequest, pr.status, "room reused across requests")
				assert.Equal(t, http.StatusBadRequest, dr.status, "room reused across requests")
			},
		},
		{
			name: "a second decode join for the same room is rejected",
			run: func(t *testing.T, pair pdPair) {
				d2 := start(t, fast(sglang.Decode))
				body := withBoot(map[string]any{"text": "a b"}, "127.0.0.1", pair.p.BootstrapPort(), newRoom())
				var wg sync.WaitGroup
				res := make([]resp, 3)
				for i, url := range []string{pair.p.URL(), pair.d.URL(), d2.URL()} {
					wg.Add(1)
					go func() { defer wg.Done(); res[i] = post(t.Context(), url+"/generate", body) }()
				}
				wg.Wait()
				require.Equal(t, http.StatusOK, res[0].status, string(res[0].body))
				statuses := []int{res[1].status, res[2].status}
				assert.ElementsMatch(t, []int{http.StatusOK, http.StatusInternalServerError}, statuses)
				for _, r := range res[1:] {
					if r.status == http.StatusInternalServerError {
						assert.Contains(t, r.errMessage(t), "Decode handshake failed")
					}
				}
			},
		},
		{
			name: "page size mismatch fails the decode",
			mut:  func(p, d *sglang.Config) { short(p, d); d.PageSize = 16 },
			run: func(t *testing.T, pair pdPair) {
				body := withBoot(map[string]any{"text": "a"}, "127.0.0.1", pair.p.BootstrapPort(), newRoom())
				_, dr := parallel(t.Context(), pair.p.URL()+"/generate", body, pair.d.URL()+"/generate", body)
				require.Equal(t, http.StatusInternalServerError, dr.status, string(dr.body))
				assert.Contains(t, dr.errMessage(t), "Page size mismatch: prefill server has page_size=1, but decode server has page_size=16")
			},
		},
		{
			name: "decode client disconnect aborts the prefill",
			mut:  short,
			run: func(t *testing.T, pair pdPair) {
				room := newRoom()
				body := withBoot(map[string]any{"text": "a"}, "127.0.0.1", pair.p.BootstrapPort(), room)
				ctx, cancel := context.WithCancel(t.Context())
				done := make(chan resp, 1)
				go func() { done <- post(ctx, pair.d.URL()+"/generate", body) }()
				require.Eventually(t, func() bool { return len(pair.p.State().PendingRooms) == 1 }, 5*time.Second, 5*time.Millisecond,
					"decode joined (pre-arrival)")
				cancel()
				<-done
				require.Eventually(t, func() bool { return len(pair.p.State().PendingRooms) == 0 }, 5*time.Second, 5*time.Millisecond)
				pr := post(t.Context(), pair.p.URL()+"/generate", body)
				require.Equal(t, http.StatusInternalServerError, pr.status, "the aborted join is gone; the prefill times out")
			},
		},
		{
			name: "decode client disconnect after the prefill arrived aborts it",
			run: func(t *testing.T, pair pdPair) {
				pair.p.UpdateConfig(func(c *sglang.Config) { c.TransferDelay = 10 * time.Second })
				room := newRoom()
				body := withBoot(map[string]any{"text": "a"}, "127.0.0.1", pair.p.BootstrapPort(), room)
				pch := make(chan resp, 1)
				go func() { pch <- post(t.Context(), pair.p.URL()+"/generate", body) }()
				ctx, cancel := context.WithCancel(t.Context())
				dch := make(chan resp, 1)
				go func() { dch <- post(ctx, pair.d.URL()+"/generate", body) }()
				require.Eventually(t, func() bool {
					st := pair.p.State().PendingRooms
					return len(st) == 1 && st[0].Stage == "transferring"
				}, 5*time.Second, 5*time.Millisecond)
				cancel()
				<-dch
				pr := <-pch
				require.Equal(t, http.StatusInternalServerError, pr.status, string(pr.body))
				assert.Contains(t, pr.errMessage(t), fmt.Sprintf("KVTransferError(bootstrap_room=%d): Aborted by AbortReq.", room))
				assert.Less(t, pr.elapsed, 10*time.Second)
			},
		},
		{
			name: "prefill client disconnect fails the decode's transfer",
			run: func(t *testing.T, pair pdPair) {
				pair.p.UpdateConfig(func(c *sglang.Config) { c.TransferDelay = 10 * time.Second })
				room := newRoom()
				body := withBoot(map[string]any{"text": "a"}, "127.0.0.1", pair.p.BootstrapPort(), room)
				ctx, cancel := context.WithCancel(t.Context())
				pch := make(chan resp, 1)
				go func() { pch <- post(ctx, pair.p.URL()+"/generate", body) }()
				dch := make(chan resp, 1)
				go func() { dch <- post(t.Context(), pair.d.URL()+"/generate", body) }()
				require.Eventually(t, func() bool {
					st := pair.p.State().PendingRooms
					return len(st) == 1 && st[0].Stage == "transferring"
				}, 5*time.Second, 5*time.Millisecond)
				cancel()
				<-pch
				dr := <-dch
				require.Equal(t, http.StatusInternalServerError, dr.status, string(dr.body))
				assert.Contains(t, dr.errMessage(t), "Decode transfer failed")
			},
		},
		{
			name: "prefill dies while the decode waits: heartbeat fails",
			mut: func(p, d *sglang.Config) {
				d.HeartbeatInterval = 50 * time.Millisecond
			},
			run: func(t *testing.T, pair pdPair) {
				body := withBoot(map[string]any{"text": "a"}, "127.0.0.1", pair.p.BootstrapPort(), newRoom())
				dch := make(chan resp, 1)
				go func() { dch <- post(t.Context(), pair.d.URL()+"/generate", body) }()
				require.Eventually(t, func() bool { return len(pair.p.State().PendingRooms) == 1 }, 5*time.Second, 5*time.Millisecond)
				require.NoError(t, pair.p.Close())
				dr := <-dch
				require.Equal(t, http.StatusInternalServerError, dr.status, string(dr.body))
				assert.Contains(t, dr.errMessage(t), "Lost connection with prefill instance (bootstrap_addr: 127.0.0.1:")
			},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var mut []func(p, d *sglang.Config)
			if tc.mut != nil {
				mut = append(mut, tc.mut)
			}
			tc.run(t, newPair(t, mut...))
		})
	}
}

// tail returns the part of msg from "Request <room>" on.
func tail(msg string, room uint64) string {
	key := fmt.Sprintf("Request %d", room)
	for i := 0; i+len(key) <= len(msg); i++ {
		if msg[i:i+len(key)] == key {
			return msg[i:]
		}
	}
	return msg
}

func TestLaxMode(t *testing.T) {
	t.Parallel()
	lax := func(p, d *sglang.Config) { p.Lax, d.Lax = true, true; short(p, d) }
	cases := []struct {
		name string
		run  func(t *testing.T, pair pdPair)
	}{
		{"numeric string room is accepted", func(t *testing.T, pair pdPair) {
			body := withBoot(map[string]any{"text": "a"}, "127.0.0.1", pair.p.BootstrapPort(), 0)
			body["bootstrap_room"] = fmt.Sprint(newRoom())
			pr, dr := parallel(t.Context(), pair.p.URL()+"/generate", body, pair.d.URL()+"/generate", body)
			require.Equal(t, http.StatusOK, pr.status, string(pr.body))
			require.Equal(t, http.StatusOK, dr.status, string(dr.body))
		}},
		{"KV mismatch recomputes", func(t *testing.T, pair pdPair) {
			room := newRoom()
			_, dr := parallel(t.Context(),
				pair.p.URL()+"/generate", withBoot(map[string]any{"text": "a b c"}, "127.0.0.1", pair.p.BootstrapPort(), room),
				pair.d.URL()+"/generate", withBoot(map[string]any{"text": "x y"}, "127.0.0.1", pair.p.BootstrapPort(), room))
			require.Equal(t, http.StatusOK, dr.status, string(dr.body))
			assert.Equal(t, "recomputed", dr.header.Get(sglang.HeaderFakeKV))
		}},
		{"duplicate rooms stall until the timeout", func(t *testing.T, pair pdPair) {
			room := newRoom()
			body := map[string]any{"text": []any{"a", "b"}, "bootstrap_host": "127.0.0.1", "bootstrap_port": pair.p.BootstrapPort(), "bootstrap_room": []any{room, room}}
			pr, dr := parallel(t.Context(), pair.p.URL()+"/generate", body, pair.d.URL()+"/generate", body)
			assert.Equal(t, http.StatusInternalServerError, pr.status, string(pr.body))
			assert.Equal(t, http.StatusInternalServerError, dr.status, string(dr.body))
			assert.GreaterOrEqual(t, pr.elapsed, shortTimeout)
		}},
		{"short room list is an IndexError 500", func(t *testing.T, pair pdPair) {
			body := map[string]any{"text": []any{"a", "b"}, "bootstrap_room": []any{newRoom()}}
			r := post(t.Context(), pair.d.URL()+"/generate", body)
			require.Equal(t, http.StatusInternalServerError, r.status, string(r.body))
			assert.Contains(t, r.errMessage(t), "list index out of range")
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			tc.run(t, newPair(t, lax))
		})
	}
}

func TestEventsRecordThePairing(t *testing.T) {
	t.Parallel()
	pair := newPair(t)
	room := newRoom()
	body := withBoot(map[string]any{"text": "a"}, "127.0.0.1", pair.p.BootstrapPort(), room)
	pr, dr := parallel(t.Context(), pair.p.URL()+"/generate", body, pair.d.URL()+"/generate", body)
	require.Equal(t, http.StatusOK, pr.status)
	require.Equal(t, http.StatusOK, dr.status)
	outcomes := func(evs []common.Event) []string {
		var out []string
		for _, e := range evs {
			if e.Room != nil && *e.Room == room {
				out = append(out, e.Leg+":"+e.Outcome)
			}
		}
		return out
	}
	assert.Subset(t, outcomes(pair.p.Events()), []string{"prefill:registered", "bootstrap:join_accepted", "prefill:joined", "prefill:transferred"})
	assert.Equal(t, []string{"decode:transferred"}, outcomes(pair.d.Events()))
}
