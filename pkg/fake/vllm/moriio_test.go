package vllm_test

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/smg-project/smg-extproc/pkg/fake/vllm"
)

func moriPair(t *testing.T, mode vllm.MoRIIOMode, mut ...func(p, d *vllm.Config)) (p, d *vllm.Server) {
	t.Helper()
	return pair(t, vllm.MoRIIO, append([]func(p, d *vllm.Config){func(pc, dc *vllm.Config) {
		pc.MoRIIOMode, dc.MoRIIOMode = mode, mode
		dc.TransferTimeout = 2 * time.Second
	}}, mut...)...)
}

// moriPrefillKV is SMG's prefill-leg kv_transfer_params; in WRITE mode it
// names the decode's side channel.
func moriPrefillKV(tid string, d *vllm.Server, mode vllm.MoRIIOMode) map[string]any {
	kv := map[string]any{
		"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": nil, "remote_block_ids": nil,
		"transfer_id": tid, "remote_dp_size": 1,
	}
	if mode == vllm.Write {
		kv["remote_host"] = "127.0.0.1"
		kv["remote_handshake_port"] = d.HandshakePort()
		kv["remote_notify_port"] = d.NotifyPort()
	}
	return kv
}

// moriConcurrentDecodeKV is SMG's up-front decode params for concurrent WRITE.
func moriConcurrentDecodeKV(tid string, p *vllm.Server) map[string]any {
	return map[string]any{
		"do_remote_decode": false, "do_remote_prefill": true, "remote_engine_id": nil, "remote_block_ids": nil,
		"transfer_id": tid, "remote_dp_size": 1, "remote_host": "127.0.0.1",
		"remote_handshake_port": p.HandshakePort(), "remote_notify_port": p.NotifyPort(), "remote_tp_size": 1,
	}
}

func markerID(p, d *vllm.Server) string {
	return fmt.Sprintf("___prefill_addr_host:127.0.0.1,handshake:%d,notify:%d___decode_addr_host:127.0.0.1,handshake:%d,notify:%d_%s",
		p.HandshakePort(), p.NotifyPort(), d.HandshakePort(), d.NotifyPort(), "0123456789abcdef0123456789abcdef")
}

