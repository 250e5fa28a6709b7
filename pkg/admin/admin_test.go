package admin

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/smg-project/smg-extproc/pkg/manager"
	"github.com/smg-project/smg-extproc/pkg/workers"
)

func intp(n int) *int { return &n }

// resolveStub resolves every host except "unresolvable" to one address.
func resolveStub(host string) ([]string, error) {
	if host == "unresolvable" {
		return nil, errors.New("no such host")
	}
	if strings.Count(host, ".") == 3 {
		return []string{host}, nil
	}
	return []string{"10.0.0.1"}, nil
}

type fixture struct {
	reg *workers.Registry
	mgr *manager.Manager
	srv *httptest.Server
}

func newFixture(t *testing.T, apiKey string, pairing func(*workers.Worker) string) *fixture {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	reg := workers.NewRegistry()
	mgr := manager.New(ctx, reg, zerolog.Nop(), manager.Hooks{
		Detect: func(context.Context, string, string) (string, error) { return "sglang", nil },
	})
	mgr.Resolve = resolveStub
	mgr.DrainTimeout = time.Second
	srv := httptest.NewServer(Handler(Deps{
		Log: zerolog.Nop(), Registry: reg, Client: http.DefaultClient, APIKey: apiKey, Manager: mgr, PairingKey: pairing,
	}))
	t.Cleanup(func() {
		srv.Close()
		cancel()
		mgr.Wait()
	})
	return &fixture{reg: reg, mgr: mgr, srv: srv}
}

// add registers a worker directly, with the given health.
func (f *fixture) add(t *testing.T, spec workers.Spec, healthy bool) *workers.Worker {
	t.Helper()
	w, err := workers.New(spec, resolveStub)
	require.NoError(t, err)
	w.SetHealthy(healthy)
	require.NoError(t, f.reg.Add(w))
	return w
}

type resp struct {
	status int
	header http.Header
	body   []byte
}

func (r resp) json(t *testing.T) map[string]any {
	t.Helper()
	var m map[string]any
	require.NoError(t, json.Unmarshal(r.body, &m), "body: %s", r.body)
	return m
}

func (f *fixture) do(t *testing.T, method, path, body string, hdr ...string) resp {
	t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequest(method, f.srv.URL+path, rd)
	require.NoError(t, err)
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	res, err := f.srv.Client().Do(req)
	require.NoError(t, err)
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	return resp{status: res.StatusCode, header: res.Header, body: b}
}

func TestProbes(t *testing.T) {
	f := newFixture(t, "secret", nil)
	for _, p := range []string{"/liveness", "/health"} {
		t.Run(p, func(t *testing.T) {
			r := f.do(t, "GET", p, "")
			assert.Equal(t, 200, r.status)
			assert.Equal(t, "OK", string(r.body))
			assert.Equal(t, "text/plain; charset=utf-8", r.header.Get("Content-Type"))
		})
	}
}

func TestReadiness(t *testing.T) {
	notReady := `{"status":"not ready","reason":"insufficient healthy workers"}`
	tests := []struct {
		name   string
		setup  func(t *testing.T, f *fixture)
		status int
		body   string
	}{
		{"no workers", func(t *testing.T, f *fixture) {}, 503, notReady},
		{"prefill only", func(t *testing.T, f *fixture) {
			f.add(t, workers.Spec{URL: "http://10.0.0.1:1", Type: workers.Prefill}, true)
		}, 503, notReady},
		{"decode only", func(t *testing.T, f *fixture) {
			f.add(t, workers.Spec{URL: "http://10.0.0.2:1", Type: workers.Decode}, true)
		}, 503, notReady},
		{"unhealthy decode", func(t *testing.T, f *fixture) {
			f.add(t, workers.Spec{URL: "http://10.0.0.1:1", Type: workers.Prefill}, true)
			f.add(t, workers.Spec{URL: "http://10.0.0.2:1", Type: workers.Decode}, false)
		}, 503, notReady},
		{"regular workers do not count", func(t *testing.T, f *fixture) {
			f.add(t, workers.Spec{URL: "http://10.0.0.1:1", Type: workers.Regular}, true)
			f.add(t, workers.Spec{URL: "http://10.0.0.2:1", Type: workers.Decode}, true)
		}, 503, notReady},
		{"healthy pair", func(t *testing.T, f *fixture) {
			f.add(t, workers.Spec{URL: "http://10.0.0.1:1", Type: workers.Prefill}, true)
			f.add(t, workers.Spec{URL: "http://10.0.0.2:1", Type: workers.Decode}, true)
		}, 200, `{"status":"ready","healthy_workers":2,"total_workers":2}`},
		{"healthy pair among unhealthy", func(t *testing.T, f *fixture) {
			f.add(t, workers.Spec{URL: "http://10.0.0.1:1", Type: workers.Prefill}, true)
			f.add(t, workers.Spec{URL: "http://10.0.0.2:1", Type: workers.Prefill}, false)
			f.add(t, workers.Spec{URL: "http://10.0.0.3:1", Type: workers.Decode}, true)
			f.add(t, workers.Spec{URL: "http://10.0.0.4:1", Type: workers.Decode}, false)
		}, 200, `{"status":"ready","healthy_workers":2,"total_workers":4}`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, "", nil)
			tc.setup(t, f)
			r := f.do(t, "GET", "/readiness", "")
			assert.Equal(t, tc.status, r.status)
			assert.JSONEq(t, tc.body, string(r.body))
			assert.Equal(t, "application/json", r.header.Get("Content-Type"))
		})
	}
}

