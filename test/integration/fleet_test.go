package integration

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/smg-project/smg-extproc/pkg/fake/sglang"
)

type workerInfo struct {
	ID        string            `json:"id"`
	URL       string            `json:"url"`
	Type      string            `json:"worker_type"`
	Status    string            `json:"status"`
	IsHealthy bool              `json:"is_healthy"`
	PDPairing string            `json:"pd_pairing"`
	Labels    map[string]string `json:"labels"`
	APIKey    *string           `json:"api_key"`
}

func listWorkers(t testing.TB, gw *Gateway, hdr map[string]string) []workerInfo {
	t.Helper()
	r := do(t, "GET", gw.URL+"/workers", nil, hdr)
	require.Equal(t, 200, r.Status, "GET /workers: %s", r.Body)
	var out struct {
		Workers []workerInfo `json:"workers"`
	}
	require.NoError(t, json.Unmarshal(r.Body, &out))
	return out.Workers
}

func addWorker(t testing.TB, gw *Gateway, body string, hdr map[string]string) string {
	t.Helper()
	r := do(t, "POST", gw.URL+"/workers", []byte(body), hdr)
	require.Equal(t, 202, r.Status, "POST /workers %s: %s", body, r.Body)
	var out struct {
		WorkerID string `json:"worker_id"`
		Location string `json:"location"`
		Status   string `json:"status"`
	}
	require.NoError(t, json.Unmarshal(r.Body, &out))
	require.Equal(t, "accepted", out.Status)
	require.Equal(t, "/workers/"+out.WorkerID, out.Location)
	require.Equal(t, out.Location, r.Header.Get("Location"))
	waitFor(t, 20*time.Second, func() bool {
		r := do(t, "GET", gw.URL+"/workers/"+out.WorkerID, nil, hdr)
		return r.Status == 200 && strings.Contains(string(r.Body), `"status":"ready"`)
	}, "worker %s never became ready", out.WorkerID)
	return out.WorkerID
}

func adminCode(t testing.TB, r Response) string {
	t.Helper()
	var b struct {
		Error string `json:"error"`
		Code  string `json:"code"`
	}
	require.NoError(t, json.Unmarshal(r.Body, &b), "admin error body: %s", r.Body)
	require.NotEmpty(t, b.Error)
	return b.Code
}

