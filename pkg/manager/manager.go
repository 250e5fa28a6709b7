// Package manager runs the worker lifecycle: registration jobs (validate,
// detect the runtime, add), health loops, draining removal, and updates. The
// worker API, the command line and the config file all go through it, so a
// worker behaves the same whichever way it arrived.
package manager

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/rs/zerolog"

	"github.com/smg-project/smg-extproc/pkg/workers"
)

// Error kinds the API maps to SMG's admin codes.
var (
	ErrBadRequest = errors.New("BAD_REQUEST")
	ErrExists     = errors.New("WORKER_ALREADY_EXISTS")
	ErrNotFound   = errors.New("WORKER_NOT_FOUND")
)

// Job is one asynchronous registration, update or removal.
type Job struct {
	ID        string    `json:"-"`
	Type      string    `json:"job_type"`
	URL       string    `json:"worker_url"`
	Status    string    `json:"status"`
	Message   string    `json:"message,omitempty"`
	Timestamp time.Time `json:"timestamp"`
}

// Hooks let the owner attach per-worker machinery (health loop, breaker,
// metrics) without this package knowing their types.
type Hooks struct {
	// Detect returns the runtime of a worker registered without one.
	Detect func(ctx context.Context, baseURL, apiKey string) (string, error)
	// Attach starts per-worker machinery; the returned stop func is called on removal.
	Attach func(w *workers.Worker) (stop func())
}

// Manager owns registration.
type Manager struct {
	reg   *workers.Registry
	log   zerolog.Logger
	hooks Hooks
	// Resolve is the resolver used for worker URLs (tests inject one).
	Resolve workers.Resolver
	// DrainTimeout bounds how long a removal waits for in-flight requests.
	DrainTimeout time.Duration

	mu    sync.Mutex
	jobs  map[string]*Job // pending registrations by worker id
	stops map[*workers.Worker]func()
	byURL map[string]string       // pending registration URL -> id
	owned map[string]workers.Spec // workers the config file manages, by URL
	wg    sync.WaitGroup
	ctx   context.Context
}

// New returns a manager; ctx bounds every background job.
func New(ctx context.Context, reg *workers.Registry, log zerolog.Logger, hooks Hooks) *Manager {
	return &Manager{reg: reg, log: log, hooks: hooks, ctx: ctx, DrainTimeout: 5 * time.Minute,
		jobs: map[string]*Job{}, stops: map[*workers.Worker]func(){}, byURL: map[string]string{}}
}

// endpointKey identifies a pending registration by the endpoint it names.
func endpointKey(w *workers.Worker) string {
	if w.DPRank != nil {
		return fmt.Sprintf("%s@%d", w.BaseURL, *w.DPRank)
	}
	return w.BaseURL
}

// Validate checks a spec without registering it.
func Validate(spec workers.Spec) error {
	switch spec.Type {
	case workers.Prefill, workers.Decode, workers.Regular:
	case "encode":
		return fmt.Errorf("%w: encode workers need gRPC EPD, which this gateway does not serve", ErrBadRequest)
	default:
		return fmt.Errorf("%w: worker_type must be prefill, decode or regular, got %q", ErrBadRequest, spec.Type)
	}
	u := strings.TrimSpace(spec.URL)
	if u == "" {
		return fmt.Errorf("%w: url is required", ErrBadRequest)
	}
	if strings.HasPrefix(u, "grpc://") {
		return fmt.Errorf("%w: grpc:// workers are served by SMG's gRPC pipeline, not this HTTP gateway", ErrBadRequest)
	}
	if spec.BootstrapPort != nil && (*spec.BootstrapPort < 1 || *spec.BootstrapPort > 65535) {
		return fmt.Errorf("%w: bootstrap_port %d out of range", ErrBadRequest, *spec.BootstrapPort)
	}
	return nil
}

