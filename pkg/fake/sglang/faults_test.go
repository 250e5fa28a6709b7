package sglang_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/smg-project/smg-extproc/pkg/fake/common"
	"github.com/smg-project/smg-extproc/pkg/fake/sglang"
)

func TestFaultInjection(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name string
		run  func(t *testing.T, pair pdPair)
	}{
		{"fail_status via /_fake/config answers at once without joining", func(t *testing.T, pair pdPair) {
			r := post(t.Context(), pair.d.URL()+"/_fake/config", map[string]any{"fail_status": 503, "fail_body": map[string]any{"error": "boom"}})
			require.Equal(t, http.StatusOK, r.status, string(r.body))
			assert.EqualValues(t, 503, r.json(t)["fail_status"])
			body := withBoot(map[string]any{"text": "a"}, "127.0.0.1", pair.p.BootstrapPort(), newRoom())
			dr := post(t.Context(), pair.d.URL()+"/generate", body)
			assert.Equal(t, http.StatusServiceUnavailable, dr.status)
			assert.JSONEq(t, `{"error":"boom"}`, string(dr.body))
			assert.Empty(t, pair.p.State().PendingRooms, "no join happened")
			assert.Len(t, pair.d.Requests(), 1, "the request is still recorded")

			r = post(t.Context(), pair.d.URL()+"/_fake/config", map[string]any{"fail_status": 0})
			require.Equal(t, http.StatusOK, r.status)
			pr, dr := parallel(t.Context(), pair.p.URL()+"/generate", body, pair.d.URL()+"/generate", body)
			assert.Equal(t, http.StatusOK, pr.status, string(pr.body))
			assert.Equal(t, http.StatusOK, dr.status, string(dr.body))
		}},
		{"hang never answers until the client leaves", func(t *testing.T, pair pdPair) {
			pair.p.UpdateConfig(func(c *sglang.Config) { c.Hang = true })
			ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
			defer cancel()
			r := post(ctx, pair.p.URL()+"/v1/completions", map[string]any{"prompt": "a"})
			require.Error(t, r.err)
			assert.GreaterOrEqual(t, r.elapsed, 150*time.Millisecond) // the deadline starts before the clock does
			require.Eventually(t, func() bool { return pair.p.State().InFlight == 0 }, 5*time.Second, 5*time.Millisecond)
		}},
		{"hold_body_open keeps the prefill response open after the body", func(t *testing.T, pair pdPair) {
			const hold = time.Second
			pair.p.UpdateConfig(func(c *sglang.Config) { c.HoldBodyOpen = hold })
			for _, stream := range []bool{false, true} {
				body := withBoot(map[string]any{"text": "a b", "stream": stream}, "127.0.0.1", pair.p.BootstrapPort(), newRoom())
				dch := make(chan resp, 1)
				go func() { dch <- post(t.Context(), pair.d.URL()+"/generate", body) }()
				b, _ := json.Marshal(body)
				begin := time.Now()
				req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, pair.p.URL()+"/generate", strings.NewReader(string(b)))
				require.NoError(t, err)
				req.Header.Set("Content-Type", "application/json")
				res, err := http.DefaultClient.Do(req)
				require.NoError(t, err)
				require.Equal(t, http.StatusOK, res.StatusCode)
				var got []byte
				buf := make([]byte, 4096)
				want := "}"
				if stream {
					want = "data: [DONE]\n\n"
				}
				for !strings.HasSuffix(string(got), want) {
					n, err := res.Body.Read(buf)
					got = append(got, buf[:n]...)
					require.NoError(t, err, "body must arrive before EOF")
				}
				bodyAt := time.Since(begin)
				_, err = io.ReadAll(res.Body)
				require.NoError(t, err)
				eofAt := time.Since(begin)
				res.Body.Close()
				assert.Less(t, bodyAt, hold, "stream=%v: the body is sent before the hold", stream)
				assert.GreaterOrEqual(t, eofAt-bodyAt, hold-50*time.Millisecond, "stream=%v: EOF only after the hold", stream)
				dr := <-dch
				assert.Equal(t, http.StatusOK, dr.status, string(dr.body))
				assert.Less(t, dr.elapsed, hold, "the decode does not wait for the prefill's EOF")
			}
		}},
		{"per-token delay paces the decode stream", func(t *testing.T, pair pdPair) {
			pair.d.UpdateConfig(func(c *sglang.Config) { c.PerTokenDelay = 30 * time.Millisecond })
			body := withBoot(map[string]any{"prompt": "a", "max_tokens": 5, "stream": true}, "127.0.0.1", pair.p.BootstrapPort(), newRoom())
			_, dr := parallel(t.Context(), pair.p.URL()+"/v1/completions", body, pair.d.URL()+"/v1/completions", body)
			require.Equal(t, http.StatusOK, dr.status)
			assert.GreaterOrEqual(t, dr.elapsed, 120*time.Millisecond)
		}},
		{"prefill and transfer delays hold the prefill response", func(t *testing.T, pair pdPair) {
			pair.p.UpdateConfig(func(c *sglang.Config) {
				c.PrefillDelay = 100 * time.Millisecond
				c.TransferDelay = 100 * time.Millisecond
			})
			body := withBoot(map[string]any{"text": "a"}, "127.0.0.1", pair.p.BootstrapPort(), newRoom())
			pr, dr := parallel(t.Context(), pair.p.URL()+"/generate", body, pair.d.URL()+"/generate", body)
			require.Equal(t, http.StatusOK, pr.status, string(pr.body))
			require.Equal(t, http.StatusOK, dr.status, string(dr.body))
			// Generous margin: clocks on each side differ by scheduling; the
			// point is that the delays apply (an undelayed pair takes ~1 ms).
			assert.GreaterOrEqual(t, pr.elapsed, 150*time.Millisecond)
			assert.GreaterOrEqual(t, dr.elapsed, 150*time.Millisecond)
		}},
		{"early stream head turns failures into abort chunks", func(t *testing.T, pair pdPair) {
			pair.d.UpdateConfig(func(c *sglang.Config) { c.EarlyStreamHead = true; c.WaitingTimeout = 100 * time.Millisecond })
			body := withBoot(map[string]any{"text": "a", "stream": true}, "127.0.0.1", pair.p.BootstrapPort(), newRoom())
			dr := post(t.Context(), pair.d.URL()+"/generate", body)
			require.Equal(t, http.StatusOK, dr.status)
			evs := parseSSE(t, dr.body)
			require.Len(t, evs, 2)
			fr := decodeJSON(t, evs[0].data)["meta_info"].(map[string]any)["finish_reason"].(map[string]any)
			assert.Equal(t, "abort", fr["type"])
			assert.EqualValues(t, 500, fr["status_code"])
			assert.Contains(t, fr["message"], "KVPoll.WaitingForInput")
			assert.Equal(t, "[DONE]", evs[1].data)
		}},
		{"startup window: 503 on /health and /route, then the decode's retries succeed", func(t *testing.T, pair pdPair) {
			r := post(t.Context(), pair.p.URL()+"/_fake/config", map[string]any{"startup_ms": 1000})
			require.Equal(t, http.StatusOK, r.status)
			h := doRaw(t.Context(), http.MethodGet, pair.p.URL()+"/health", "", nil)
			assert.Equal(t, http.StatusServiceUnavailable, h.status)
			route := doRaw(t.Context(), http.MethodGet, bootURL(pair.p)+"/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1", "", nil)
			assert.Equal(t, http.StatusServiceUnavailable, route.status)
			assert.Equal(t, "Prefill server not fully registered yet (0 workers registered).", string(route.body))
			pair.d.UpdateConfig(func(c *sglang.Config) { c.FetchRetryInterval = 50 * time.Millisecond; c.FetchAttempts = 60 })
			body := withBoot(map[string]any{"text": "a"}, "127.0.0.1", pair.p.BootstrapPort(), newRoom())
			pr, dr := parallel(t.Context(), pair.p.URL()+"/generate", body, pair.d.URL()+"/generate", body)
			assert.Equal(t, http.StatusOK, pr.status, string(pr.body))
			assert.Equal(t, http.StatusOK, dr.status, string(dr.body))
			h = doRaw(t.Context(), http.MethodGet, pair.p.URL()+"/health", "", nil)
			assert.Equal(t, http.StatusOK, h.status)
		}},
		{"bad config patch is rejected", func(t *testing.T, pair pdPair) {
			r := post(t.Context(), pair.p.URL()+"/_fake/config", map[string]any{"fail_statuz": 500})
			assert.Equal(t, http.StatusBadRequest, r.status)
			r = post(t.Context(), pair.p.URL()+"/_fake/config", map[string]any{"fail_status": 42})
			assert.Equal(t, http.StatusBadRequest, r.status)
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			tc.run(t, newPair(t))
		})
	}
}