func TestListWorkers(t *testing.T) {
	f := newFixture(t, "", func(w *workers.Worker) string { return "key-" + string(w.Type) })
	p := f.add(t, workers.Spec{URL: "http://10.0.0.1:8000", Type: workers.Prefill, BootstrapPort: intp(8998),
		APIKey: "worker-secret", Labels: map[string]string{"zone": "a"}, KVConnector: "NixlConnector"}, true)
	d := f.add(t, workers.Spec{URL: "http://10.0.0.2:8000@1", Type: workers.Decode, APIKey: "worker-secret", DPSize: intp(2)}, false)
	rg := f.add(t, workers.Spec{URL: "http://10.0.0.3:8000", Type: workers.Regular}, true)
	release := d.Acquire()
	defer release()

	r := f.do(t, "GET", "/workers", "")
	require.Equal(t, 200, r.status)
	assert.NotContains(t, string(r.body), "worker-secret", "api keys are never listed")
	assert.NotContains(t, string(r.body), "api_key")

	m := r.json(t)
	assert.EqualValues(t, 3, m["total"])
	assert.Equal(t, map[string]any{"prefill_count": 1.0, "decode_count": 1.0, "regular_count": 1.0}, m["stats"])
	list, ok := m["workers"].([]any)
	require.True(t, ok)
	require.Len(t, list, 3)

	tests := []struct {
		name string
		idx  int
		want map[string]any
	}{
		{"prefill", 0, map[string]any{
			"id": p.ID, "url": "http://10.0.0.1:8000", "worker_type": "prefill", "connection_mode": "http",
			"runtime_type": "sglang", "bootstrap_port": 8998.0, "labels": map[string]any{"zone": "a"},
			"kv_connector": "NixlConnector", "pd_pairing": "key-prefill", "is_healthy": true, "status": "ready",
			"load": 0.0, "job_status": nil,
		}},
		{"decode", 1, map[string]any{
			"id": d.ID, "url": "http://10.0.0.2:8000@1", "worker_type": "decode", "connection_mode": "http",
			"runtime_type": "sglang", "dp_rank": 1.0, "dp_size": 2.0, "pd_pairing": "key-decode",
			"is_healthy": false, "status": "not_ready", "load": 1.0, "job_status": nil,
		}},
		{"regular has no pairing", 2, map[string]any{
			"id": rg.ID, "url": "http://10.0.0.3:8000", "worker_type": "regular", "connection_mode": "http",
			"runtime_type": "sglang", "is_healthy": true, "status": "ready", "load": 0.0, "job_status": nil,
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, tc.want, list[tc.idx])
		})
	}

	t.Run("no pairing hook", func(t *testing.T) {
		f := newFixture(t, "", nil)
		f.add(t, workers.Spec{URL: "http://10.0.0.1:8000", Type: workers.Prefill}, true)
		r := f.do(t, "GET", "/workers", "")
		assert.NotContains(t, string(r.body), "pd_pairing")
	})

	t.Run("empty", func(t *testing.T) {
		f := newFixture(t, "", nil)
		r := f.do(t, "GET", "/workers", "")
		assert.JSONEq(t, `{"workers":[],"total":0,"stats":{"prefill_count":0,"decode_count":0,"regular_count":0}}`, string(r.body))
	})
}

