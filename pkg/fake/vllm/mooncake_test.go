package vllm_test

import (
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/smg-project/smg-extproc/pkg/fake/vllm"
)

func mcPrefillKV(tid string) map[string]any {
	return map[string]any{"do_remote_decode": true, "do_remote_prefill": false, "transfer_id": tid}
}

// mcDecodeKV is what SMG synthesizes for the decode.
func mcDecodeKV(tid, engineID, addr string) map[string]any {
	return map[string]any{
		"do_remote_decode": false, "do_remote_prefill": true, "transfer_id": tid,
		"remote_engine_id": engineID, "remote_bootstrap_addr": addr,
	}
}

func TestMooncakeSynthesizedHandoff(t *testing.T) {
	t.Parallel()
	plain := start(t, vllm.Config{})
	cases := []struct {
		name        string
		path        string
		body        map[string]any
		stream      bool
		decodeFirst bool
		dp          bool // prefill with dp_size 2, both legs pinned to rank 1
	}{
		{name: "sequential chat", path: "/v1/chat/completions", body: chatBody},
		{name: "sequential completions stream", path: "/v1/completions", body: with(completionBody, "stream", true), stream: true},
		{name: "decode arrives first", path: "/v1/chat/completions", body: chatBody, decodeFirst: true},
		{name: "dp rank 1", path: "/v1/completions", body: completionBody, dp: true},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p, d := pair(t, vllm.Mooncake, func(pc, _ *vllm.Config) {
				pc.EngineID = "mc-prefill"
				if tc.dp {
					pc.DPSize = 2
				}
				if tc.decodeFirst {
					pc.PrefillDelay = 150 * time.Millisecond
				}
			})
			tid := fmt.Sprintf("xfer-%d", i)
			rank := "0"
			engineID := "mc-prefill"
			if tc.dp {
				rank, engineID = "1", "mc-prefill_dp1"
			}
			assert.Equal(t, engineID, p.EngineID(map[bool]int{false: 0, true: 1}[tc.dp]))
			q := get(t, p.BootstrapAddr()+"/query").json(t)
			assert.Contains(t, q, rank)
			assert.Equal(t, engineID, q[rank].(map[string]any)["engine_id"])

			var pr, dr resp
			prefill := func() {
				pr = post(t.Context(), p.URL()+tc.path, prefillLeg(tc.path, tc.body, mcPrefillKV(tid)), "X-data-parallel-rank", rank)
			}
			decode := func() {
				dr = post(t.Context(), d.URL()+tc.path, with(tc.body, "kv_transfer_params", mcDecodeKV(tid, engineID, p.BootstrapAddr())))
			}
			if tc.decodeFirst {
				concurrently(decode, func() { time.Sleep(30 * time.Millisecond); prefill() })
			} else {
				prefill()
				require.Equal(t, http.StatusOK, pr.status, string(pr.body))
				assert.Nil(t, pr.kv(t), "a Mooncake prefill returns kv_transfer_params null")
				assert.Equal(t, "issued", pr.header.Get(vllm.HeaderFakeHandoff))
				decode()
			}
			require.Equal(t, http.StatusOK, pr.status, string(pr.body))
			require.Equal(t, http.StatusOK, dr.status, string(dr.body))
			assert.Equal(t, "transferred", dr.header.Get(vllm.HeaderFakeKV))
			want := outputText(t, tc.path, tc.stream, post(t.Context(), plain.URL()+tc.path, tc.body))
			assert.Equal(t, want, outputText(t, tc.path, tc.stream, dr))
			assert.Empty(t, p.State().Held)
			assert.Contains(t, outcomes(p, "prefill"), "handoff_consumed")
		})
	}
}