func TestMoRIIODispatch(t *testing.T) {
	t.Parallel()
	plain := start(t, vllm.Config{})
	const path = "/v1/chat/completions"
	cases := []struct {
		name       string
		mode       vllm.MoRIIOMode
		concurrent bool
		prefillLag time.Duration // concurrent: the prefill starts this much later
		markers    bool          // peers only through the X-Request-Id markers
		stream     bool
	}{
		{name: "read sequential", mode: vllm.Read},
		{name: "read sequential stream decode", mode: vllm.Read, stream: true},
		{name: "write sequential", mode: vllm.Write},
		{name: "write concurrent, decode first", mode: vllm.Write, concurrent: true, prefillLag: 80 * time.Millisecond},
		{name: "write concurrent, prefill first", mode: vllm.Write, concurrent: true},
		{name: "write concurrent with request-id markers", mode: vllm.Write, concurrent: true, markers: true},
		{name: "read with request-id markers", mode: vllm.Read, markers: true},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p, d := moriPair(t, tc.mode, func(pc, _ *vllm.Config) { pc.PrefillDelay = 20 * time.Millisecond })
			tid := fmt.Sprintf("xfer-mori-%d", i)
			body := chatBody
			if tc.stream {
				body = with(body, "stream", true)
			}
			rid := "client-rid"
			if tc.markers {
				rid = markerID(p, d)
			}
			pkv := moriPrefillKV(tid, d, tc.mode)
			if tc.markers {
				pkv = with(pkv, "remote_host", nil, "remote_handshake_port", nil, "remote_notify_port", nil)
			}
			var pr, dr resp
			prefill := func() {
				time.Sleep(tc.prefillLag)
				pr = post(t.Context(), p.URL()+path, moriPrefillLeg(path, chatBody, pkv), "X-Request-Id", rid)
			}
			if tc.concurrent {
				dkv := moriConcurrentDecodeKV(tid, p)
				if tc.markers {
					dkv = with(dkv, "remote_host", nil, "remote_handshake_port", nil, "remote_notify_port", nil)
				}
				concurrently(prefill, func() {
					dr = post(t.Context(), d.URL()+path, with(body, "kv_transfer_params", dkv), "X-Request-Id", rid)
				})
			} else {
				prefill()
				require.Equal(t, http.StatusOK, pr.status, string(pr.body))
				h := pr.kv(t)
				if tc.markers {
					h = with(h, "remote_host", nil, "remote_handshake_port", nil, "remote_notify_port", nil)
				}
				dr = post(t.Context(), d.URL()+path, with(body, "kv_transfer_params", h), "X-Request-Id", rid)
			}
			require.Equal(t, http.StatusOK, pr.status, string(pr.body))
			require.Equal(t, http.StatusOK, dr.status, string(dr.body))
			h := pr.kv(t)
			assert.Equal(t, tid, h["transfer_id"])
			assert.Equal(t, true, h["do_remote_prefill"])
			assert.Equal(t, false, h["do_remote_decode"])
			assert.Equal(t, fmt.Sprintf("127.0.0.1:%d", p.HandshakePort()), h["remote_engine_id"])
			assert.Equal(t, "127.0.0.1", h["remote_host"])
			assert.EqualValues(t, p.HandshakePort(), h["remote_handshake_port"])
			assert.EqualValues(t, p.NotifyPort(), h["remote_notify_port"])
			assert.EqualValues(t, 1, h["remote_dp_size"])
			assert.EqualValues(t, 1, h["tp_size"])
			assert.IsType(t, []any{}, h["remote_block_ids"].([]any)[0], "a list of per-group lists")
			assert.Equal(t, "transferred", dr.header.Get(vllm.HeaderFakeKV))
			want := outputText(t, path, tc.stream, post(t.Context(), plain.URL()+path, body))
			assert.Equal(t, want, outputText(t, path, tc.stream, dr))
			require.Eventually(t, func() bool { return len(p.State().Held) == 0 }, 2*time.Second, 5*time.Millisecond)
			wantEvent := "handoff_consumed"
			if tc.mode == vllm.Write {
				wantEvent = "pushed"
			}
			require.Eventually(t, func() bool { return hasEvent(p, wantEvent) }, 2*time.Second, 5*time.Millisecond)
		})
	}
}

