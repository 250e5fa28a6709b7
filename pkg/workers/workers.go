// Package workers owns the registry of prefill and decode workers: identity,
// addresses derived from the registered URL, and change notification for the
// xDS publisher. Health, breakers and load live beside the worker record so
// that selection reads one consistent snapshot.
package workers

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/smg-project/smg-extproc/pkg/pd"
)

// Type is a worker's role.
type Type string

const (
	Prefill Type = "prefill"
	Decode  Type = "decode"
	Regular Type = "regular"
)

// Status is SMG's worker status vocabulary.
type Status string

const (
	StatusPending  Status = "pending"
	StatusReady    Status = "ready"
	StatusNotReady Status = "not_ready"
	StatusFailed   Status = "failed"
)

// Spec is what registration supplies (CLI, config file or POST /workers).
type Spec struct {
	URL           string
	Type          Type
	BootstrapPort *int
	Runtime       string // "" = detect
	Labels        map[string]string
	APIKey        string
	KVConnector   string
	KVRole        string
	KVEngineID    string
	DPRank        *int // overrides an "@rank" URL suffix when set
	DPSize        *int
}

// Worker is one registered engine endpoint. Immutable fields are set at
// construction; mutable state is behind atomics so the request path never
// takes the registry lock.
type Worker struct {
	ID            string
	URL           string // as registered, including an "@rank" suffix
	BaseURL       string // URL without "@rank": what legs are sent to
	Type          Type
	DPRank        *int
	BootstrapHost string
	BootstrapPort *int
	Runtime       string
	Labels        map[string]string
	APIKey        string
	KVConnector   string
	KVRole        string
	KVEngineID    string
	DPSize        *int
	// Addr is the "ip:port" Envoy knows this worker by (EDS endpoint address).
	Addr string

	status   atomic.Int32 // index into statuses
	draining atomic.Bool
	load     atomic.Int64
	// Allow, when set, is the circuit breaker's admission check.
	Allow func() bool
	// Outcome, when set, feeds one leg's result to the circuit breaker.
	Outcome func(status int, transportErr bool)
}

// Record reports one leg's outcome (a no-op without a breaker).
func (w *Worker) Record(status int, transportErr bool) {
	if w.Outcome != nil {
		w.Outcome(status, transportErr)
	}
}

var statuses = [...]Status{StatusPending, StatusReady, StatusNotReady, StatusFailed}

// Healthy reports whether the worker passes health checks (status ready).
func (w *Worker) Healthy() bool { return w.status.Load() == 1 }

// Available reports whether the worker may be selected now: ready, not
// draining, and admitted by its circuit breaker.
func (w *Worker) Available() bool {
	return w.status.Load() == 1 && !w.draining.Load() && (w.Allow == nil || w.Allow())
}

// SetHealthy flips between ready and not_ready.
func (w *Worker) SetHealthy(v bool) {
	if v {
		w.SetStatus(StatusReady)
	} else {
		w.SetStatus(StatusNotReady)
	}
}

// SetStatus sets the health status.
func (w *Worker) SetStatus(s Status) {
	for i, x := range statuses {
		if x == s {
			w.status.Store(int32(i))
			return
		}
	}
}

// SetDraining takes the worker out of selection ahead of its removal.
func (w *Worker) SetDraining() { w.draining.Store(true) }

// Draining reports whether the worker is being removed.
func (w *Worker) Draining() bool { return w.draining.Load() }

// Load is the gateway's in-flight count for this worker.
func (w *Worker) Load() int64 { return w.load.Load() }

// Acquire counts one in-flight request; the returned func releases it once.
func (w *Worker) Acquire() func() {
	w.load.Add(1)
	var once sync.Once
	return func() { once.Do(func() { w.load.Add(-1) }) }
}

// Status is the SMG status string.
func (w *Worker) Status() Status { return statuses[w.status.Load()] }

// Resolver turns a host name into addresses; injected so tests need no DNS.
type Resolver func(host string) ([]string, error)

// DefaultResolver uses the system resolver and prefers IPv4.
func DefaultResolver(host string) ([]string, error) {
	if ip := net.ParseIP(strings.Trim(host, "[]")); ip != nil {
		return []string{ip.String()}, nil
	}
	addrs, err := net.LookupHost(host)
	if err != nil {
		return nil, fmt.Errorf("resolve %q: %w", host, err)
	}
	return addrs, nil
}