func TestMooncakeFailures(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name    string
		lax     bool
		run     func(t *testing.T, p, d *vllm.Server) resp
		status  int
		message string
		pEvent  string // expected on the prefill
	}{
		{name: "wrong bootstrap port", run: func(t *testing.T, p, d *vllm.Server) resp {
			mustPrefill(t, p, "x1")
			return post(t.Context(), d.URL()+"/v1/chat/completions", with(chatBody, "kv_transfer_params",
				mcDecodeKV("x1", p.EngineID(0), fmt.Sprintf("http://127.0.0.1:%d", freePort(t)))))
		}, status: 500, message: "bootstrap query at remote_bootstrap_addr"},
		{name: "bootstrap addr without scheme", run: func(t *testing.T, p, d *vllm.Server) resp {
			mustPrefill(t, p, "x2")
			return post(t.Context(), d.URL()+"/v1/chat/completions", with(chatBody, "kv_transfer_params",
				mcDecodeKV("x2", p.EngineID(0), fmt.Sprintf("127.0.0.1:%d", p.BootstrapPort()))))
		}, status: 500, message: "bootstrap query"},
		{name: "wrong engine id", run: func(t *testing.T, p, d *vllm.Server) resp {
			mustPrefill(t, p, "x3")
			return post(t.Context(), d.URL()+"/v1/chat/completions", with(chatBody, "kv_transfer_params",
				mcDecodeKV("x3", "mc-prefill_dp0", p.BootstrapAddr())))
		}, status: 500, message: `unknown remote_engine_id "mc-prefill_dp0"`},
		{name: "transfer_id not shared", run: func(t *testing.T, p, d *vllm.Server) resp {
			mustPrefill(t, p, "x4")
			return post(t.Context(), d.URL()+"/v1/chat/completions", with(chatBody, "kv_transfer_params",
				mcDecodeKV("x4-other", p.EngineID(0), p.BootstrapAddr())))
		}, status: 500, message: "no prefill for transfer_id x4-other within", pEvent: "orphan_transfer"},
		{name: "reused transfer", run: func(t *testing.T, p, d *vllm.Server) resp {
			mustPrefill(t, p, "x5")
			body := with(chatBody, "kv_transfer_params", mcDecodeKV("x5", p.EngineID(0), p.BootstrapAddr()))
			r := post(t.Context(), d.URL()+"/v1/chat/completions", body)
			require.Equal(t, http.StatusOK, r.status, string(r.body))
			return post(t.Context(), d.URL()+"/v1/chat/completions", body)
		}, status: 500, message: "already consumed"},
		{name: "prefill reuses a transfer_id", run: func(t *testing.T, p, _ *vllm.Server) resp {
			mustPrefill(t, p, "x6")
			return post(t.Context(), p.URL()+"/v1/chat/completions", prefillLeg("/v1/chat/completions", chatBody, mcPrefillKV("x6")))
		}, status: 400, message: "transfer_id x6 is already held by another prefill leg"},
		{name: "prefill without transfer_id strict", run: func(t *testing.T, p, _ *vllm.Server) resp {
			return post(t.Context(), p.URL()+"/v1/chat/completions", prefillLeg("/v1/chat/completions", chatBody, map[string]any{"do_remote_decode": true}))
		}, status: 400, message: "Missing transfer_id in kv_transfer_params from router!", pEvent: "missing_transfer_id"},
		{name: "prefill without transfer_id lax registers nothing", lax: true, run: func(t *testing.T, p, _ *vllm.Server) resp {
			r := post(t.Context(), p.URL()+"/v1/chat/completions", prefillLeg("/v1/chat/completions", chatBody, map[string]any{"do_remote_decode": true}))
			assert.Equal(t, "none", r.header.Get(vllm.HeaderFakeHandoff))
			return r
		}, status: 200, pEvent: "missing_transfer_id"},
		{name: "decode missing remote_bootstrap_addr", run: func(t *testing.T, p, d *vllm.Server) resp {
			mustPrefill(t, p, "x7")
			return post(t.Context(), d.URL()+"/v1/chat/completions", with(chatBody, "kv_transfer_params",
				with(mcDecodeKV("x7", p.EngineID(0), p.BootstrapAddr()), "remote_bootstrap_addr", nil)))
		}, status: 400, message: "invalid kv_transfer_params: missing remote_bootstrap_addr"},
		{name: "prefill finished on EOS", run: func(t *testing.T, p, d *vllm.Server) resp {
			p.UpdateConfig(func(c *vllm.Config) { c.EOSAt = 1 })
			r := post(t.Context(), p.URL()+"/v1/chat/completions", prefillLeg("/v1/chat/completions", chatBody, mcPrefillKV("x8")))
			require.Equal(t, http.StatusOK, r.status)
			assert.Equal(t, "none", r.header.Get(vllm.HeaderFakeHandoff))
			return post(t.Context(), d.URL()+"/v1/chat/completions", with(chatBody, "kv_transfer_params", mcDecodeKV("x8", p.EngineID(0), p.BootstrapAddr())))
		}, status: 500, message: "finish_reason=stop, so no KV was held"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p, d := pair(t, vllm.Mooncake, func(pc, dc *vllm.Config) {
				pc.EngineID, pc.Lax, pc.AbortRequestTimeout = "mc-prefill", tc.lax, 300*time.Millisecond
				dc.TransferTimeout = 100 * time.Millisecond
			})
			r := tc.run(t, p, d)
			require.NoError(t, r.err)
			require.Equal(t, tc.status, r.status, string(r.body))
			if tc.status != 200 {
				assert.Contains(t, r.errMessage(t), tc.message)
			}
			if tc.pEvent != "" {
				require.Eventually(t, func() bool { return hasEvent(p, tc.pEvent) }, 3*time.Second, 5*time.Millisecond, "%v", outcomes(p, ""))
			}
		})
	}
}

func mustPrefill(t *testing.T, p *vllm.Server, tid string) {
	t.Helper()
	r := post(t.Context(), p.URL()+"/v1/chat/completions", prefillLeg("/v1/chat/completions", chatBody, mcPrefillKV(tid)))
	require.Equal(t, http.StatusOK, r.status, string(r.body))
	require.Equal(t, "issued", r.header.Get(vllm.HeaderFakeHandoff))
}

func TestMooncakeBootstrapServer(t *testing.T) {
	t.Parallel()
	p := start(t, vllm.Config{Role: vllm.Producer, Connector: vllm.Mooncake, EngineID: "e", DPSize: 2})
	r := post(t.Context(), p.BootstrapAddr()+"/register", map[string]any{"engine_id": "e_dp0", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": "tcp://x:1"})
	require.Equal(t, http.StatusOK, r.status, string(r.body))
	q := get(t, p.BootstrapAddr()+"/query")
	require.Equal(t, http.StatusOK, q.status)
	want := fmt.Sprintf(`{"0":{"engine_id":"e_dp0","worker_addr":{"0":{"0":"tcp://127.0.0.1:%[1]d"}}},"1":{"engine_id":"e_dp1","worker_addr":{"0":{"0":"tcp://127.0.0.1:%[1]d"}}}}`, p.BootstrapPort())
	assert.JSONEq(t, want, string(q.body))
	assert.Contains(t, outcomes(p, "bootstrap"), "register")
}