func bootURL(s *sglang.Server) string {
	u := s.URL()
	return u[:strings.LastIndex(u, ":")+1] + itoa(s.BootstrapPort())
}

func itoa(i int) string { return strconv.Itoa(i) }

func TestBootstrapServer(t *testing.T) {
	t.Parallel()
	p := start(t, fast(sglang.Prefill))
	base := bootURL(p)
	cases := []struct {
		name, method, path string
		status             int
		body               string // exact text, or JSON when it starts with '{'
	}{
		{"health", http.MethodGet, "/health", 200, "OK"},
		{"topology", http.MethodGet, "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1", 200,
			`{"attn_tp_size":1,"attn_cp_size":1,"dp_size":1,"pp_size":1,"page_size":1,"kv_cache_dtype":"auto","follow_bootstrap_room":true,"enable_dsa_cache_layer_split":false,"prefill_http_port":` + p.URL()[strings.LastIndex(p.URL(), ":")+1:] + `}`},
		{"rank", http.MethodGet, "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0", 200,
			`{"rank_ip":"127.0.0.1","rank_port":` + itoa(p.BootstrapPort()) + `}`},
		{"unknown rank", http.MethodGet, "/route?prefill_dp_rank=3&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0", 404,
			"Bootstrap info not found for dp_rank=3 cp_rank=0 tp_rank=0 pp_rank=0"},
		{"missing inputs", http.MethodGet, "/route?prefill_dp_rank=-1", 400, "Missing inputs for bootstrap server."},
		{"register", http.MethodPut, "/route", 200, "OK"},
		{"other method", http.MethodDelete, "/route", 405, "Method not allowed"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			r := doRaw(t.Context(), tc.method, base+tc.path, "application/json", []byte(`{}`))
			require.NoError(t, r.err)
			require.Equal(t, tc.status, r.status, string(r.body))
			if strings.HasPrefix(tc.body, "{") {
				assert.JSONEq(t, tc.body, string(r.body))
			} else {
				assert.Equal(t, tc.body, string(r.body))
			}
		})
	}
}