func TestGetWorker(t *testing.T) {
	f := newFixture(t, "", nil)
	w := f.add(t, workers.Spec{URL: "http://10.0.0.1:8000", Type: workers.Decode, APIKey: "worker-secret"}, true)
	missing := workers.NewID()

	tests := []struct {
		name   string
		path   string
		status int
		code   string
		check  func(t *testing.T, m map[string]any)
	}{
		{"found", "/workers/" + w.ID, 200, "", func(t *testing.T, m map[string]any) {
			assert.Equal(t, w.ID, m["id"])
			assert.Equal(t, "http://10.0.0.1:8000", m["url"])
			assert.Equal(t, true, m["is_healthy"])
			assert.NotContains(t, m, "api_key")
		}},
		{"uppercase uuid is well-formed but unknown", "/workers/" + strings.ToUpper(missing), 404, "WORKER_NOT_FOUND", nil},
		{"unknown", "/workers/" + missing, 404, "WORKER_NOT_FOUND", func(t *testing.T, m map[string]any) {
			assert.Equal(t, "Worker not found: "+missing, m["error"])
		}},
		{"not a uuid", "/workers/abc", 400, "BAD_REQUEST", func(t *testing.T, m map[string]any) {
			assert.Equal(t, "Invalid worker ID: abc", m["error"])
		}},
		{"uuid-length garbage", "/workers/" + strings.Repeat("z", 36), 400, "BAD_REQUEST", nil},
		{"dashes misplaced", "/workers/" + strings.ReplaceAll(missing, "-", "") + "----", 400, "BAD_REQUEST", nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r := f.do(t, "GET", tc.path, "")
			assert.Equal(t, tc.status, r.status)
			m := r.json(t)
			if tc.code != "" {
				assert.Equal(t, tc.code, m["code"])
			}
			if tc.check != nil {
				tc.check(t, m)
			}
		})
	}
}

func TestAPIKey(t *testing.T) {
	f := newFixture(t, "s3cret", nil)
	w := f.add(t, workers.Spec{URL: "http://10.0.0.1:8000", Type: workers.Decode}, true)

	routes := []struct {
		method, path, body string
	}{
		{"GET", "/workers", ""},
		{"GET", "/workers/" + w.ID, ""},
		{"POST", "/workers", `{"url":"http://new:8000","worker_type":"decode"}`},
		{"PUT", "/workers/" + w.ID, `{"url":"http://10.0.0.1:8000"}`},
		{"PATCH", "/workers/" + w.ID, `{"labels":{"a":"b"}}`},
		{"DELETE", "/workers/" + workers.NewID(), ""},
	}
	creds := []struct {
		name   string
		hdr    []string
		status int
	}{
		{"missing", nil, 401},
		{"wrong key", []string{"Authorization", "Bearer nope"}, 401},
		{"no bearer prefix", []string{"Authorization", "s3cret"}, 401},
		{"lowercase scheme", []string{"Authorization", "bearer s3cret"}, 401},
		{"key prefix only", []string{"Authorization", "Bearer s3cre"}, 401},
	}
	for _, rt := range routes {
		for _, c := range creds {
			t.Run(rt.method+" "+rt.path[:min(len(rt.path), 9)]+" "+c.name, func(t *testing.T) {
				r := f.do(t, rt.method, rt.path, rt.body, c.hdr...)
				assert.Equal(t, c.status, r.status)
				assert.JSONEq(t, `{"error":"Invalid or missing API key","code":"UNAUTHORIZED"}`, string(r.body))
			})
		}
	}

	t.Run("right key", func(t *testing.T) {
		r := f.do(t, "GET", "/workers", "", "Authorization", "Bearer s3cret")
		assert.Equal(t, 200, r.status)
		r = f.do(t, "GET", "/workers/"+w.ID, "", "Authorization", "Bearer s3cret")
		assert.Equal(t, 200, r.status)
	})

	t.Run("probes are open", func(t *testing.T) {
		for _, p := range []string{"/liveness", "/health", "/readiness"} {
			r := f.do(t, "GET", p, "")
			assert.NotEqual(t, 401, r.status, p)
		}
	})

	t.Run("no key configured: open", func(t *testing.T) {
		f := newFixture(t, "", nil)
		r := f.do(t, "GET", "/workers", "", "Authorization", "Bearer anything")
		assert.Equal(t, 200, r.status)
	})
}