// New builds a worker from a spec, validating the URL.
func New(spec Spec, resolve Resolver) (*Worker, error) {
	if resolve == nil {
		resolve = DefaultResolver
	}
	raw := strings.TrimSpace(spec.URL)
	if raw == "" {
		return nil, fmt.Errorf("worker url is empty")
	}
	base, rank, err := splitRank(raw)
	if err != nil {
		return nil, err
	}
	if !strings.Contains(base, "://") {
		base = "http://" + base
	}
	u, err := url.Parse(base)
	if err != nil {
		return nil, fmt.Errorf("invalid worker url %q: %w", raw, err)
	}
	switch u.Scheme {
	case "http", "https":
	case "ipc":
		if spec.Type == Prefill || spec.Type == Decode {
			return nil, fmt.Errorf("ipc:// workers cannot be PD legs: the ZMQ wire carries no KV-transfer metadata")
		}
		return nil, fmt.Errorf("ipc:// workers are not supported by the HTTP PD gateway")
	default:
		return nil, fmt.Errorf("invalid worker url %q: unsupported scheme %q", raw, u.Scheme)
	}
	if u.Hostname() == "" {
		return nil, fmt.Errorf("invalid worker url %q: no host", raw)
	}
	if u.Path != "" && u.Path != "/" || u.RawQuery != "" || u.Fragment != "" {
		return nil, fmt.Errorf("invalid worker url %q: must be scheme://host:port", raw)
	}
	port := u.Port()
	if port == "" {
		port = "80"
		if u.Scheme == "https" {
			port = "443"
		}
	}
	if p, err := strconv.Atoi(port); err != nil || p < 1 || p > 65535 {
		return nil, fmt.Errorf("invalid worker url %q: bad port", raw)
	}
	ips, err := resolve(u.Hostname())
	if err != nil {
		return nil, fmt.Errorf("invalid worker url %q: %w", raw, err)
	}
	if len(ips) == 0 {
		return nil, fmt.Errorf("invalid worker url %q: %s resolves to no address", raw, u.Hostname())
	}
	ip := pickIP(ips)
	// SMG's bootstrap-host rule (IPv6 keeps its brackets, "@rank" stripped).
	_, _, host := pd.SplitWorkerURL(raw)
	w := &Worker{
		ID:            NewID(),
		URL:           raw,
		BaseURL:       u.Scheme + "://" + u.Host,
		Type:          spec.Type,
		DPRank:        rank,
		BootstrapHost: host,
		BootstrapPort: spec.BootstrapPort,
		Runtime:       spec.Runtime,
		Labels:        spec.Labels,
		APIKey:        spec.APIKey,
		KVConnector:   spec.KVConnector,
		KVRole:        spec.KVRole,
		KVEngineID:    spec.KVEngineID,
		DPSize:        spec.DPSize,
		Addr:          net.JoinHostPort(ip, port),
	}
	if spec.DPRank != nil {
		w.DPRank = spec.DPRank
	}
	if w.Runtime == "" {
		w.Runtime = "sglang"
	}
	return w, nil
}

func pickIP(ips []string) string {
	for _, ip := range ips {
		if p := net.ParseIP(ip); p != nil && p.To4() != nil {
			return ip
		}
	}
	return ips[0]
}

// splitRank strips an "@<digits>" DP-rank suffix.
func splitRank(raw string) (string, *int, error) {
	i := strings.LastIndexByte(raw, '@')
	if i < 0 {
		return raw, nil, nil
	}
	suffix := raw[i+1:]
	n, err := strconv.Atoi(suffix)
	if err != nil || n < 0 || strings.ContainsAny(suffix, "+-") {
		// "user@host" style URLs are not worker URLs we accept.
		return "", nil, fmt.Errorf("invalid worker url %q: bad DP rank suffix %q", raw, suffix)
	}
	return raw[:i], &n, nil
}