func TestHealthAndMetadata(t *testing.T) {
	t.Parallel()
	pc := fast(sglang.Prefill)
	pc.Model = "my-model"
	p := start(t, pc)
	cases := []struct {
		path     string
		contains []string
	}{
		{"/health", nil},
		{"/health_generate", nil},
		{"/get_server_info", []string{`"disaggregation_mode":"prefill"`, `"disaggregation_transfer_backend":"mooncake"`, `"disaggregation_bootstrap_port":` + itoa(p.BootstrapPort()), `"page_size":1`, `"kv_cache_dtype":"auto"`, `"max_running_requests":1024`, `"tp_size":1`, `"dp_size":1`, `"served_model_name":"my-model"`, `"version":`, `"internal_states":[{"last_gen_throughput":0}]`}},
		{"/server_info", []string{`"disaggregation_mode":"prefill"`}},
		{"/get_model_info", []string{`"model_path":"my-model"`, `"is_generation":true`}},
		{"/model_info", []string{`"weight_version":"default"`}},
		{"/v1/models", []string{`"id":"my-model"`, `"owned_by":"sglang"`, `"max_model_len":32768`}},
		{"/get_load", []string{`"dp_rank":0`, `"num_reqs":0`, `"num_waiting_reqs":0`}},
		{"/v1/loads", []string{`"num_tokens":0`}},
		{"/metrics", []string{"sglang:num_running_reqs{", "sglang:num_prefill_bootstrap_queue_reqs{", "sglang:num_prefill_inflight_queue_reqs{", "sglang:num_decode_transfer_queue_reqs{", "sglang:num_bootstrap_failed_reqs_total{"}},
		{"/flush_cache", []string{"Cache flushed."}},
	}
	for _, tc := range cases {
		t.Run(strings.TrimPrefix(tc.path, "/"), func(t *testing.T) {
			t.Parallel()
			r := doRaw(t.Context(), http.MethodGet, p.URL()+tc.path, "", nil)
			require.Equal(t, http.StatusOK, r.status, string(r.body))
			for _, c := range tc.contains {
				assert.Contains(t, string(r.body), c)
			}
		})
	}
}