// Submit queues a registration and returns the new worker id (202 semantics).
func (m *Manager) Submit(spec workers.Spec) (string, error) {
	if err := Validate(spec); err != nil {
		return "", err
	}
	// Build now so a bad URL is a 400, not a failed job.
	w, err := workers.New(spec, m.Resolve)
	if err != nil {
		return "", fmt.Errorf("%w: %v", ErrBadRequest, err)
	}
	m.mu.Lock()
	if x, ok := m.reg.FindURL(w.URL); ok {
		m.mu.Unlock()
		return "", fmt.Errorf("%w: Worker already exists at URL '%s' with ID %s. Use PUT /workers/%s to replace or PATCH /workers/%s to update.",
			ErrExists, x.URL, x.ID, x.ID, x.ID)
	}
	if id, ok := m.byURL[endpointKey(w)]; ok {
		m.mu.Unlock()
		return "", fmt.Errorf("%w: Worker already exists at URL '%s' with ID %s (registration pending).", ErrExists, w.URL, id)
	}
	job := &Job{ID: w.ID, Type: "AddWorker", URL: w.URL, Status: "pending", Timestamp: time.Now()}
	m.jobs[w.ID] = job
	m.byURL[endpointKey(w)] = w.ID
	m.wg.Add(1)
	m.mu.Unlock()
	go func() {
		defer m.wg.Done()
		m.register(w, spec.Runtime == "", job)
	}()
	return w.ID, nil
}

func (m *Manager) register(w *workers.Worker, detect bool, job *Job) {
	if detect && m.hooks.Detect != nil {
		ctx, cancel := context.WithTimeout(m.ctx, 15*time.Second)
		rt, err := m.hooks.Detect(ctx, w.BaseURL, w.APIKey)
		cancel()
		if err != nil {
			m.log.Warn().Err(err).Str("url", w.URL).Msg("runtime detection failed; assuming sglang")
		}
		if rt != "" {
			w.Runtime = rt
		}
	}
	w.SetStatus(workers.StatusPending)
	m.mu.Lock()
	delete(m.jobs, w.ID)
	delete(m.byURL, endpointKey(w))
	if err := m.reg.Add(w); err != nil {
		m.mu.Unlock()
		job.Status, job.Message = "failed", err.Error()
		m.log.Warn().Err(err).Str("url", w.URL).Msg("worker registration failed")
		return
	}
	m.mu.Unlock()
	m.attach(w)
	m.log.Info().Str("id", w.ID).Str("url", w.URL).Str("type", string(w.Type)).Str("runtime", w.Runtime).Msg("worker registered")
}

func (m *Manager) attach(w *workers.Worker) {
	if m.hooks.Attach == nil {
		w.SetStatus(workers.StatusReady)
		m.reg.Changed()
		return
	}
	stop := m.hooks.Attach(w)
	m.mu.Lock()
	m.stops[w] = stop
	m.mu.Unlock()
}

// AddNow registers a worker synchronously (startup workers): no job, same hooks.
func (m *Manager) AddNow(spec workers.Spec) (*workers.Worker, error) {
	if err := Validate(spec); err != nil {
		return nil, err
	}
	w, err := workers.New(spec, m.Resolve)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrBadRequest, err)
	}
	if spec.Runtime == "" && m.hooks.Detect != nil {
		ctx, cancel := context.WithTimeout(m.ctx, 5*time.Second)
		if rt, _ := m.hooks.Detect(ctx, w.BaseURL, w.APIKey); rt != "" {
			w.Runtime = rt
		}
		cancel()
	}
	w.SetStatus(workers.StatusPending)
	if err := m.reg.Add(w); err != nil {
		var ee *workers.ErrExists
		if errors.As(err, &ee) {
			return nil, fmt.Errorf("%w: %v", ErrExists, err)
		}
		return nil, err
	}
	m.attach(w)
	return w, nil
}

// Pending returns the job of a registration still in progress.
func (m *Manager) Pending(id string) (Job, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	j, ok := m.jobs[id]
	if !ok {
		return Job{}, false
	}
	return *j, true
}

