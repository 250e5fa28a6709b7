package admin

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"

	"github.com/smg-project/smg-extproc/pkg/manager"
	"github.com/smg-project/smg-extproc/pkg/workers"
)

// WorkerSpecJSON is SMG's WorkerSpec as POST /workers accepts it. Fields the
// HTTP PD gateway does not use are accepted and ignored, as SMG does.
type WorkerSpecJSON struct {
	URL            string            `json:"url"`
	WorkerType     string            `json:"worker_type,omitempty"`
	ConnectionMode string            `json:"connection_mode,omitempty"`
	RuntimeType    string            `json:"runtime_type,omitempty"`
	Runtime        string            `json:"runtime,omitempty"`
	Labels         map[string]string `json:"labels,omitempty"`
	APIKey         string            `json:"api_key,omitempty"`
	BootstrapPort  *int              `json:"bootstrap_port,omitempty"`
	DPRank         *int              `json:"dp_rank,omitempty"`
	DPSize         *int              `json:"dp_size,omitempty"`
	KVConnector    string            `json:"kv_connector,omitempty"`
	KVRole         string            `json:"kv_role,omitempty"`
	KVEngineID     string            `json:"kv_engine_id,omitempty"`
	Models         json.RawMessage   `json:"models,omitempty"`
	Priority       *int              `json:"priority,omitempty"`
	Cost           *float64          `json:"cost,omitempty"`
	Health         json.RawMessage   `json:"health,omitempty"`
	Resilience     json.RawMessage   `json:"resilience,omitempty"`
	HTTPPool       json.RawMessage   `json:"http_pool,omitempty"`
	Provider       json.RawMessage   `json:"provider,omitempty"`
	PairingProto   string            `json:"pairing_protocol,omitempty"`
}

// ToSpec converts to the registry's spec, moving v1.9's label forms
// (labels.kv_connector, kv_role, kv_engine_id) into their fields.
func (j WorkerSpecJSON) ToSpec() (workers.Spec, error) {
	t := workers.Type(strings.ToLower(j.WorkerType))
	if t == "" {
		t = workers.Regular
	}
	rt := j.RuntimeType
	if rt == "" {
		rt = j.Runtime
	}
	labels := map[string]string{}
	for k, v := range j.Labels {
		labels[k] = v
	}
	move := func(field *string, key string) {
		if v, ok := labels[key]; ok {
			if *field == "" {
				*field = v
			}
			delete(labels, key)
		}
	}
	kvc, kvr, kve := j.KVConnector, j.KVRole, j.KVEngineID
	move(&kvc, "kv_connector")
	move(&kvr, "kv_role")
	move(&kve, "kv_engine_id")
	if len(labels) == 0 {
		labels = nil
	}
	if j.ConnectionMode != "" && !strings.EqualFold(j.ConnectionMode, "http") {
		return workers.Spec{}, fmt.Errorf("connection_mode %q is not served by this HTTP gateway", j.ConnectionMode)
	}
	return workers.Spec{
		URL: strings.TrimSpace(j.URL), Type: t, BootstrapPort: j.BootstrapPort, Runtime: strings.ToLower(rt),
		Labels: labels, APIKey: j.APIKey, KVConnector: kvc, KVRole: kvr, KVEngineID: kve,
		DPRank: j.DPRank, DPSize: j.DPSize,
	}, nil
}

// SpecOf reconstructs the spec of a registered worker (PATCH merges into it).
func SpecOf(w *workers.Worker) workers.Spec {
	return workers.Spec{URL: w.URL, Type: w.Type, BootstrapPort: w.BootstrapPort, Runtime: w.Runtime,
		Labels: w.Labels, APIKey: w.APIKey, KVConnector: w.KVConnector, KVRole: w.KVRole, KVEngineID: w.KVEngineID,
		DPRank: w.DPRank, DPSize: w.DPSize}
}

func adminError(w http.ResponseWriter, status int, code, msg string) {
	writeJSON(w, status, map[string]string{"error": msg, "code": code})
}

func managerError(w http.ResponseWriter, err error) {
	adminError(w, manager.StatusFor(err), manager.CodeFor(err), manager.Message(err))
}

const maxAdminBody = 1 << 20

func decodeSpec(r *http.Request) (WorkerSpecJSON, error) {
	var j WorkerSpecJSON
	b, err := io.ReadAll(io.LimitReader(r.Body, maxAdminBody+1))
	if err != nil {
		return j, fmt.Errorf("read body: %w", err)
	}
	if len(b) > maxAdminBody {
		return j, fmt.Errorf("body larger than %d bytes", maxAdminBody)
	}
	if err := json.Unmarshal(b, &j); err != nil {
		return j, fmt.Errorf("invalid JSON: %w", err)
	}
	return j, nil
}