// TestWorkerAPI: SMG's worker API on the client port, through Envoy, with the
// registry, xDS and routing following every change.
func TestWorkerAPI(t *testing.T) {
	p := startFake(t, fastFake(sglang.Prefill))
	d := startFake(t, fastFake(sglang.Decode))
	gw := startGateway(t, gwOpts{Extra: []string{"--policy", "round_robin"}})

	r := post(t, gw.URL+"/v1/completions", `{"prompt":"x"}`, nil)
	require.Equal(t, 503, r.Status, "no workers yet")

	pid := addWorker(t, gw, fmt.Sprintf(`{"url":%q,"worker_type":"prefill","bootstrap_port":%d,"api_key":"s3cret","labels":{"zone":"a"}}`, p.URL(), p.BootstrapPort()), nil)
	did := addWorker(t, gw, fmt.Sprintf(`{"url":%q,"worker_type":"decode"}`, d.URL()), nil)

	r = post(t, gw.URL+"/v1/completions", `{"prompt":"hello world","max_tokens":3}`, nil)
	require.Equal(t, 200, r.Status, "after registration: %s", r.Body)
	assert.Equal(t, d.URL(), r.Header.Get("x-smg-routed-worker-id"))

	ws := listWorkers(t, gw, nil)
	require.Len(t, ws, 2)
	for _, w := range ws {
		assert.Nil(t, w.APIKey, "api_key must never be shown")
		assert.Equal(t, "sglang/?/?", w.PDPairing)
		assert.True(t, w.IsHealthy)
	}
	raw := do(t, "GET", gw.URL+"/workers", nil, nil)
	assert.NotContains(t, string(raw.Body), "s3cret")

	t.Run("errors", func(t *testing.T) {
		r := do(t, "POST", gw.URL+"/workers", []byte(fmt.Sprintf(`{"url":%q,"worker_type":"decode"}`, d.URL())), nil)
		assert.Equal(t, 409, r.Status)
		assert.Equal(t, "WORKER_ALREADY_EXISTS", adminCode(t, r))
		for _, body := range []string{`{"url":"http://","worker_type":"decode"}`, `{"url":"ipc:///tmp/w.sock","worker_type":"prefill"}`, `{"worker_type":"decode"}`, `{not json`, `{"url":"http://127.0.0.1:1","worker_type":"chef"}`} {
			r := do(t, "POST", gw.URL+"/workers", []byte(body), nil)
			assert.Equal(t, 400, r.Status, body)
			assert.Equal(t, "BAD_REQUEST", adminCode(t, r), body)
		}
		r = do(t, "GET", gw.URL+"/workers/01a22cb9-3e41-717a-af0e-25f12b76c5da", nil, nil)
		assert.Equal(t, 404, r.Status)
		assert.Equal(t, "WORKER_NOT_FOUND", adminCode(t, r))
		r = do(t, "DELETE", gw.URL+"/workers/not-a-uuid", nil, nil)
		assert.Equal(t, 400, r.Status)
		assert.Equal(t, "BAD_REQUEST", adminCode(t, r))
	})

	t.Run("patch-labels-changes-pairing-key", func(t *testing.T) {
		r := do(t, "PATCH", gw.URL+"/workers/"+pid, []byte(`{"labels":{"disaggregation_transfer_backend":"NIXL","page_size":"64"}}`), nil)
		require.Equal(t, 202, r.Status, "%s", r.Body)
		waitFor(t, 5*time.Second, func() bool {
			for _, w := range listWorkers(t, gw, nil) {
				if w.ID == pid {
					return w.PDPairing == "sglang/nixl/page=64" && w.Labels["zone"] == "a"
				}
			}
			return false
		}, "PATCH not applied")
		// Lenient: the decode reports nothing, so the pair still forms.
		r = post(t, gw.URL+"/v1/completions", `{"prompt":"still pairs","max_tokens":2}`, nil)
		require.Equal(t, 200, r.Status, "%s", r.Body)
	})

	t.Run("delete-then-unroutable", func(t *testing.T) {
		r := do(t, "DELETE", gw.URL+"/workers/"+did, nil, nil)
		require.Equal(t, 202, r.Status)
		waitFor(t, 10*time.Second, func() bool { return do(t, "GET", gw.URL+"/workers/"+did, nil, nil).Status == 404 }, "decode not removed")
		d.Reset()
		r = post(t, gw.URL+"/v1/completions", `{"prompt":"x"}`, nil)
		require.Equal(t, 503, r.Status)
		code, _, _ := errorBody(t, r)
		assert.Equal(t, "no_available_workers", code)
		assert.Zero(t, len(d.Requests()), "a removed decode must not be contacted")
	})
}

func TestAdminAPIKey(t *testing.T) {
	p := startFake(t, fastFake(sglang.Prefill))
	d := startFake(t, fastFake(sglang.Decode))
	gw := startGateway(t, gwOpts{
		Prefills: []prefillSpec{{URL: p.URL(), Port: fmt.Sprint(p.BootstrapPort())}}, Decodes: []string{d.URL()},
		Extra: []string{"--api-key", "adm1n"},
	})
	r := do(t, "GET", gw.URL+"/workers", nil, nil)
	assert.Equal(t, 401, r.Status)
	r = do(t, "POST", gw.URL+"/workers", []byte(`{"url":"http://127.0.0.1:9","worker_type":"decode"}`), map[string]string{"Authorization": "Bearer wrong"})
	assert.Equal(t, 401, r.Status)
	assert.Len(t, listWorkers(t, gw, map[string]string{"Authorization": "Bearer adm1n"}), 2)
	// The key guards the control plane only; inference and probes stay open.
	assert.Equal(t, 200, post(t, gw.URL+"/generate", `{"text":"hi","sampling_params":{"max_new_tokens":2}}`, nil).Status)
	assert.Equal(t, 200, do(t, "GET", gw.URL+"/readiness", nil, nil).Status)
	assert.NotContains(t, gw.Logs(), "adm1n", "secrets never appear in logs")
}

