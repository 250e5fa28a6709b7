// Package admin serves SMG's control-plane routes (worker API, probes, model
// info) on an internal port; Envoy forwards them from the client port with
// ext_proc disabled.
package admin

import (
	"context"
	"crypto/subtle"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/rs/zerolog"

	"github.com/smg-project/smg-extproc/pkg/apierr"
	"github.com/smg-project/smg-extproc/pkg/manager"
	"github.com/smg-project/smg-extproc/pkg/pd"
	"github.com/smg-project/smg-extproc/pkg/workers"
)

// Deps are the admin server's collaborators.
type Deps struct {
	Log      zerolog.Logger
	Registry *workers.Registry
	Client   *http.Client
	APIKey   string
	Manager  *manager.Manager
	// PairingKey renders a worker's pd_pairing key (nil: omitted).
	PairingKey func(*workers.Worker) string
	// Draining reports a shutdown in progress (readiness answers 503).
	Draining func() bool
}

// Handler returns the admin HTTP handler.
func Handler(d Deps) http.Handler {
	a := &server{d: d}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /liveness", a.ok)
	mux.HandleFunc("GET /health", a.ok)
	mux.HandleFunc("GET /readiness", a.readiness)
	mux.HandleFunc("GET /workers", a.auth(a.listWorkers))
	mux.HandleFunc("GET /workers/{id}", a.auth(a.getWorker))
	mux.HandleFunc("POST /workers", a.auth(a.createWorker))
	mux.HandleFunc("DELETE /workers/{id}", a.auth(a.deleteWorker))
	mux.HandleFunc("PUT /workers/{id}", a.auth(a.replaceWorker))
	mux.HandleFunc("PATCH /workers/{id}", a.auth(a.patchWorker))
	mux.HandleFunc("GET /v1/models", a.proxyPrefill("/v1/models"))
	mux.HandleFunc("GET /get_server_info", a.proxyPrefill("/get_server_info"))
	mux.HandleFunc("GET /get_model_info", a.proxyPrefill("/get_model_info"))
	mux.HandleFunc("/", a.fallback)
	return mux
}

type server struct{ d Deps }