func TestCreateWorker(t *testing.T) {
	tests := []struct {
		name   string
		body   string
		status int
		code   string
		msg    string
	}{
		{"bad json", `{"url":`, 400, "BAD_REQUEST", "invalid JSON"},
		{"not an object", `[1,2]`, 400, "BAD_REQUEST", "invalid JSON"},
		{"bad url", `{"url":"http://d:8000/v1","worker_type":"decode"}`, 400, "BAD_REQUEST", "must be scheme://host:port"},
		{"missing url", `{"worker_type":"decode"}`, 400, "BAD_REQUEST", "url is required"},
		{"ipc prefill", `{"url":"ipc:///tmp/p","worker_type":"prefill"}`, 400, "BAD_REQUEST", "PD legs"},
		{"grpc", `{"url":"grpc://d:8000","worker_type":"decode"}`, 400, "BAD_REQUEST", "grpc://"},
		{"grpc connection mode", `{"url":"http://d:8000","worker_type":"decode","connection_mode":"grpc"}`, 400, "BAD_REQUEST", "connection_mode"},
		{"encode", `{"url":"http://d:8000","worker_type":"encode"}`, 400, "BAD_REQUEST", "encode"},
		{"unknown type", `{"url":"http://d:8000","worker_type":"mixed"}`, 400, "BAD_REQUEST", "worker_type"},
		{"bad bootstrap port", `{"url":"http://p:8000","worker_type":"prefill","bootstrap_port":0}`, 400, "BAD_REQUEST", "bootstrap_port"},
		{"unresolvable", `{"url":"http://unresolvable:8000","worker_type":"decode"}`, 400, "BAD_REQUEST", "no such host"},
		{"exists", `{"url":"http://10.0.0.1:8000","worker_type":"decode"}`, 409, "WORKER_ALREADY_EXISTS", "Worker already exists at URL 'http://10.0.0.1:8000'"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, "", nil)
			f.add(t, workers.Spec{URL: "http://10.0.0.1:8000", Type: workers.Decode}, true)
			r := f.do(t, "POST", "/workers", tc.body)
			assert.Equal(t, tc.status, r.status)
			m := r.json(t)
			assert.Equal(t, tc.code, m["code"])
			assert.Contains(t, m["error"], tc.msg)
			assert.False(t, strings.HasPrefix(m["error"].(string), tc.code+":"), "kind prefix stripped from the message")
			f.mgr.Wait()
			assert.Len(t, f.reg.Snapshot(), 1, "nothing registered")
		})
	}

	t.Run("accepted", func(t *testing.T) {
		f := newFixture(t, "", nil)
		r := f.do(t, "POST", "/workers", `{"url":"http://new:8000","worker_type":"Decode","labels":{"kv_role":"kv_consumer","zone":"b"},"models":[{"id":"m"}],"priority":3}`)
		require.Equal(t, 202, r.status, "%s", r.body)
		m := r.json(t)
		id, _ := m["worker_id"].(string)
		require.Len(t, id, 36)
		assert.Equal(t, "/workers/"+id, r.header.Get("Location"))
		assert.Equal(t, map[string]any{
			"status": "accepted", "worker_id": id, "url": "http://new:8000", "location": "/workers/" + id,
			"message": "Worker addition queued for background processing",
		}, m)

		f.mgr.Wait()
		w, ok := f.reg.Get(id)
		require.True(t, ok)
		assert.Equal(t, workers.Decode, w.Type, "worker_type is case-insensitive")
		assert.Equal(t, "kv_consumer", w.KVRole, "v1.9 label form moved into the field")
		assert.Equal(t, map[string]string{"zone": "b"}, w.Labels)

		r = f.do(t, "GET", "/workers/"+id, "")
		assert.Equal(t, 200, r.status)

		r = f.do(t, "POST", "/workers", `{"url":"http://new:8000","worker_type":"decode"}`)
		assert.Equal(t, 409, r.status)
		assert.Equal(t, "WORKER_ALREADY_EXISTS", r.json(t)["code"])
	})

	t.Run("default type is regular", func(t *testing.T) {
		f := newFixture(t, "", nil)
		r := f.do(t, "POST", "/workers", `{"url":"http://r:8000"}`)
		require.Equal(t, 202, r.status)
		f.mgr.Wait()
		w, ok := f.reg.FindURL("http://r:8000")
		require.True(t, ok)
		assert.Equal(t, workers.Regular, w.Type)
	})
}