// TestRemovalDrainsInFlight: deleting a decode mid-stream lets the stream
// finish; new requests no longer go there.
func TestRemovalDrainsInFlight(t *testing.T) {
	p := startFake(t, fastFake(sglang.Prefill))
	slow := fastFake(sglang.Decode)
	slow.PerTokenDelay = 100 * time.Millisecond
	d := startFake(t, slow)
	gw := startGateway(t, gwOpts{Prefills: []prefillSpec{{URL: p.URL(), Port: fmt.Sprint(p.BootstrapPort())}}, Decodes: []string{d.URL()}})
	var did string
	for _, w := range listWorkers(t, gw, nil) {
		if w.Type == "decode" {
			did = w.ID
		}
	}
	var wg sync.WaitGroup
	var streamed Response
	wg.Add(1)
	go func() {
		defer wg.Done()
		streamed = post(t, gw.URL+"/v1/chat/completions", `{"messages":[{"role":"user","content":"long answer"}],"max_tokens":20,"stream":true}`, nil)
	}()
	waitFor(t, 5*time.Second, func() bool { return len(d.Requests()) == 1 }, "stream did not start")
	time.Sleep(300 * time.Millisecond)
	r := do(t, "DELETE", gw.URL+"/workers/"+did, nil, nil)
	require.Equal(t, 202, r.Status)
	wg.Wait()
	require.Equal(t, 200, streamed.Status)
	assert.Equal(t, 20, strings.Count(string(streamed.Body), `"delta"`)-1+boolInt(!strings.Contains(string(streamed.Body), `"role"`)), "all tokens streamed: %s", tail(string(streamed.Body), 400))
	assert.True(t, strings.HasSuffix(strings.TrimSpace(string(streamed.Body)), "data: [DONE]"), "stream completed")
	waitFor(t, 10*time.Second, func() bool { return do(t, "GET", gw.URL+"/workers/"+did, nil, nil).Status == 404 }, "decode not removed after drain")
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

// TestPairingCohorts: two transports; each prefill only ever meets its own decodes.
func TestPairingCohorts(t *testing.T) {
	p1 := startFake(t, fastFake(sglang.Prefill))
	p2 := startFake(t, fastFake(sglang.Prefill))
	ds := []*sglang.Server{startFake(t, fastFake(sglang.Decode)), startFake(t, fastFake(sglang.Decode)), startFake(t, fastFake(sglang.Decode)), startFake(t, fastFake(sglang.Decode))}
	gw := startGateway(t, gwOpts{Extra: []string{"--policy", "round_robin", "--pd-pairing-mode", "strict"}})
	reg := func(u, typ, backend string, port int) {
		body := fmt.Sprintf(`{"url":%q,"worker_type":%q,"runtime_type":"sglang","labels":{"disaggregation_transfer_backend":%q}`, u, typ, backend)
		if port > 0 {
			body += fmt.Sprintf(`,"bootstrap_port":%d`, port)
		}
		addWorker(t, gw, body+"}", nil)
	}
	reg(p1.URL(), "prefill", "nixl", p1.BootstrapPort())
	reg(p2.URL(), "prefill", "mooncake", p2.BootstrapPort())
	reg(ds[0].URL(), "decode", "nixl", 0)
	reg(ds[1].URL(), "decode", "nixl", 0)
	reg(ds[2].URL(), "decode", "mooncake", 0)
	reg(ds[3].URL(), "decode", "mooncake", 0)
	for i := 0; i < 24; i++ {
		r := post(t, gw.URL+"/generate", fmt.Sprintf(`{"text":"cohort %d","sampling_params":{"max_new_tokens":2}}`, i), nil)
		require.Equal(t, 200, r.Status, "%s", r.Body)
	}
	assert.Len(t, p1.Requests(), 12)
	assert.Len(t, p2.Requests(), 12)
	for i, d := range ds {
		want := p1.BootstrapPort()
		if i >= 2 {
			want = p2.BootstrapPort()
		}
		for _, rq := range d.Requests() {
			assert.Equal(t, json.Number(fmt.Sprint(want)), legBody(t, rq)["bootstrap_port"], "decode %d paired outside its cohort", i)
		}
	}

	t.Run("no-compatible-pair", func(t *testing.T) {
		p3 := startFake(t, fastFake(sglang.Prefill))
		d3 := startFake(t, fastFake(sglang.Decode))
		gw2 := startGateway(t, gwOpts{Extra: []string{"--pd-pairing-mode", "lenient"}})
		addWorker(t, gw2, fmt.Sprintf(`{"url":%q,"worker_type":"prefill","runtime_type":"vllm","kv_connector":"NixlConnector","bootstrap_port":%d}`, p3.URL(), p3.BootstrapPort()), nil)
		addWorker(t, gw2, fmt.Sprintf(`{"url":%q,"worker_type":"decode","runtime_type":"vllm","kv_connector":"MooncakeConnector"}`, d3.URL()), nil)
		r := post(t, gw2.URL+"/v1/completions", `{"prompt":"x"}`, nil)
		require.Equal(t, 503, r.Status)
		code, msg, _ := errorBody(t, r)
		assert.Equal(t, "no_compatible_pd_pair", code)
		assert.Contains(t, msg, "transport")
		assert.Contains(t, msg, "vllm/nixl/?")
		assert.Contains(t, msg, "vllm/mooncake/?")
		assert.Zero(t, len(p3.Requests())+len(d3.Requests()), "neither worker may be contacted")
	})
}

// TestConfigFileReload: workers from --config; edits add and remove workers
// live without dropping an in-flight stream; a broken edit keeps the last good config.
func TestConfigFileReload(t *testing.T) {
	p := startFake(t, fastFake(sglang.Prefill))
	slow := fastFake(sglang.Decode)
	slow.PerTokenDelay = 80 * time.Millisecond
	d1 := startFake(t, slow)
	d2 := startFake(t, fastFake(sglang.Decode))
	dir := t.TempDir()
	path := filepath.Join(dir, "smg.yaml")
	write := func(s string) {
		tmp := path + ".tmp"
		require.NoError(t, os.WriteFile(tmp, []byte(s), 0o644))
		require.NoError(t, os.Rename(tmp, path)) // editors replace files; the watcher must see it
	}
	base := fmt.Sprintf("policy: round_robin\nworkers:\n  - url: %s\n    worker_type: prefill\n    bootstrap_port: %d\n", p.URL(), p.BootstrapPort())
	write(base + fmt.Sprintf("  - url: %s\n    worker_type: decode\n", d1.URL()))
	gw := startGateway(t, gwOpts{Extra: []string{"--config", path}})
	require.Len(t, listWorkers(t, gw, nil), 2)
	require.Equal(t, 200, post(t, gw.URL+"/v1/completions", `{"prompt":"a"}`, nil).Status)

	// Add d2.
	write(base + fmt.Sprintf("  - url: %s\n    worker_type: decode\n  - url: %s\n    worker_type: decode\n", d1.URL(), d2.URL()))
	waitFor(t, 10*time.Second, func() bool { return len(listWorkers(t, gw, nil)) == 3 }, "d2 not added from the config file")

	// Start a slow stream on d1, then drop d1 from the file.
	d1.Reset()
	var wg sync.WaitGroup
	var streamed Response
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; i < 4 && len(d1.Requests()) == 0; i++ { // round robin: land one on d1
			r := post(t, gw.URL+"/v1/chat/completions", `{"messages":[{"role":"user","content":"q"}],"max_tokens":15,"stream":true}`, nil)
			if r.Header.Get("x-smg-routed-worker-id") == d1.URL() {
				streamed = r
				return
			}
		}
	}()
	waitFor(t, 10*time.Second, func() bool { return len(d1.Requests()) == 1 }, "no stream on d1")
	write(base + fmt.Sprintf("  - url: %s\n    worker_type: decode\n", d2.URL()))
	wg.Wait()
	require.Equal(t, 200, streamed.Status)
	assert.True(t, strings.HasSuffix(strings.TrimSpace(string(streamed.Body)), "data: [DONE]"), "in-flight stream must finish: %s", tail(string(streamed.Body), 300))
	waitFor(t, 10*time.Second, func() bool { return len(listWorkers(t, gw, nil)) == 2 }, "d1 not removed")
	d1.Reset()
	for i := 0; i < 4; i++ {
		r := post(t, gw.URL+"/v1/completions", `{"prompt":"b"}`, nil)
		require.Equal(t, 200, r.Status)
		assert.Equal(t, d2.URL(), r.Header.Get("x-smg-routed-worker-id"))
	}
	assert.Zero(t, len(d1.Requests()))

	// A broken file is rejected and the last good config stays.
	write("workers: [ this is not valid yaml\n")
	waitFor(t, 10*time.Second, func() bool { return strings.Contains(gw.Logs(), "config file rejected") }, "broken config not reported")
	assert.Len(t, listWorkers(t, gw, nil), 2)
	assert.Equal(t, 200, post(t, gw.URL+"/v1/completions", `{"prompt":"c"}`, nil).Status)
}