// Each malformed field, misuse or wrong peer fails hard; a MoRI-IO decode
// never silently recomputes.
func TestMoRIIOFailures(t *testing.T) {
	t.Parallel()
	const path = "/v1/chat/completions"
	type env struct{ p, d *vllm.Server }
	seqDecode := func(t *testing.T, e env, tid string, mode vllm.MoRIIOMode, mutate func(h map[string]any) map[string]any) resp {
		pr := post(t.Context(), e.p.URL()+path, moriPrefillLeg(path, chatBody, moriPrefillKV(tid, e.d, mode)))
		require.Equal(t, http.StatusOK, pr.status, string(pr.body))
		return post(t.Context(), e.d.URL()+path, with(chatBody, "kv_transfer_params", mutate(pr.kv(t))))
	}
	cases := []struct {
		name    string
		mode    vllm.MoRIIOMode
		lax     bool
		run     func(t *testing.T, e env) resp
		status  int
		message string
		dead    string // "p" or "d": that worker is now dead
		event   string // on either worker
	}{
		{name: "prefill without transfer_id kills the engine", mode: vllm.Read, run: func(t *testing.T, e env) resp {
			return post(t.Context(), e.p.URL()+path, moriPrefillLeg(path, chatBody, with(moriPrefillKV("x", e.d, vllm.Read), "transfer_id", nil)))
		}, status: 500, message: "KeyError transfer_id", dead: "p", event: "engine_dead"},
		{name: "decode without transfer_id kills the engine", mode: vllm.Write, run: func(t *testing.T, e env) resp {
			return post(t.Context(), e.d.URL()+path, with(chatBody, "kv_transfer_params", with(moriConcurrentDecodeKV("x", e.p), "transfer_id", nil)))
		}, status: 500, message: "KeyError transfer_id", dead: "d", event: "engine_dead"},
		{name: "non-integer remote_dp_size kills the engine", mode: vllm.Write, run: func(t *testing.T, e env) resp {
			return post(t.Context(), e.p.URL()+path, moriPrefillLeg(path, chatBody, with(moriPrefillKV("x", e.d, vllm.Write), "remote_dp_size", "two")))
		}, status: 500, message: "invalid literal for int()", dead: "p", event: "engine_dead"},
		{name: "empty transfer_id", mode: vllm.Read, run: func(t *testing.T, e env) resp {
			return post(t.Context(), e.p.URL()+path, moriPrefillLeg(path, chatBody, with(moriPrefillKV("x", e.d, vllm.Read), "transfer_id", "")))
		}, status: 400, message: "transfer_id must be a non-empty string"},
		{name: "prefill without ignore_eos", mode: vllm.Read, run: func(t *testing.T, e env) resp {
			return post(t.Context(), e.p.URL()+path, with(moriPrefillLeg(path, chatBody, moriPrefillKV("x", e.d, vllm.Read)), "ignore_eos", nil))
		}, status: 400, message: "needs ignore_eos=true and no stop", event: "prefill_stop_conditions"},
		{name: "prefill with stop", mode: vllm.Write, run: func(t *testing.T, e env) resp {
			return post(t.Context(), e.p.URL()+path, with(moriPrefillLeg(path, chatBody, moriPrefillKV("x", e.d, vllm.Write)), "stop", []any{"\n"}))
		}, status: 400, message: "needs ignore_eos=true and no stop", event: "prefill_stop_conditions"},
		{name: "write prefill without the decode's notify port", mode: vllm.Write, run: func(t *testing.T, e env) resp {
			return post(t.Context(), e.p.URL()+path, moriPrefillLeg(path, chatBody, with(moriPrefillKV("x", e.d, vllm.Write), "remote_notify_port", nil)))
		}, status: 400, message: "needs the decode's side channel: missing or invalid remote_notify_port"},
		{name: "write prefill with a non-numeric handshake port", mode: vllm.Write, run: func(t *testing.T, e env) resp {
			return post(t.Context(), e.p.URL()+path, moriPrefillLeg(path, chatBody, with(moriPrefillKV("x", e.d, vllm.Write), "remote_handshake_port", "abc")))
		}, status: 400, message: "remote_handshake_port"},
		{name: "write prefill without any decode side channel", mode: vllm.Write, run: func(t *testing.T, e env) resp {
			return post(t.Context(), e.p.URL()+path, moriPrefillLeg(path, chatBody, with(moriPrefillKV("x", e.d, vllm.Write), "remote_host", nil, "remote_handshake_port", nil, "remote_notify_port", nil)))
		}, status: 400, message: "missing the decode's side channel"},
		{name: "decode without the prefill's host", mode: vllm.Read, run: func(t *testing.T, e env) resp {
			return seqDecode(t, e, "x", vllm.Read, func(h map[string]any) map[string]any {
				return with(h, "remote_host", nil, "remote_handshake_port", nil, "remote_notify_port", nil)
			})
		}, status: 400, message: "missing the prefill's side channel", event: "kv_params_invalid"},
		{name: "decode with the wrong notify port", mode: vllm.Write, run: func(t *testing.T, e env) resp {
			return seqDecode(t, e, "x", vllm.Write, func(h map[string]any) map[string]any { return with(h, "remote_notify_port", freePort(t)) })
		}, status: 500, message: "is not the prefill's notify port", event: "kv_load_failed"},
		{name: "decode with the wrong handshake port", mode: vllm.Read, run: func(t *testing.T, e env) resp {
			return seqDecode(t, e, "x", vllm.Read, func(h map[string]any) map[string]any { return with(h, "remote_handshake_port", freePort(t)) })
		}, status: 500, message: "handshake with the prefill", event: "kv_load_failed"},
		{name: "decode port as a decimal string is fine", mode: vllm.Read, run: func(t *testing.T, e env) resp {
			r := seqDecode(t, e, "x", vllm.Read, func(h map[string]any) map[string]any {
				return with(h, "remote_notify_port", fmt.Sprint(h["remote_notify_port"]), "remote_dp_size", "1")
			})
			assert.Equal(t, "transferred", r.header.Get(vllm.HeaderFakeKV))
			return r
		}, status: 200},
		{name: "read decode before the prefill", mode: vllm.Read, run: func(t *testing.T, e env) resp {
			kv := with(moriConcurrentDecodeKV("x", e.p), "remote_engine_id", e.p.EngineID(0), "remote_block_ids", []any{[]any{1}})
			return post(t.Context(), e.d.URL()+path, with(chatBody, "kv_transfer_params", kv))
		}, status: 500, message: "no prefill blocks for transfer_id x"},
		{name: "read decode with flattened block ids", mode: vllm.Read, run: func(t *testing.T, e env) resp {
			return seqDecode(t, e, "x", vllm.Read, func(h map[string]any) map[string]any {
				return with(h, "remote_block_ids", h["remote_block_ids"].([]any)[0])
			})
		}, status: 500, message: "differ from the blocks issued"},
		{name: "read decode with a foreign engine id", mode: vllm.Read, run: func(t *testing.T, e env) resp {
			return seqDecode(t, e, "x", vllm.Read, func(h map[string]any) map[string]any { return with(h, "remote_engine_id", "10.0.0.9:6301") })
		}, status: 500, message: `remote_engine_id "10.0.0.9:6301" is not the engine`},
		{name: "read decode without block ids", mode: vllm.Read, run: func(t *testing.T, e env) resp {
			return seqDecode(t, e, "x", vllm.Read, func(h map[string]any) map[string]any { return with(h, "remote_block_ids", nil) })
		}, status: 400, message: "READ needs remote_block_ids and remote_engine_id"},
		{name: "read handoff reused", mode: vllm.Read, run: func(t *testing.T, e env) resp {
			var h map[string]any
			r := seqDecode(t, e, "x", vllm.Read, func(x map[string]any) map[string]any { h = x; return x })
			require.Equal(t, http.StatusOK, r.status, string(r.body))
			return post(t.Context(), e.d.URL()+path, with(chatBody, "kv_transfer_params", h))
		}, status: 500, message: "already consumed"},
		{name: "write handoff reused", mode: vllm.Write, run: func(t *testing.T, e env) resp {
			var h map[string]any
			r := seqDecode(t, e, "x", vllm.Write, func(x map[string]any) map[string]any { h = x; return x })
			require.Equal(t, http.StatusOK, r.status, string(r.body))
			return post(t.Context(), e.d.URL()+path, with(chatBody, "kv_transfer_params", h))
		}, status: 500, message: "already written to a decode"},
		{name: "write decode with altered block ids", mode: vllm.Write, run: func(t *testing.T, e env) resp {
			return seqDecode(t, e, "x", vllm.Write, func(h map[string]any) map[string]any {
				return with(h, "remote_block_ids", []any{[]any{1, 2, 3}})
			})
		}, status: 500, message: "differ from the blocks issued"},
		{name: "write prefill names another decode", mode: vllm.Write, run: func(t *testing.T, e env) resp {
			other := start(t, vllm.Config{Role: vllm.Consumer, Connector: vllm.MoRIIO})
			var pr, dr resp
			concurrently(
				func() {
					pr = post(t.Context(), e.p.URL()+path, moriPrefillLeg(path, chatBody, moriPrefillKV("x", other, vllm.Write)))
				},
				func() {
					dr = post(t.Context(), e.d.URL()+path, with(chatBody, "kv_transfer_params", moriConcurrentDecodeKV("x", e.p)))
				})
			require.Equal(t, http.StatusOK, pr.status, string(pr.body))
			return dr
		}, status: 500, message: "the prefill leg names decode", event: "push_failed"},
		{name: "write decode points at another prefill", mode: vllm.Write, run: func(t *testing.T, e env) resp {
			other := start(t, vllm.Config{Role: vllm.Producer, Connector: vllm.MoRIIO, AbortRequestTimeout: 100 * time.Millisecond})
			var dr resp
			concurrently(
				func() {
					pr := post(t.Context(), e.p.URL()+path, moriPrefillLeg(path, chatBody, moriPrefillKV("x", e.d, vllm.Write)))
					require.Equal(t, http.StatusOK, pr.status, string(pr.body))
				},
				func() {
					dr = post(t.Context(), e.d.URL()+path, with(chatBody, "kv_transfer_params", moriConcurrentDecodeKV("x", other)))
				})
			require.Eventually(t, func() bool { return hasEvent(other, "orphan_remote_blocks") }, 2*time.Second, 5*time.Millisecond)
			return dr
		}, status: 500, message: "timed out after 200ms waiting for the prefill's KV write", event: "orphan_transfer"},
		{name: "write prefill finished on EOS fails the waiting decode at once", mode: vllm.Write, lax: true, run: func(t *testing.T, e env) resp {
			e.p.UpdateConfig(func(c *vllm.Config) { c.EOSAt = 1 })
			var dr resp
			begin := time.Now()
			concurrently(
				func() {
					time.Sleep(30 * time.Millisecond)
					pr := post(t.Context(), e.p.URL()+path, with(moriPrefillLeg(path, chatBody, moriPrefillKV("x", e.d, vllm.Write)), "ignore_eos", nil))
					assert.Equal(t, "none", pr.header.Get(vllm.HeaderFakeHandoff))
				},
				func() {
					dr = post(t.Context(), e.d.URL()+path, with(chatBody, "kv_transfer_params", moriConcurrentDecodeKV("x", e.p)))
				})
			assert.Less(t, time.Since(begin), 150*time.Millisecond, "no wait for the transfer timeout")
			return dr
		}, status: 500, message: "finish_reason=stop"},
		{name: "mode mismatch", mode: vllm.Write, run: func(t *testing.T, e env) resp {
			e.p.Close()
			p := start(t, vllm.Config{Role: vllm.Producer, Connector: vllm.MoRIIO, MoRIIOMode: vllm.Read})
			return seqDecode(t, env{p, e.d}, "x", vllm.Read, func(h map[string]any) map[string]any { return h })
		}, status: 500, message: "mode mismatch"},
		{name: "markers and explicit peers", mode: vllm.Read, run: func(t *testing.T, e env) resp {
			pr := post(t.Context(), e.p.URL()+path, moriPrefillLeg(path, chatBody, moriPrefillKV("x", e.d, vllm.Read)))
			require.Equal(t, http.StatusOK, pr.status)
			return post(t.Context(), e.d.URL()+path, with(chatBody, "kv_transfer_params", pr.kv(t)), "X-Request-Id", markerID(e.p, e.d))
		}, status: 400, message: "carries MoRI-IO peer markers", event: "request_id_markers"},
		{name: "malformed markers", mode: vllm.Write, run: func(t *testing.T, e env) resp {
			kv := with(moriConcurrentDecodeKV("x", e.p), "remote_host", nil, "remote_handshake_port", nil, "remote_notify_port", nil)
			return post(t.Context(), e.d.URL()+path, with(chatBody, "kv_transfer_params", kv), "X-Request-Id", "___prefill_addr_host:127.0.0.1,handshake:x___decode_addr_y_0123456789abcdef0123456789abcdef")
		}, status: 500, message: "Malformed zmq_address"},
		{name: "consumer without kv_transfer_params", mode: vllm.Write, run: func(t *testing.T, e env) resp {
			return post(t.Context(), e.d.URL()+path, chatBody)
		}, status: 400, message: "a MoRI-IO decode never recomputes", event: "kv_params_missing"},
		{name: "consumer without kv_transfer_params lax recomputes", mode: vllm.Write, lax: true, run: func(t *testing.T, e env) resp {
			r := post(t.Context(), e.d.URL()+path, chatBody)
			assert.Equal(t, "recomputed", r.header.Get(vllm.HeaderFakeKV))
			return r
		}, status: 200, event: "recomputed"},
		{name: "decode aborted before the push leaks its blocks", mode: vllm.Write, run: func(t *testing.T, e env) resp {
			ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
			defer cancel()
			r := post(ctx, e.d.URL()+path, with(chatBody, "kv_transfer_params", moriConcurrentDecodeKV("x", e.p)))
			require.Error(t, r.err)
			require.Eventually(t, func() bool { return hasEvent(e.d, "leaked_decode_blocks") }, 2*time.Second, 5*time.Millisecond)
			return resp{status: 499}
		}, status: 499},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p, d := moriPair(t, tc.mode, func(pc, dc *vllm.Config) {
				pc.Lax, dc.Lax = tc.lax, tc.lax
				pc.AbortRequestTimeout = 150 * time.Millisecond
				dc.TransferTimeout = 200 * time.Millisecond
			})
			r := tc.run(t, env{p, d})
			if tc.status == 499 {
				return
			}
			require.NoError(t, r.err)
			require.Equal(t, tc.status, r.status, string(r.body))
			if tc.status != 200 {
				assert.Contains(t, r.errMessage(t), tc.message)
			}
			if tc.event != "" {
				require.Eventually(t, func() bool { return hasEvent(p, tc.event) || hasEvent(d, tc.event) }, 2*time.Second, 5*time.Millisecond,
					"p: %v d: %v", outcomes(p, ""), outcomes(d, ""))
			}
			switch tc.dead {
			case "p", "d":
				s := map[string]*vllm.Server{"p": p, "d": d}[tc.dead]
				assert.NotEmpty(t, s.Dead())
				assert.Equal(t, http.StatusServiceUnavailable, get(t, s.URL()+"/health").status)
				r := post(t.Context(), s.URL()+path, chatBody)
				assert.Equal(t, http.StatusInternalServerError, r.status)
				assert.Contains(t, r.errMessage(t), "EngineCore is dead")
				s.Reset()
				assert.Equal(t, http.StatusOK, get(t, s.URL()+"/health").status)
				assert.NotEqual(t, http.StatusInternalServerError, post(t.Context(), s.URL()+path, chatBody).status)
			}
		})
	}
}

func TestMoRIIOEngineIDAndInfo(t *testing.T) {
	t.Parallel()
	s := start(t, vllm.Config{Connector: vllm.MoRIIO, MoRIIOMode: vllm.Read, TPSize: 2})
	assert.Equal(t, fmt.Sprintf("127.0.0.1:%d", s.HandshakePort()), s.EngineID(0))
	info := get(t, fmt.Sprintf("http://127.0.0.1:%d/_fake/moriio/info", s.HandshakePort())).json(t)
	assert.Equal(t, "read", info["mode"])
	assert.EqualValues(t, s.NotifyPort(), info["notify_port"])
	assert.True(t, strings.HasPrefix(info["engine_id"].(string), "127.0.0.1:"))
}
