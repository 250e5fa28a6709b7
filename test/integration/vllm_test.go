package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/smg-project/smg-extproc/pkg/fake/common"
	"github.com/smg-project/smg-extproc/pkg/fake/vllm"
)

func startVLLM(t testing.TB, cfg vllm.Config) *vllm.Server {
	t.Helper()
	s := vllm.New(cfg)
	ctx, cancel := context.WithCancel(context.Background())
	require.NoError(t, s.Start(ctx))
	t.Cleanup(func() { cancel(); _ = s.Close() })
	return s
}

func kvParams(t testing.TB, r common.RecordedRequest) map[string]any {
	t.Helper()
	b := legBody(t, r)
	kv, _ := b["kv_transfer_params"].(map[string]any)
	return kv
}

// TestVLLMNixl: sequential dispatch with NIXL — a one-token prefill, then the
// decode with the prefill's kv_transfer_params relayed verbatim (the strict
// fake decode only reports "transferred" for the exact, unused handoff).
func TestVLLMNixl(t *testing.T) {
	p := startVLLM(t, vllm.Config{Role: vllm.Producer, Connector: vllm.Nixl})
	d := startVLLM(t, vllm.Config{Role: vllm.Consumer, Connector: vllm.Nixl})
	gw := startGateway(t, gwOpts{Extra: []string{"--policy", "round_robin", "--disable-retries"}})
	addWorker(t, gw, fmt.Sprintf(`{"url":%q,"worker_type":"prefill","kv_connector":"NixlConnector"}`, p.URL()), nil)
	addWorker(t, gw, fmt.Sprintf(`{"url":%q,"worker_type":"decode","kv_connector":"NixlConnector"}`, d.URL()), nil)
	for _, w := range listWorkers(t, gw, nil) {
		assert.Equal(t, "vllm/nixl/?", w.PDPairing, "runtime detected as vllm from /v1/models")
	}

	cases := []struct{ name, path, body, capKey string }{
		{"chat-stream", "/v1/chat/completions", `{"model":"fake-model","messages":[{"role":"user","content":"hello vllm"}],"max_tokens":50,"top_p":0.95,"stream":true,"stream_options":{"include_usage":true},"min_tokens":2}`, "max_tokens"},
		{"chat-max-completion", "/v1/chat/completions", `{"model":"fake-model","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":7,"max_tokens":9}`, "max_completion_tokens"},
		{"completions", "/v1/completions", `{"model":"fake-model","prompt":"once upon a time","max_tokens":5}`, "max_tokens"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p.Reset()
			d.Reset()
			r := post(t, gw.URL+tc.path, tc.body, nil)
			require.Equal(t, 200, r.Status, "%s", r.Body)
			assert.Equal(t, "transferred", r.Header.Get("X-Fake-KV"), "decode must receive the prefill's KV")
			pr := onlyRequest(t, "prefill", p.Requests())
			dr := onlyRequest(t, "decode", d.Requests())
			assert.True(t, pr.Time.Before(dr.Time), "sequential: the decode goes out after the prefill")
			pb, db := legBody(t, pr), legBody(t, dr)
			assert.Equal(t, json.Number("1"), pb[tc.capKey])
			assert.Equal(t, false, pb["stream"])
			assert.NotContains(t, pb, "stream_options")
			assert.NotContains(t, pb, "min_tokens")
			assert.Equal(t, true, kvParams(t, pr)["do_remote_decode"])
			assert.Equal(t, true, kvParams(t, dr)["do_remote_prefill"], "decode carries the prefill's handoff")
			for _, b := range []map[string]any{pb, db} {
				assert.NotContains(t, b, "bootstrap_room")
			}
			assertClientBytesKept(t, tc.body, dr.Body)
			if tc.capKey == "max_completion_tokens" {
				assert.NotContains(t, pb, "max_tokens")
			}
		})
	}

	t.Run("n>1-skips-the-prefill-leg", func(t *testing.T) {
		p.Reset()
		d.Reset()
		body := `{"messages":[{"role":"user","content":"many"}],"max_tokens":3,"n":2}`
		r := post(t, gw.URL+"/v1/chat/completions", body, nil)
		require.Equal(t, 200, r.Status, "%s", r.Body)
		assert.Zero(t, len(p.Requests()))
		dr := onlyRequest(t, "decode", d.Requests())
		assert.Equal(t, json.Number("2"), legBody(t, dr)["n"])
		assert.NotContains(t, legBody(t, dr), "kv_transfer_params")
	})

	t.Run("prefill-error-passes-through", func(t *testing.T) {
		p.Reset()
		d.Reset()
		p.UpdateConfig(func(c *vllm.Config) { c.FailStatus, c.FailBody = 429, `{"error":{"message":"full"}}` })
		defer p.UpdateConfig(func(c *vllm.Config) { c.FailStatus, c.FailBody = 0, "" })
		r := post(t, gw.URL+"/v1/completions", `{"prompt":"x","max_tokens":3}`, nil)
		require.Equal(t, 429, r.Status, "%s", r.Body)
		code, msg, _ := errorBody(t, r)
		assert.Equal(t, "prefill_upstream_error", code)
		assert.Equal(t, "full", msg)
		assert.Zero(t, len(d.Requests()), "the decode is never contacted")
	})

	t.Run("metrics", func(t *testing.T) {
		m := string(do(t, "GET", gw.MetricsURL, nil, nil).Body)
		assert.Contains(t, m, `smg_pd_kv_connector_mode_total{mode="nixl"}`)
		assert.Contains(t, m, "smg_pd_prefill_duration_seconds_count")
		assert.Contains(t, m, "smg_pd_kv_transfer_duration_seconds_count")
		assert.Contains(t, m, "smg_pd_ttft_seconds_count")
	})
}

