package fleet

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"
)

// HealthStatus is a worker's health status. The values are SMG's status
// strings, so a caller can convert to its own status type directly.
type HealthStatus string

const (
	HealthPending  HealthStatus = "pending"
	HealthReady    HealthStatus = "ready"
	HealthNotReady HealthStatus = "not_ready"
)

// HealthConfig is SMG's background health-check configuration.
type HealthConfig struct {
	Interval         time.Duration
	Timeout          time.Duration // per probe
	FailureThreshold int           // consecutive failures: Ready → NotReady
	SuccessThreshold int           // consecutive successes: Pending/NotReady → Ready
	Endpoint         string
	// Disabled mirrors --disable-health-check: workers start Ready.
	Disabled bool
}

// DefaultHealthConfig is SMG's CLI default.
func DefaultHealthConfig() HealthConfig {
	return HealthConfig{
		Interval:         60 * time.Second,
		Timeout:          5 * time.Second,
		FailureThreshold: 3,
		SuccessThreshold: 2,
		Endpoint:         "/health",
	}
}

func (c HealthConfig) normalized() HealthConfig {
	d := DefaultHealthConfig()
	if c.Interval <= 0 {
		c.Interval = d.Interval
	}
	if c.Timeout <= 0 {
		c.Timeout = d.Timeout
	}
	c.FailureThreshold = max(c.FailureThreshold, 1)
	c.SuccessThreshold = max(c.SuccessThreshold, 1)
	if c.Endpoint == "" {
		c.Endpoint = d.Endpoint
	}
	if !strings.HasPrefix(c.Endpoint, "/") {
		c.Endpoint = "/" + c.Endpoint
	}
	return c
}

// Target is what the prober needs to know about one worker.
type Target struct {
	ID      string
	BaseURL string // scheme://host:port, without any "@rank" suffix
	APIKey  string // sent as a bearer token when set
}

// Transition is one status change reported by Prober.Run.
type Transition struct {
	ID       string
	From, To HealthStatus
	At       time.Time
	// Err is the last probe's error when the transition is to NotReady.
	Err error
}

// Healthy reports whether the new status is routable.
func (t Transition) Healthy() bool { return t.To == HealthReady }

// HealthTracker is the probe-result state machine on its own, for callers
// that probe by other means. It is owned by one goroutine (not thread-safe).
type HealthTracker struct {
	cfg       HealthConfig
	status    HealthStatus
	successes int
	failures  int
}

// NewHealthTracker starts in Pending.
func NewHealthTracker(cfg HealthConfig) *HealthTracker {
	return &HealthTracker{cfg: cfg.normalized(), status: HealthPending}
}

// Status is the current status.
func (h *HealthTracker) Status() HealthStatus { return h.status }

// Observe applies one probe result and reports a status change, if any.
// Pending stays Pending through failures: a worker that never passed its
// success threshold was never routable, so there is nothing to take away.
func (h *HealthTracker) Observe(healthy bool) (from, to HealthStatus, changed bool) {
	from = h.status
	if healthy {
		h.failures = 0
		h.successes++
		if h.status != HealthReady && h.successes >= h.cfg.SuccessThreshold {
			h.status = HealthReady
		}
	} else {
		h.successes = 0
		h.failures++
		if h.status == HealthReady && h.failures >= h.cfg.FailureThreshold {
			h.status = HealthNotReady
		}
	}
	return from, h.status, from != h.status
}

// Ticker is the part of *time.Ticker the prober uses; injectable so tests
// can drive probes by hand.
type Ticker interface {
	C() <-chan time.Time
	Stop()
}

type realTicker struct{ t *time.Ticker }

func (r realTicker) C() <-chan time.Time { return r.t.C }
func (r realTicker) Stop()               { r.t.Stop() }

// NewRealTicker wraps time.NewTicker.
func NewRealTicker(d time.Duration) Ticker { return realTicker{time.NewTicker(d)} }

// Prober runs health checks. Its fields are read-only once it is in use, so
// one Prober serves every worker.
type Prober struct {
	// Client sends the probes; nil means a client on http.DefaultTransport.
	// Per-probe deadlines come from HealthConfig.Timeout, not Client.Timeout.
	Client *http.Client
	// NewTicker paces probes; nil means NewRealTicker.
	NewTicker func(d time.Duration) Ticker
	// Now stamps transitions; nil means time.Now.
	Now func() time.Time
}

// NewProber returns a prober using client and real time.
func NewProber(client *http.Client) *Prober {
	return &Prober{Client: client, NewTicker: NewRealTicker, Now: time.Now}
}

func (p *Prober) client() *http.Client {
	if p.Client != nil {
		return p.Client
	}
	return &http.Client{}
}

func (p *Prober) now() time.Time {
	if p.Now != nil {
		return p.Now()
	}
	return time.Now()
}

// Run health-checks target until ctx ends: one probe at once, then one per
// Interval. It calls report (from this goroutine) only when the status
// changes, so the first call is the Pending → Ready that makes the worker
// routable. With cfg.Disabled it reports Ready once and returns.
func (p *Prober) Run(ctx context.Context, target Target, cfg HealthConfig, report func(Transition)) {
	cfg = cfg.normalized()
	if report == nil {
		report = func(Transition) {}
	}
	if cfg.Disabled {
		report(Transition{ID: target.ID, From: HealthPending, To: HealthReady, At: p.now()})
		return
	}
	newTicker := p.NewTicker
	if newTicker == nil {
		newTicker = NewRealTicker
	}
	tk := newTicker(cfg.Interval)
	defer tk.Stop()

	tracker := NewHealthTracker(cfg)
	for {
		err := p.Probe(ctx, target, cfg)
		if ctx.Err() != nil {
			// A probe cut short by shutdown says nothing about the worker.
			return
		}
		if from, to, changed := tracker.Observe(err == nil); changed {
			tr := Transition{ID: target.ID, From: from, To: to, At: p.now()}
			if to != HealthReady {
				tr.Err = err
			}
			report(tr)
		}
		select {
		case <-ctx.Done():
			return
		case <-tk.C():
		}
	}
}

// maxProbeBody bounds how much of a probe response is read: enough to let
// the connection be reused, not enough for a misbehaving worker to hurt us.
const maxProbeBody = 64 << 10

// Probe performs one health check: GET BaseURL+Endpoint with the worker's
// bearer token, bounded by cfg.Timeout. Any 2xx is healthy (nil error).
func (p *Prober) Probe(ctx context.Context, target Target, cfg HealthConfig) error {
	cfg = cfg.normalized()
	ctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	defer cancel()
	url := strings.TrimRight(target.BaseURL, "/") + cfg.Endpoint
	status, _, err := getBody(ctx, p.client(), url, target.APIKey, 0)
	if err != nil {
		return fmt.Errorf("health probe %s: %w", url, err)
	}
	if status < 200 || status > 299 {
		return fmt.Errorf("health probe %s: status %d", url, status)
	}
	return nil
}

// getBody issues a GET with an optional bearer token and returns the status
// and up to keep bytes of the body; the rest (up to maxProbeBody) is drained
// so the connection can be reused.
func getBody(ctx context.Context, client *http.Client, url, apiKey string, keep int64) (int, []byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, nil, fmt.Errorf("build request: %w", err)
	}
	if apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+apiKey)
	}
	resp, err := client.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	var body []byte
	if keep > 0 {
		body, err = io.ReadAll(io.LimitReader(resp.Body, keep))
		if err != nil {
			return resp.StatusCode, nil, fmt.Errorf("read body: %w", err)
		}
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, maxProbeBody))
	return resp.StatusCode, body, nil
}