func (a *server) createWorker(w http.ResponseWriter, r *http.Request) {
	j, err := decodeSpec(r)
	if err != nil {
		adminError(w, 400, "BAD_REQUEST", err.Error())
		return
	}
	spec, err := j.ToSpec()
	if err != nil {
		adminError(w, 400, "BAD_REQUEST", err.Error())
		return
	}
	id, err := a.d.Manager.Submit(spec)
	if err != nil {
		managerError(w, err)
		return
	}
	loc := "/workers/" + id
	w.Header().Set("Location", loc)
	writeJSON(w, http.StatusAccepted, map[string]string{
		"status": "accepted", "worker_id": id, "url": spec.URL, "location": loc,
		"message": "Worker addition queued for background processing",
	})
}

func (a *server) deleteWorker(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	if !looksLikeUUID(id) {
		adminError(w, 400, "BAD_REQUEST", "Invalid worker ID: "+id)
		return
	}
	if err := a.d.Manager.Remove(id); err != nil {
		managerError(w, err)
		return
	}
	writeJSON(w, http.StatusAccepted, map[string]string{
		"status": "accepted", "worker_id": id, "message": "Worker removal queued for background processing",
	})
}

func (a *server) replaceWorker(w http.ResponseWriter, r *http.Request) {
	a.updateWorker(w, r, false)
}

func (a *server) patchWorker(w http.ResponseWriter, r *http.Request) {
	a.updateWorker(w, r, true)
}

func (a *server) updateWorker(w http.ResponseWriter, r *http.Request, patch bool) {
	id := r.PathValue("id")
	if !looksLikeUUID(id) {
		adminError(w, 400, "BAD_REQUEST", "Invalid worker ID: "+id)
		return
	}
	cur, ok := a.d.Registry.Get(id)
	if !ok {
		adminError(w, 404, "WORKER_NOT_FOUND", "Worker not found: "+id)
		return
	}
	j, err := decodeSpec(r)
	if err != nil {
		adminError(w, 400, "BAD_REQUEST", err.Error())
		return
	}
	var spec workers.Spec
	if patch {
		spec = SpecOf(cur)
		if j.URL != "" && j.URL != cur.URL {
			adminError(w, 400, "BAD_REQUEST", "the URL of a worker cannot be changed; register a new worker")
			return
		}
		p, err := j.patchInto(spec)
		if err != nil {
			adminError(w, 400, "BAD_REQUEST", err.Error())
			return
		}
		spec = p
	} else {
		if j.WorkerType == "" {
			j.WorkerType = string(cur.Type)
		}
		if spec, err = j.ToSpec(); err != nil {
			adminError(w, 400, "BAD_REQUEST", err.Error())
			return
		}
	}
	if err := a.d.Manager.Replace(id, spec); err != nil {
		managerError(w, err)
		return
	}
	writeJSON(w, http.StatusAccepted, map[string]string{
		"status": "accepted", "worker_id": id, "message": "Worker update queued for background processing",
	})
}

// patchInto applies the fields present in j onto spec.
func (j WorkerSpecJSON) patchInto(spec workers.Spec) (workers.Spec, error) {
	if j.WorkerType != "" && !strings.EqualFold(j.WorkerType, string(spec.Type)) {
		return spec, fmt.Errorf("worker_type cannot be changed by PATCH")
	}
	if j.Labels != nil {
		merged := map[string]string{}
		for k, v := range spec.Labels {
			merged[k] = v
		}
		for k, v := range j.Labels {
			merged[k] = v
		}
		spec.Labels = merged
	}
	if j.APIKey != "" {
		spec.APIKey = j.APIKey
	}
	if j.BootstrapPort != nil {
		spec.BootstrapPort = j.BootstrapPort
	}
	if rt := j.RuntimeType + j.Runtime; rt != "" {
		spec.Runtime = strings.ToLower(rt)
	}
	if j.KVConnector != "" {
		spec.KVConnector = j.KVConnector
	}
	if j.KVRole != "" {
		spec.KVRole = j.KVRole
	}
	if j.KVEngineID != "" {
		spec.KVEngineID = j.KVEngineID
	}
	if j.DPSize != nil {
		spec.DPSize = j.DPSize
	}
	return spec, nil
}