func TestVLLMTransportFailures(t *testing.T) {
	p := startVLLM(t, vllm.Config{Role: vllm.Producer, Connector: vllm.Nixl})
	d := startVLLM(t, vllm.Config{Role: vllm.Consumer, Connector: vllm.Nixl})
	dead := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	t.Run("prefill-unreachable", func(t *testing.T) {
		gw := startGateway(t, gwOpts{Extra: []string{"--disable-health-check", "--disable-retries"}})
		addWorker(t, gw, fmt.Sprintf(`{"url":%q,"worker_type":"prefill","runtime_type":"vllm","kv_connector":"NixlConnector"}`, dead), nil)
		addWorker(t, gw, fmt.Sprintf(`{"url":%q,"worker_type":"decode","runtime_type":"vllm","kv_connector":"NixlConnector"}`, d.URL()), nil)
		d.Reset()
		r := post(t, gw.URL+"/v1/completions", `{"prompt":"x"}`, nil)
		require.Equal(t, 502, r.Status, "%s", r.Body)
		code, _, _ := errorBody(t, r)
		assert.Equal(t, "prefill_request_failed", code)
		assert.Zero(t, len(d.Requests()))
	})
	t.Run("decode-unreachable", func(t *testing.T) {
		gw := startGateway(t, gwOpts{Extra: []string{"--disable-health-check", "--disable-retries"}})
		addWorker(t, gw, fmt.Sprintf(`{"url":%q,"worker_type":"prefill","runtime_type":"vllm","kv_connector":"NixlConnector"}`, p.URL()), nil)
		addWorker(t, gw, fmt.Sprintf(`{"url":%q,"worker_type":"decode","runtime_type":"vllm","kv_connector":"NixlConnector"}`, dead), nil)
		r := post(t, gw.URL+"/v1/completions", `{"prompt":"x","max_tokens":2}`, nil)
		require.Equal(t, 502, r.Status, "%s", r.Body)
		code, _, _ := errorBody(t, r)
		assert.Equal(t, "decode_request_failed", code)
	})
}