// TestGracefulShutdown: SIGTERM turns readiness to "draining", lets an
// in-flight stream finish, then exits.
func TestGracefulShutdown(t *testing.T) {
	p := startFake(t, fastFake(sglang.Prefill))
	slow := fastFake(sglang.Decode)
	slow.PerTokenDelay = 100 * time.Millisecond
	d := startFake(t, slow)
	gw := startGateway(t, gwOpts{Prefills: []prefillSpec{{URL: p.URL(), Port: fmt.Sprint(p.BootstrapPort())}}, Decodes: []string{d.URL()},
		Extra: []string{"--shutdown-grace-secs", "20"}})
	var wg sync.WaitGroup
	var streamed Response
	wg.Add(1)
	go func() {
		defer wg.Done()
		streamed = post(t, gw.URL+"/v1/chat/completions", `{"messages":[{"role":"user","content":"long"}],"max_tokens":15,"stream":true}`, nil)
	}()
	waitFor(t, 5*time.Second, func() bool { return len(d.Requests()) == 1 }, "stream did not start")
	require.NoError(t, gw.cmd.Process.Signal(syscall.SIGTERM))
	waitFor(t, 5*time.Second, func() bool {
		r, err := client.Get(gw.URL + "/readiness")
		if err != nil {
			return false
		}
		defer r.Body.Close()
		b, _ := io.ReadAll(r.Body)
		return r.StatusCode == 503 && strings.Contains(string(b), "draining")
	}, "readiness never reported draining")
	wg.Wait()
	require.Equal(t, 200, streamed.Status)
	assert.True(t, strings.HasSuffix(strings.TrimSpace(string(streamed.Body)), "data: [DONE]"), "in-flight stream finished: %s", tail(string(streamed.Body), 200))
	select {
	case <-gw.exited:
	case <-time.After(15 * time.Second):
		t.Fatal("gateway did not exit after draining")
	}
}