// Remove drains and unregisters a worker in the background.
func (m *Manager) Remove(id string) error {
	w, ok := m.reg.Get(id)
	if !ok {
		return fmt.Errorf("%w: Worker not found: %s", ErrNotFound, id)
	}
	w.SetDraining()
	m.reg.Changed() // republish: Envoy stops picking it while streams finish
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		m.drainAndRemove(w)
	}()
	return nil
}

// RemoveNow drains and unregisters synchronously (config reload).
func (m *Manager) RemoveNow(w *workers.Worker) {
	w.SetDraining()
	m.reg.Changed()
	m.drainAndRemove(w)
}

func (m *Manager) drainAndRemove(w *workers.Worker) {
	deadline := time.Now().Add(m.DrainTimeout)
	for w.Load() > 0 && time.Now().Before(deadline) {
		select {
		case <-m.ctx.Done():
			return
		case <-time.After(50 * time.Millisecond):
		}
	}
	if n := w.Load(); n > 0 {
		m.log.Warn().Str("url", w.URL).Int64("in_flight", n).Msg("drain timed out; removing worker with requests in flight")
	}
	m.reg.Remove(w.ID)
	m.mu.Lock()
	stop := m.stops[w]
	delete(m.stops, w)
	m.mu.Unlock()
	if stop != nil {
		stop()
	}
	m.log.Info().Str("id", w.ID).Str("url", w.URL).Msg("worker removed")
}

// Replace swaps a worker for one built from spec, keeping its id (PUT/PATCH).
func (m *Manager) Replace(id string, spec workers.Spec) error {
	old, ok := m.reg.Get(id)
	if !ok {
		return fmt.Errorf("%w: Worker not found: %s", ErrNotFound, id)
	}
	if old.Draining() {
		// Its removal is under way; an update would resurrect it half-removed.
		return fmt.Errorf("%w: Worker %s is being removed", ErrBadRequest, id)
	}
	if err := Validate(spec); err != nil {
		return err
	}
	if spec.URL != old.URL {
		return fmt.Errorf("%w: URL in the body (%s) does not match the worker's URL (%s)", ErrBadRequest, spec.URL, old.URL)
	}
	nw, err := workers.New(spec, m.Resolve)
	if err != nil {
		return fmt.Errorf("%w: %v", ErrBadRequest, err)
	}
	nw.ID = old.ID
	if nw.Runtime == "" || spec.Runtime == "" {
		nw.Runtime = old.Runtime
	}
	nw.SetStatus(old.Status())
	m.mu.Lock()
	stop := m.stops[old]
	delete(m.stops, old)
	m.mu.Unlock()
	if !m.reg.Replace(old, nw) {
		return fmt.Errorf("%w: Worker not found: %s", ErrNotFound, id)
	}
	if stop != nil {
		stop()
	}
	m.attach(nw)
	// In-flight requests keep their reference to the old record and release its load.
	return nil
}

// Wait blocks until background jobs finish (shutdown, tests).
func (m *Manager) Wait() { m.wg.Wait() }

// StatusFor maps a manager error to its HTTP status.
func StatusFor(err error) int {
	switch {
	case errors.Is(err, ErrBadRequest):
		return http.StatusBadRequest
	case errors.Is(err, ErrExists):
		return http.StatusConflict
	case errors.Is(err, ErrNotFound):
		return http.StatusNotFound
	}
	return http.StatusInternalServerError
}

// CodeFor maps a manager error to SMG's admin code.
func CodeFor(err error) string {
	for _, e := range []error{ErrBadRequest, ErrExists, ErrNotFound} {
		if errors.Is(err, e) {
			return e.Error()
		}
	}
	return "INTERNAL_ERROR"
}

// Message strips the kind prefix for the response body.
func Message(err error) string {
	s := err.Error()
	for _, e := range []error{ErrBadRequest, ErrExists, ErrNotFound} {
		s = strings.TrimPrefix(s, e.Error()+": ")
	}
	return s
}