// TestVLLMMooncake: the decode's kv_transfer_params are synthesized (transfer
// id, engine id, bootstrap address) and the fake decode pulls over HTTP.
func TestVLLMMooncake(t *testing.T) {
	p := startVLLM(t, vllm.Config{Role: vllm.Producer, Connector: vllm.Mooncake, EngineID: "eng-p"})
	d := startVLLM(t, vllm.Config{Role: vllm.Consumer, Connector: vllm.Mooncake})
	gw := startGateway(t, gwOpts{Extra: []string{"--disable-retries"}})
	addWorker(t, gw, fmt.Sprintf(`{"url":%q,"worker_type":"prefill","kv_connector":"MooncakeConnector","kv_engine_id":"eng-p","bootstrap_port":%d}`, p.URL(), p.BootstrapPort()), nil)
	addWorker(t, gw, fmt.Sprintf(`{"url":%q,"worker_type":"decode","kv_connector":"MooncakeConnector"}`, d.URL()), nil)
	r := post(t, gw.URL+"/v1/chat/completions", `{"messages":[{"role":"user","content":"moon"}],"max_tokens":4}`, nil)
	require.Equal(t, 200, r.Status, "%s", r.Body)
	assert.Equal(t, "transferred", r.Header.Get("X-Fake-KV"))
	pkv := kvParams(t, onlyRequest(t, "prefill", p.Requests()))
	dkv := kvParams(t, onlyRequest(t, "decode", d.Requests()))
	require.NotEmpty(t, pkv["transfer_id"])
	assert.True(t, strings.HasPrefix(pkv["transfer_id"].(string), "xfer-"))
	assert.Equal(t, pkv["transfer_id"], dkv["transfer_id"])
	assert.Equal(t, "eng-p", dkv["remote_engine_id"])
	assert.Equal(t, fmt.Sprintf("http://127.0.0.1:%d", p.BootstrapPort()), dkv["remote_bootstrap_addr"])
}

// TestVLLMMixedFleet: a NIXL prefill never pairs with a Mooncake decode.
func TestVLLMMixedFleet(t *testing.T) {
	p := startVLLM(t, vllm.Config{Role: vllm.Producer, Connector: vllm.Nixl})
	dm := startVLLM(t, vllm.Config{Role: vllm.Consumer, Connector: vllm.Mooncake})
	dn := startVLLM(t, vllm.Config{Role: vllm.Consumer, Connector: vllm.Nixl})
	gw := startGateway(t, gwOpts{Extra: []string{"--policy", "round_robin"}})
	addWorker(t, gw, fmt.Sprintf(`{"url":%q,"worker_type":"prefill","kv_connector":"NixlConnector"}`, p.URL()), nil)
	addWorker(t, gw, fmt.Sprintf(`{"url":%q,"worker_type":"decode","kv_connector":"MooncakeConnector"}`, dm.URL()), nil)
	r := post(t, gw.URL+"/v1/completions", `{"prompt":"x"}`, nil)
	require.Equal(t, 503, r.Status)
	code, _, _ := errorBody(t, r)
	assert.Equal(t, "no_compatible_pd_pair", code)
	addWorker(t, gw, fmt.Sprintf(`{"url":%q,"worker_type":"decode","kv_connector":"NixlConnector"}`, dn.URL()), nil)
	for i := 0; i < 6; i++ {
		r := post(t, gw.URL+"/v1/completions", fmt.Sprintf(`{"prompt":"mixed %d","max_tokens":2}`, i), nil)
		require.Equal(t, 200, r.Status, "%s", r.Body)
		assert.Equal(t, dn.URL(), r.Header.Get("x-smg-routed-worker-id"))
	}
	assert.Zero(t, len(dm.Requests()))
}