func (a *server) ok(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	_, _ = io.WriteString(w, "OK")
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func (a *server) readiness(w http.ResponseWriter, _ *http.Request) {
	if a.d.Draining != nil && a.d.Draining() {
		writeJSON(w, 503, map[string]any{"status": "not ready", "reason": "draining"})
		return
	}
	snap := a.d.Registry.Snapshot()
	var hp, hd, healthy int
	for _, wk := range snap {
		if !wk.Healthy() {
			continue
		}
		healthy++
		switch wk.Type {
		case workers.Prefill:
			hp++
		case workers.Decode:
			hd++
		}
	}
	if hp == 0 || hd == 0 {
		writeJSON(w, 503, map[string]any{"status": "not ready", "reason": "insufficient healthy workers"})
		return
	}
	writeJSON(w, 200, map[string]any{"status": "ready", "healthy_workers": healthy, "total_workers": len(snap)})
}

// auth enforces the admin API key when one is configured.
func (a *server) auth(h http.HandlerFunc) http.HandlerFunc {
	if a.d.APIKey == "" {
		return h
	}
	want := []byte("Bearer " + a.d.APIKey)
	return func(w http.ResponseWriter, r *http.Request) {
		got := []byte(r.Header.Get("Authorization"))
		if subtle.ConstantTimeCompare(got, want) != 1 {
			writeJSON(w, 401, map[string]string{"error": "Invalid or missing API key", "code": "UNAUTHORIZED"})
			return
		}
		h(w, r)
	}
}

// WorkerInfo is SMG's per-worker shape (api_key never included).
type WorkerInfo struct {
	ID             string            `json:"id"`
	URL            string            `json:"url"`
	WorkerType     string            `json:"worker_type"`
	ConnectionMode string            `json:"connection_mode"`
	RuntimeType    string            `json:"runtime_type,omitempty"`
	BootstrapPort  *int              `json:"bootstrap_port,omitempty"`
	DPRank         *int              `json:"dp_rank,omitempty"`
	DPSize         *int              `json:"dp_size,omitempty"`
	Labels         map[string]string `json:"labels,omitempty"`
	KVConnector    string            `json:"kv_connector,omitempty"`
	KVRole         string            `json:"kv_role,omitempty"`
	KVEngineID     string            `json:"kv_engine_id,omitempty"`
	PDPairing      string            `json:"pd_pairing,omitempty"`
	IsHealthy      bool              `json:"is_healthy"`
	Status         string            `json:"status"`
	Load           int64             `json:"load"`
	JobStatus      any               `json:"job_status"`
}

func (a *server) info(w *workers.Worker) WorkerInfo {
	wi := WorkerInfo{
		ID: w.ID, URL: w.URL, WorkerType: string(w.Type), ConnectionMode: "http", RuntimeType: w.Runtime,
		BootstrapPort: w.BootstrapPort, DPRank: w.DPRank, DPSize: w.DPSize, Labels: w.Labels,
		KVConnector: w.KVConnector, KVRole: w.KVRole, KVEngineID: w.KVEngineID,
		IsHealthy: w.Healthy(), Status: string(w.Status()), Load: w.Load(),
	}
	if a.d.PairingKey != nil && (w.Type == workers.Prefill || w.Type == workers.Decode) {
		wi.PDPairing = a.d.PairingKey(w)
	}
	return wi
}

func (a *server) listWorkers(w http.ResponseWriter, _ *http.Request) {
	snap := a.d.Registry.Snapshot()
	out := make([]WorkerInfo, 0, len(snap))
	var p, d, r int
	for _, wk := range snap {
		out = append(out, a.info(wk))
		switch wk.Type {
		case workers.Prefill:
			p++
		case workers.Decode:
			d++
		case workers.Regular:
			r++
		}
	}
	writeJSON(w, 200, map[string]any{
		"workers": out, "total": len(snap),
		"stats": map[string]int{"prefill_count": p, "decode_count": d, "regular_count": r},
	})
}

func (a *server) getWorker(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	if !looksLikeUUID(id) {
		writeJSON(w, 400, map[string]string{"error": "Invalid worker ID: " + id, "code": "BAD_REQUEST"})
		return
	}
	wk, ok := a.d.Registry.Get(id)
	if !ok {
		if a.d.Manager != nil {
			if job, ok := a.d.Manager.Pending(id); ok {
				writeJSON(w, 200, map[string]any{"id": id, "url": job.URL, "status": "pending", "is_healthy": false, "load": 0, "job_status": job})
				return
			}
		}
		writeJSON(w, 404, map[string]string{"error": "Worker not found: " + id, "code": "WORKER_NOT_FOUND"})
		return
	}
	writeJSON(w, 200, a.info(wk))
}

func looksLikeUUID(s string) bool {
	if len(s) != 36 {
		return false
	}
	for i, c := range s {
		switch i {
		case 8, 13, 18, 23:
			if c != '-' {
				return false
			}
		default:
			if !strings.ContainsRune("0123456789abcdefABCDEF", c) {
				return false
			}
		}
	}
	return true
}

// proxyPrefill relays a GET to the first healthy prefill (SMG's behaviour).
func (a *server) proxyPrefill(path string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		var target *workers.Worker
		for _, wk := range a.d.Registry.Snapshot() {
			if wk.Type == workers.Prefill && wk.Healthy() {
				target = wk
				break
			}
		}
		if target == nil {
			apierr.New(503, apierr.CodeNoPrefillServers, "No available prefill servers").WriteHTTP(w)
			return
		}
		ctx, cancel := context.WithTimeout(r.Context(), 30*time.Second)
		defer cancel()
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, target.BaseURL+path, nil)
		if err != nil {
			apierr.Wrap(err, 500, "proxy_request_failed", err.Error()).WriteHTTP(w)
			return
		}
		if v := r.Header.Get("Authorization"); v != "" {
			req.Header.Set("Authorization", v)
		} else if target.APIKey != "" {
			req.Header.Set("Authorization", "Bearer "+target.APIKey)
		}
		resp, err := a.d.Client.Do(req)
		if err != nil {
			apierr.Wrap(err, 500, "proxy_request_failed", "Failed to proxy request: "+err.Error()).WriteHTTP(w)
			return
		}
		defer resp.Body.Close()
		if ct := resp.Header.Get("Content-Type"); ct != "" {
			w.Header().Set("Content-Type", ct)
		}
		w.WriteHeader(resp.StatusCode)
		_, _ = io.Copy(w, resp.Body)
	}
}

func (a *server) fallback(w http.ResponseWriter, r *http.Request) {
	path := r.URL.Path
	if _, ok := pd.LookupRoute(path); ok {
		w.Header().Set("Allow", "POST")
		apierr.Newf(405, apierr.CodeMethodNotAllowed, "Method %s not allowed on %s; use POST", r.Method, path).WriteHTTP(w)
		return
	}
	if path == "/workers" || strings.HasPrefix(path, "/workers/") || path == "/liveness" || path == "/readiness" || path == "/health" {
		apierr.Newf(405, apierr.CodeMethodNotAllowed, "Method %s not allowed on %s", r.Method, path).WriteHTTP(w)
		return
	}
	apierr.Newf(404, apierr.CodeNotFound, "No route for %s %s", r.Method, path).WriteHTTP(w)
}