func TestAdminEndpoints(t *testing.T) {
	t.Parallel()
	pair := newPair(t)
	room := newRoom()
	body := withBoot(map[string]any{"text": "a b"}, "127.0.0.1", pair.p.BootstrapPort(), room)

	// Pending state while the prefill waits for its decode.
	pch := make(chan resp, 1)
	go func() { pch <- post(t.Context(), pair.p.URL()+"/generate", body) }()
	require.Eventually(t, func() bool { return len(pair.p.State().PendingRooms) == 1 }, 5*time.Second, 5*time.Millisecond)
	var st sglang.State
	r := doRaw(t.Context(), http.MethodGet, pair.p.URL()+"/_fake/state", "", nil)
	require.NoError(t, json.Unmarshal(r.body, &st))
	require.Len(t, st.PendingRooms, 1)
	assert.Equal(t, room, st.PendingRooms[0].Room)
	assert.Equal(t, "waiting_join", st.PendingRooms[0].Stage)
	assert.Equal(t, sglang.Prefill, st.Mode)
	assert.True(t, st.Config.Strict)

	dr := post(t.Context(), pair.d.URL()+"/generate", body)
	require.Equal(t, http.StatusOK, dr.status)
	require.Equal(t, http.StatusOK, (<-pch).status)

	r = doRaw(t.Context(), http.MethodGet, pair.d.URL()+"/_fake/requests?path=/generate", "", nil)
	var reqs []common.RecordedRequest
	require.NoError(t, json.Unmarshal(r.body, &reqs))
	require.Len(t, reqs, 1)
	assert.Equal(t, http.MethodPost, reqs[0].Method)
	assert.JSONEq(t, mustJSON(t, body), string(reqs[0].Body))
	var raw []map[string]any
	dec := json.NewDecoder(bytes.NewReader(r.body))
	dec.UseNumber()
	require.NoError(t, dec.Decode(&raw))
	assert.Equal(t, json.Number(strconv.FormatUint(room, 10)), raw[0]["body_json"].(map[string]any)["bootstrap_room"])

	r = doRaw(t.Context(), http.MethodGet, pair.d.URL()+"/_fake/events", "", nil)
	var evs []common.Event
	require.NoError(t, json.Unmarshal(r.body, &evs))
	require.NotEmpty(t, evs)
	assert.Equal(t, "transferred", evs[len(evs)-1].Outcome)
	assert.Equal(t, room, *evs[len(evs)-1].Room)

	pair.d.UpdateConfig(func(c *sglang.Config) { c.PerTokenDelay = time.Second })
	r = post(t.Context(), pair.d.URL()+"/_fake/reset", nil)
	require.Equal(t, http.StatusOK, r.status)
	assert.Empty(t, pair.d.Requests())
	assert.Empty(t, pair.d.Events())
	assert.Zero(t, pair.d.Config().PerTokenDelay, "reset restores the initial config")
	r = doRaw(t.Context(), http.MethodGet, pair.d.URL()+"/_fake/config", "", nil)
	assert.EqualValues(t, 3, r.json(t)["fetch_attempts"])
}

// Everything is bounded: after a mix of successes and failures and Close,
// no goroutine is left behind.
func TestNoGoroutineLeak(t *testing.T) {
	before := runtime.NumGoroutine()
	func() {
		pc, dc := fast(sglang.Prefill), fast(sglang.Decode)
		short(&pc, &dc)
		p, d := sglang.New(pc), sglang.New(dc)
		ctx := context.Background()
		require.NoError(t, p.Start(ctx))
		require.NoError(t, d.Start(ctx))
		defer func() { require.NoError(t, d.Close()); require.NoError(t, p.Close()) }()
		body := withBoot(map[string]any{"text": "a", "stream": true}, "127.0.0.1", p.BootstrapPort(), newRoom())
		parallel(ctx, p.URL()+"/generate", body, d.URL()+"/generate", body)
		post(ctx, d.URL()+"/generate", withBoot(map[string]any{"text": "a"}, "127.0.0.1", p.BootstrapPort(), newRoom()))
		post(ctx, p.URL()+"/generate", withBoot(map[string]any{"text": "a"}, "127.0.0.1", p.BootstrapPort(), newRoom()))
		// Leave one request hanging in each leg when Close runs.
		hctx, cancel := context.WithCancel(ctx)
		defer cancel()
		go post(hctx, p.URL()+"/generate", withBoot(map[string]any{"text": "a"}, "127.0.0.1", p.BootstrapPort(), newRoom()))
		go post(hctx, d.URL()+"/generate", withBoot(map[string]any{"text": "a"}, "127.0.0.1", p.BootstrapPort(), newRoom()))
		require.Eventually(t, func() bool { return p.State().InFlight == 1 && d.State().InFlight == 1 }, 5*time.Second, 5*time.Millisecond)
	}()
	http.DefaultClient.CloseIdleConnections()
	assert.Eventually(t, func() bool {
		http.DefaultClient.CloseIdleConnections()
		return runtime.NumGoroutine() <= before+1
	}, 3*time.Second, 20*time.Millisecond, "goroutines: before %d, now %d", before, runtime.NumGoroutine())
}