// TestVLLMMoRIIO: READ and WRITE (sequential and concurrent) handoffs, and
// every refusal before any leg is contacted.
func TestVLLMMoRIIO(t *testing.T) {
	type pair struct{ p, d *vllm.Server }
	mk := func(mode vllm.MoRIIOMode) pair {
		return pair{
			p: startVLLM(t, vllm.Config{Role: vllm.Producer, Connector: vllm.MoRIIO, MoRIIOMode: mode}),
			d: startVLLM(t, vllm.Config{Role: vllm.Consumer, Connector: vllm.MoRIIO, MoRIIOMode: mode}),
		}
	}
	labels := func(s *vllm.Server, mode string, extra string) string {
		return fmt.Sprintf(`{"moriio_mode":%q,"moriio_host":"127.0.0.1","moriio_handshake_port":"%d","moriio_notify_port":"%d"%s}`,
			mode, s.HandshakePort(), s.NotifyPort(), extra)
	}
	for _, c := range []struct {
		name, mode, dispatch string
		fmode                vllm.MoRIIOMode
	}{
		{"read", "read", "", vllm.Read},
		{"write-sequential", "write", "", vllm.Write},
		{"write-concurrent", "write", `,"moriio_write_dispatch":"concurrent"`, vllm.Write},
	} {
		t.Run(c.name, func(t *testing.T) {
			pr := mk(c.fmode)
			gw := startGateway(t, gwOpts{Extra: []string{"--disable-retries"}})
			addWorker(t, gw, fmt.Sprintf(`{"url":%q,"worker_type":"prefill","runtime_type":"vllm","kv_connector":"MoRIIOConnector","labels":%s}`, pr.p.URL(), labels(pr.p, c.mode, "")), nil)
			addWorker(t, gw, fmt.Sprintf(`{"url":%q,"worker_type":"decode","runtime_type":"vllm","kv_connector":"MoRIIOConnector","labels":%s}`, pr.d.URL(), labels(pr.d, c.mode, c.dispatch)), nil)
			r := post(t, gw.URL+"/v1/chat/completions", `{"messages":[{"role":"user","content":"rdma"}],"max_tokens":4,"stop":["x"]}`, nil)
			require.Equal(t, 200, r.Status, "%s", r.Body)
			assert.Equal(t, "transferred", r.Header.Get("X-Fake-KV"))
			pb := legBody(t, onlyRequest(t, "prefill", pr.p.Requests()))
			assert.Equal(t, true, pb["ignore_eos"])
			assert.NotContains(t, pb, "stop")
			assert.Contains(t, legBody(t, onlyRequest(t, "decode", pr.d.Requests())), "stop", "the decode keeps the client's stop")

			refusals := []struct {
				path, body string
				hdr        map[string]string
				status     int
				code       string
			}{
				{"/v1/messages", `{"max_tokens":3,"messages":[{"role":"user","content":"x"}]}`, nil, 501, "moriio_route_unsupported"},
				{"/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],"n":2}`, nil, 400, "moriio_fanout_unsupported"},
				{"/v1/completions", `{"prompt":["a","b"]}`, nil, 400, "moriio_fanout_unsupported"},
				{"/v1/completions", `{"prompt":"a"}`, map[string]string{"X-Request-Id": "x___prefill_addr_10.0.0.1:1"}, 400, "moriio_request_id_reserved"},
			}
			for _, rf := range refusals {
				pr.p.Reset()
				pr.d.Reset()
				r := post(t, gw.URL+rf.path, rf.body, rf.hdr)
				require.Equal(t, rf.status, r.Status, "%s %s: %s", rf.path, rf.body, r.Body)
				code, _, _ := errorBody(t, r)
				assert.Equal(t, rf.code, code)
				assert.Zero(t, len(pr.p.Requests())+len(pr.d.Requests()), "refused before any leg is contacted")
			}
		})
	}
	t.Run("misconfigured-pair", func(t *testing.T) {
		pr := mk(vllm.Write)
		gw := startGateway(t, gwOpts{Extra: []string{"--pd-pairing-mode", "off"}})
		addWorker(t, gw, fmt.Sprintf(`{"url":%q,"worker_type":"prefill","runtime_type":"vllm","kv_connector":"MoRIIOConnector","labels":%s}`, pr.p.URL(), labels(pr.p, "read", "")), nil)
		addWorker(t, gw, fmt.Sprintf(`{"url":%q,"worker_type":"decode","runtime_type":"vllm","kv_connector":"MoRIIOConnector","labels":%s}`, pr.d.URL(), labels(pr.d, "write", "")), nil)
		r := post(t, gw.URL+"/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}]}`, nil)
		require.Equal(t, 503, r.Status, "%s", r.Body)
		code, _, _ := errorBody(t, r)
		assert.Equal(t, "moriio_pair_misconfigured", code)
		assert.Zero(t, len(pr.p.Requests())+len(pr.d.Requests()))
	})
}

// TestVLLMNixlWithoutHandoff: a NIXL prefill that returns no kv_transfer_params
// (its first token was EOS) still yields an answer — the decode recomputes —
// and smg_pd_kv_transfer_failures_total counts it.
func TestVLLMNixlWithoutHandoff(t *testing.T) {
	p := startVLLM(t, vllm.Config{Role: vllm.Producer, Connector: vllm.Nixl, EOSAt: 1})
	d := startVLLM(t, vllm.Config{Role: vllm.Consumer, Connector: vllm.Nixl})
	gw := startGateway(t, gwOpts{Extra: []string{"--disable-retries"}})
	addWorker(t, gw, fmt.Sprintf(`{"url":%q,"worker_type":"prefill","kv_connector":"NixlConnector"}`, p.URL()), nil)
	addWorker(t, gw, fmt.Sprintf(`{"url":%q,"worker_type":"decode","kv_connector":"NixlConnector"}`, d.URL()), nil)
	r := post(t, gw.URL+"/v1/completions", `{"prompt":"stop early","max_tokens":4}`, nil)
	require.Equal(t, 200, r.Status, "%s", r.Body)
	assert.Equal(t, "recomputed", r.Header.Get("X-Fake-KV"))
	assert.NotContains(t, legBody(t, onlyRequest(t, "decode", d.Requests())), "kv_transfer_params")
	assert.Contains(t, string(do(t, "GET", gw.MetricsURL, nil, nil).Body), "smg_pd_kv_transfer_failures_total 1")
}

// TestVLLMMoRIIOConcurrentPrefillFailure: under concurrent WRITE both legs go
// out at once; a failing prefill answers the client and the decode leg
// (waiting for a push that never comes) is dropped.
func TestVLLMMoRIIOConcurrentPrefillFailure(t *testing.T) {
	p := startVLLM(t, vllm.Config{Role: vllm.Producer, Connector: vllm.MoRIIO, MoRIIOMode: vllm.Write, FailStatus: 503, FailBody: `{"error":{"message":"prefill busy"}}`})
	d := startVLLM(t, vllm.Config{Role: vllm.Consumer, Connector: vllm.MoRIIO, MoRIIOMode: vllm.Write})
	gw := startGateway(t, gwOpts{Extra: []string{"--disable-retries"}})
	lab := func(s *vllm.Server, extra string) string {
		return fmt.Sprintf(`{"moriio_mode":"write","moriio_host":"127.0.0.1","moriio_handshake_port":"%d","moriio_notify_port":"%d"%s}`, s.HandshakePort(), s.NotifyPort(), extra)
	}
	addWorker(t, gw, fmt.Sprintf(`{"url":%q,"worker_type":"prefill","runtime_type":"vllm","kv_connector":"MoRIIOConnector","labels":%s}`, p.URL(), lab(p, "")), nil)
	addWorker(t, gw, fmt.Sprintf(`{"url":%q,"worker_type":"decode","runtime_type":"vllm","kv_connector":"MoRIIOConnector","labels":%s}`, d.URL(), lab(d, `,"moriio_write_dispatch":"concurrent"`)), nil)
	r := post(t, gw.URL+"/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],"max_tokens":3}`, nil)
	require.Equal(t, 503, r.Status, "%s", r.Body)
	code, msg, _ := errorBody(t, r)
	assert.Equal(t, "prefill_upstream_error", code)
	assert.Equal(t, "prefill busy", msg)
	assert.Len(t, d.Requests(), 1, "the decode leg went out concurrently")
}