func TestCreateWorkerPendingVisible(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	reg := workers.NewRegistry()
	gate := make(chan struct{})
	mgr := manager.New(ctx, reg, zerolog.Nop(), manager.Hooks{
		Detect: func(ctx context.Context, _, _ string) (string, error) {
			select {
			case <-gate:
			case <-ctx.Done():
			}
			return "sglang", nil
		},
	})
	mgr.Resolve = resolveStub
	srv := httptest.NewServer(Handler(Deps{Log: zerolog.Nop(), Registry: reg, Manager: mgr}))
	f := &fixture{reg: reg, mgr: mgr, srv: srv}
	t.Cleanup(func() { srv.Close(); cancel(); mgr.Wait() })

	r := f.do(t, "POST", "/workers", `{"url":"http://slow:8000","worker_type":"decode"}`)
	require.Equal(t, 202, r.status)
	id := r.json(t)["worker_id"].(string)

	r = f.do(t, "GET", "/workers/"+id, "")
	require.Equal(t, 200, r.status)
	m := r.json(t)
	assert.Equal(t, "pending", m["status"])
	assert.Equal(t, false, m["is_healthy"])
	assert.Equal(t, "http://slow:8000", m["url"])
	job, ok := m["job_status"].(map[string]any)
	require.True(t, ok)
	assert.Equal(t, "AddWorker", job["job_type"])
	assert.Equal(t, "http://slow:8000", job["worker_url"])

	close(gate)
	mgr.Wait()
	r = f.do(t, "GET", "/workers/"+id, "")
	assert.Equal(t, "ready", r.json(t)["status"])
}

func TestDeleteWorker(t *testing.T) {
	f := newFixture(t, "", nil)
	w := f.add(t, workers.Spec{URL: "http://10.0.0.1:8000", Type: workers.Decode}, true)

	tests := []struct {
		name   string
		path   string
		status int
		code   string
	}{
		{"not a uuid", "/workers/xyz", 400, "BAD_REQUEST"},
		{"unknown", "/workers/" + workers.NewID(), 404, "WORKER_NOT_FOUND"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r := f.do(t, "DELETE", tc.path, "")
			assert.Equal(t, tc.status, r.status)
			assert.Equal(t, tc.code, r.json(t)["code"])
		})
	}

	t.Run("accepted", func(t *testing.T) {
		r := f.do(t, "DELETE", "/workers/"+w.ID, "")
		require.Equal(t, 202, r.status)
		assert.Equal(t, map[string]any{
			"status": "accepted", "worker_id": w.ID, "message": "Worker removal queued for background processing",
		}, r.json(t))
		f.mgr.Wait()
		_, ok := f.reg.Get(w.ID)
		assert.False(t, ok)
		r = f.do(t, "GET", "/workers/"+w.ID, "")
		assert.Equal(t, 404, r.status)
	})
}

func TestUpdateWorker(t *testing.T) {
	tests := []struct {
		name   string
		method string
		body   string
		status int
		code   string
		check  func(t *testing.T, w *workers.Worker)
	}{
		{"put replaces", "PUT", `{"url":"http://10.0.0.1:8000","labels":{"zone":"b"}}`, 202, "", func(t *testing.T, w *workers.Worker) {
			assert.Equal(t, workers.Decode, w.Type, "PUT without worker_type keeps the type")
			assert.Equal(t, map[string]string{"zone": "b"}, w.Labels)
		}},
		{"put url change", "PUT", `{"url":"http://10.0.0.9:8000"}`, 400, "BAD_REQUEST", nil},
		{"put bad json", "PUT", `{`, 400, "BAD_REQUEST", nil},
		{"patch merges labels", "PATCH", `{"labels":{"rack":"7"}}`, 202, "", func(t *testing.T, w *workers.Worker) {
			assert.Equal(t, map[string]string{"zone": "a", "rack": "7"}, w.Labels)
			assert.Equal(t, intp(8998), w.BootstrapPort, "unpatched fields kept")
		}},
		{"patch url change", "PATCH", `{"url":"http://10.0.0.9:8000"}`, 400, "BAD_REQUEST", nil},
		{"patch type change", "PATCH", `{"worker_type":"prefill"}`, 400, "BAD_REQUEST", nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, "", nil)
			w := f.add(t, workers.Spec{URL: "http://10.0.0.1:8000", Type: workers.Decode, BootstrapPort: intp(8998),
				Labels: map[string]string{"zone": "a"}}, true)
			r := f.do(t, tc.method, "/workers/"+w.ID, tc.body)
			assert.Equal(t, tc.status, r.status, "%s", r.body)
			if tc.code != "" {
				assert.Equal(t, tc.code, r.json(t)["code"])
			}
			cur, ok := f.reg.Get(w.ID)
			require.True(t, ok, "the id is kept")
			if tc.check != nil {
				tc.check(t, cur)
			} else {
				assert.Same(t, w, cur, "a refused update changes nothing")
			}
		})
	}

	t.Run("unknown worker", func(t *testing.T) {
		f := newFixture(t, "", nil)
		r := f.do(t, "PUT", "/workers/"+workers.NewID(), `{"url":"http://x:1"}`)
		assert.Equal(t, 404, r.status)
		assert.Equal(t, "WORKER_NOT_FOUND", r.json(t)["code"])
		r = f.do(t, "PATCH", "/workers/bad-id", `{}`)
		assert.Equal(t, 400, r.status)
	})
}