// NewID returns a UUIDv7 string: time-ordered, so /workers lists stay stable.
func NewID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	ms := uint64(time.Now().UnixMilli())
	b[0] = byte(ms >> 40)
	b[1] = byte(ms >> 32)
	b[2] = byte(ms >> 24)
	b[3] = byte(ms >> 16)
	b[4] = byte(ms >> 8)
	b[5] = byte(ms)
	b[6] = (b[6] & 0x0f) | 0x70
	b[8] = (b[8] & 0x3f) | 0x80
	h := hex.EncodeToString(b[:])
	return h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:32]
}

// Registry holds the current worker set. Readers get immutable snapshots.
type Registry struct {
	mu      sync.Mutex
	workers []*Worker
	snap    atomic.Pointer[[]*Worker]
	subs    []chan struct{}
}

// NewRegistry returns an empty registry.
func NewRegistry() *Registry {
	r := &Registry{}
	empty := []*Worker{}
	r.snap.Store(&empty)
	return r
}

// Snapshot is the current list in registration order; do not modify it.
func (r *Registry) Snapshot() []*Worker { return *r.snap.Load() }

// ByType filters a snapshot.
func ByType(ws []*Worker, t Type) []*Worker {
	out := make([]*Worker, 0, len(ws))
	for _, w := range ws {
		if w.Type == t {
			out = append(out, w)
		}
	}
	return out
}

// Get returns a worker by id.
func (r *Registry) Get(id string) (*Worker, bool) {
	for _, w := range r.Snapshot() {
		if w.ID == id {
			return w, true
		}
	}
	return nil, false
}

// Same reports whether two workers name the same engine endpoint: spellings
// such as "h:1", "http://h:1" and "http://h:1/" are one worker.
func (w *Worker) Same(o *Worker) bool {
	return w.BaseURL != "" && w.BaseURL == o.BaseURL && sameRank(w.DPRank, o.DPRank)
}

func sameRank(a, b *int) bool {
	if a == nil || b == nil {
		return a == b
	}
	return *a == *b
}

// FindURL returns the worker registered at url, matching it as registered
// or by the endpoint it names.
func (r *Registry) FindURL(u string) (*Worker, bool) {
	base, rank, _ := splitRank(strings.TrimSpace(u))
	if base != "" && !strings.Contains(base, "://") {
		base = "http://" + base
	}
	base = strings.TrimSuffix(base, "/")
	for _, w := range r.Snapshot() {
		if w.URL == u || (w.BaseURL != "" && w.BaseURL == base && sameRank(w.DPRank, rank)) {
			return w, true
		}
	}
	return nil, false
}

// ErrExists is returned when a URL is already registered.
type ErrExists struct{ Existing *Worker }

func (e *ErrExists) Error() string {
	return fmt.Sprintf("Worker already exists at URL '%s' with ID %s", e.Existing.URL, e.Existing.ID)
}

// Add registers w; URLs are unique.
func (r *Registry) Add(w *Worker) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, x := range r.workers {
		if x.URL == w.URL || x.Same(w) {
			return &ErrExists{Existing: x}
		}
	}
	r.workers = append(r.workers, w)
	r.publishLocked()
	return nil
}

// Remove unregisters id; it reports whether it existed.
func (r *Registry) Remove(id string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for i, x := range r.workers {
		if x.ID == id {
			r.workers = append(r.workers[:i:i], r.workers[i+1:]...)
			r.publishLocked()
			return true
		}
	}
	return false
}

// Replace swaps old for nw in place (PUT/PATCH), keeping the position.
func (r *Registry) Replace(old, nw *Worker) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for i, x := range r.workers {
		if x == old {
			r.workers[i] = nw
			r.publishLocked()
			return true
		}
	}
	return false
}

// Changed signals subscribers after a health change made outside Add/Remove.
func (r *Registry) Changed() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.publishLocked()
}

func (r *Registry) publishLocked() {
	s := append([]*Worker(nil), r.workers...)
	r.snap.Store(&s)
	for _, c := range r.subs {
		select {
		case c <- struct{}{}:
		default: // a pending signal already covers this change
		}
	}
}

// Subscribe returns a channel signalled (coalesced) on every change.
func (r *Registry) Subscribe() <-chan struct{} {
	r.mu.Lock()
	defer r.mu.Unlock()
	c := make(chan struct{}, 1)
	r.subs = append(r.subs, c)
	return c
}