func TestFallback(t *testing.T) {
	f := newFixture(t, "", nil)
	tests := []struct {
		name   string
		method string
		path   string
		status int
		code   string
		allow  string
	}{
		{"unknown path", "GET", "/nope", 404, "not_found", ""},
		{"unknown nested path", "POST", "/v2/whatever", 404, "not_found", ""},
		{"GET on a PD route", "GET", "/v1/chat/completions", 405, "method_not_allowed", "POST"},
		{"GET on /generate", "GET", "/generate", 405, "method_not_allowed", "POST"},
		{"PUT on /v1/messages/count_tokens", "PUT", "/v1/messages/count_tokens", 405, "method_not_allowed", "POST"},
		{"POST on /liveness", "POST", "/liveness", 405, "method_not_allowed", ""},
		{"PATCH on /workers", "PATCH", "/workers", 405, "method_not_allowed", ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r := f.do(t, tc.method, tc.path, "")
			assert.Equal(t, tc.status, r.status)
			assert.Equal(t, "application/json", r.header.Get("Content-Type"))
			assert.Equal(t, tc.code, r.header.Get("X-SMG-Error-Code"))
			var body struct {
				Error struct {
					Type    string  `json:"type"`
					Code    string  `json:"code"`
					Message string  `json:"message"`
					Param   *string `json:"param"`
				} `json:"error"`
			}
			require.NoError(t, json.Unmarshal(r.body, &body), "%s", r.body)
			assert.Equal(t, tc.code, body.Error.Code)
			assert.Equal(t, http.StatusText(tc.status), body.Error.Type)
			assert.Contains(t, body.Error.Message, tc.path)
			assert.Nil(t, body.Error.Param)
			if tc.allow != "" {
				assert.Equal(t, tc.allow, r.header.Get("Allow"))
			}
		})
	}
}

func TestProxyPrefill(t *testing.T) {
	var gotAuthV atomic.Value
	gotAuthV.Store("")
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		gotAuthV.Store(r.Header.Get("Authorization"))
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"path":"`+r.URL.Path+`"}`)
	}))
	defer up.Close()

	t.Run("no healthy prefill", func(t *testing.T) {
		f := newFixture(t, "", nil)
		f.add(t, workers.Spec{URL: up.URL, Type: workers.Prefill}, false)
		r := f.do(t, "GET", "/v1/models", "")
		assert.Equal(t, 503, r.status)
		assert.Equal(t, "no_prefill_servers", r.header.Get("X-SMG-Error-Code"))
	})

	t.Run("relayed to the first healthy prefill", func(t *testing.T) {
		f := newFixture(t, "", nil)
		f.add(t, workers.Spec{URL: "http://10.255.255.1:1", Type: workers.Prefill}, false)
		f.add(t, workers.Spec{URL: up.URL, Type: workers.Prefill, APIKey: "wk"}, true)
		for _, p := range []string{"/v1/models", "/get_server_info", "/get_model_info"} {
			r := f.do(t, "GET", p, "")
			assert.Equal(t, 200, r.status, p)
			assert.JSONEq(t, `{"path":"`+p+`"}`, string(r.body))
			assert.Equal(t, "Bearer wk", gotAuthV.Load(), "worker key used when the client sends none")
		}
		r := f.do(t, "GET", "/v1/models", "", "Authorization", "Bearer client")
		assert.Equal(t, 200, r.status)
		assert.Equal(t, "Bearer client", gotAuthV.Load(), "client credentials forwarded")
	})
}
