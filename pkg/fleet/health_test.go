package fleet

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestDefaultHealthConfig(t *testing.T) {
	assert.Equal(t, HealthConfig{Interval: 60 * time.Second, Timeout: 5 * time.Second, FailureThreshold: 3, SuccessThreshold: 2, Endpoint: "/health"},
		DefaultHealthConfig())
}

func TestHealthTracker(t *testing.T) {
	type change struct {
		at       int // 1-based observation index
		from, to HealthStatus
	}
	tests := []struct {
		name    string
		results []bool
		want    []change
	}{
		{"pending to ready after two", []bool{true, true, true}, []change{{2, HealthPending, HealthReady}}},
		{"failures keep pending", []bool{false, false, false, false, true, true}, []change{{6, HealthPending, HealthReady}}},
		{"interrupted successes restart", []bool{true, false, true, true}, []change{{4, HealthPending, HealthReady}}},
		{"ready to not ready after three and recovery after two",
			[]bool{true, true, false, false, false, false, true, true},
			[]change{{2, HealthPending, HealthReady}, {5, HealthReady, HealthNotReady}, {8, HealthNotReady, HealthReady}}},
		{"interrupted failures stay ready",
			[]bool{true, true, false, false, true, false, false},
			[]change{{2, HealthPending, HealthReady}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := NewHealthTracker(DefaultHealthConfig())
			var got []change
			for i, ok := range tt.results {
				if from, to, changed := h.Observe(ok); changed {
					got = append(got, change{i + 1, from, to})
				}
			}
			assert.Equal(t, tt.want, got)
		})
	}
}

// scriptedServer answers probe n with script[n-1] (the last entry repeats)
// and counts hits.
type scriptedServer struct {
	*httptest.Server
	hits   atomic.Int64
	script []int
	mu     sync.Mutex
	auth   []string
	paths  []string
}

func newScriptedServer(t *testing.T, script ...int) *scriptedServer {
	s := &scriptedServer{script: script}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.mu.Lock()
		s.auth = append(s.auth, r.Header.Get("Authorization"))
		s.paths = append(s.paths, r.URL.Path)
		s.mu.Unlock()
		n := int(s.hits.Add(1))
		w.WriteHeader(s.script[min(n, len(s.script))-1])
	}))
	t.Cleanup(s.Close)
	return s
}

func fastHealth() HealthConfig {
	return HealthConfig{Interval: 10 * time.Millisecond, Timeout: time.Second, FailureThreshold: 3, SuccessThreshold: 2, Endpoint: "/health"}
}

func TestProberRunTransitions(t *testing.T) {
	type seen struct {
		hit      int64
		from, to HealthStatus
	}
	tests := []struct {
		name   string
		script []int
		want   []seen
	}{
		{"pending to ready after two successes", []int{200, 200},
			[]seen{{2, HealthPending, HealthReady}}},
		{"ready to not ready after three failures, then recovery", []int{200, 200, 500, 503, 500, 200, 204},
			[]seen{{2, HealthPending, HealthReady}, {5, HealthReady, HealthNotReady}, {7, HealthNotReady, HealthReady}}},
		{"failing worker stays pending until it passes", []int{500, 404, 500, 500, 200, 200},
			[]seen{{6, HealthPending, HealthReady}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv := newScriptedServer(t, tt.script...)
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			got := make(chan seen, 16)
			done := make(chan struct{})
			go func() {
				defer close(done)
				NewProber(srv.Client()).Run(ctx, Target{ID: "w1", BaseURL: srv.URL + "/"}, fastHealth(), func(tr Transition) {
					assert.Equal(t, "w1", tr.ID)
					assert.Equal(t, tr.To == HealthReady, tr.Healthy())
					if tr.To == HealthNotReady {
						assert.Error(t, tr.Err)
					}
					// Reports run between probes, so the hit count is exact.
					got <- seen{srv.hits.Load(), tr.From, tr.To}
				})
			}()
			var all []seen
			for len(all) < len(tt.want) {
				select {
				case s := <-got:
					all = append(all, s)
				case <-time.After(3 * time.Second):
					t.Fatalf("timed out; got %v", all)
				}
			}
			// A few more probes on the script's last status change nothing.
			hits := srv.hits.Load()
			require.Eventually(t, func() bool { return srv.hits.Load() >= hits+3 }, 3*time.Second, 5*time.Millisecond)
			cancel()
			<-done
			close(got)
			for s := range got {
				all = append(all, s)
			}
			assert.Equal(t, tt.want, all)
		})
	}
}

func TestProberProbeRequest(t *testing.T) {
	tests := []struct {
		name     string
		apiKey   string
		endpoint string
		wantAuth string
		wantPath string
	}{
		{"bearer token when a key is set", "secret", "", "Bearer secret", "/health"},
		{"no header without a key", "", "/health", "", "/health"},
		{"custom endpoint", "", "/ready", "", "/ready"},
		{"endpoint without a slash", "", "healthz", "", "/healthz"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv := newScriptedServer(t, 200)
			cfg := fastHealth()
			cfg.Endpoint = tt.endpoint
			err := NewProber(srv.Client()).Probe(t.Context(), Target{BaseURL: srv.URL, APIKey: tt.apiKey}, cfg)
			require.NoError(t, err)
			assert.Equal(t, []string{tt.wantAuth}, srv.auth)
			assert.Equal(t, []string{tt.wantPath}, srv.paths)
		})
	}
}

func TestProberProbeFailures(t *testing.T) {
	t.Run("non-2xx", func(t *testing.T) {
		srv := newScriptedServer(t, 503)
		err := NewProber(srv.Client()).Probe(t.Context(), Target{BaseURL: srv.URL}, fastHealth())
		assert.ErrorContains(t, err, "status 503")
	})
	t.Run("unreachable", func(t *testing.T) {
		srv := newScriptedServer(t, 200)
		srv.Close()
		err := NewProber(srv.Client()).Probe(t.Context(), Target{BaseURL: srv.URL}, fastHealth())
		assert.ErrorContains(t, err, "health probe")
	})
	t.Run("timeout", func(t *testing.T) {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			select {
			case <-r.Context().Done():
			case <-time.After(5 * time.Second):
			}
		}))
		t.Cleanup(srv.Close)
		cfg := fastHealth()
		cfg.Timeout = 20 * time.Millisecond
		start := time.Now()
		err := NewProber(srv.Client()).Probe(t.Context(), Target{BaseURL: srv.URL}, cfg)
		assert.ErrorIs(t, err, context.DeadlineExceeded)
		assert.Less(t, time.Since(start), 2*time.Second)
	})
}

func TestProberDisabled(t *testing.T) {
	srv := newScriptedServer(t, 500)
	cfg := fastHealth()
	cfg.Disabled = true
	var got []Transition
	NewProber(srv.Client()).Run(t.Context(), Target{ID: "w", BaseURL: srv.URL}, cfg, func(tr Transition) { got = append(got, tr) })
	require.Len(t, got, 1)
	assert.Equal(t, HealthPending, got[0].From)
	assert.Equal(t, HealthReady, got[0].To)
	assert.Zero(t, srv.hits.Load(), "disabled health checks send no probe")
}

// manualTicker delivers ticks only when the test sends them.
type manualTicker struct {
	c       chan time.Time
	stopped atomic.Bool
}

func (m *manualTicker) C() <-chan time.Time { return m.c }
func (m *manualTicker) Stop()               { m.stopped.Store(true) }

func TestProberRunManualTicker(t *testing.T) {
	srv := newScriptedServer(t, 200)
	tk := &manualTicker{c: make(chan time.Time)}
	var interval time.Duration
	p := &Prober{
		Client:    srv.Client(),
		NewTicker: func(d time.Duration) Ticker { interval = d; return tk },
		Now:       func() time.Time { return time.Unix(42, 0) },
	}
	ctx, cancel := context.WithCancel(t.Context())
	got := make(chan Transition, 4)
	done := make(chan struct{})
	go func() {
		defer close(done)
		p.Run(ctx, Target{BaseURL: srv.URL}, fastHealth(), func(tr Transition) { got <- tr })
	}()
	// The first probe is immediate; the second waits for a tick, and the
	// third cannot start before the next one, so the count is exact.
	tk.c <- time.Time{}
	tr := <-got
	assert.Equal(t, HealthReady, tr.To)
	assert.Equal(t, time.Unix(42, 0), tr.At)
	assert.Equal(t, int64(2), srv.hits.Load())
	cancel()
	<-done
	assert.Empty(t, got)
	assert.True(t, tk.stopped.Load())
	assert.Equal(t, fastHealth().Interval, interval)
}

func TestProberRunCancelledMidProbe(t *testing.T) {
	// Shutdown during a hanging probe returns without reporting a failure.
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-release:
		}
	}))
	t.Cleanup(srv.Close)
	t.Cleanup(func() { close(release) })
	ctx, cancel := context.WithCancel(t.Context())
	cfg := fastHealth()
	cfg.FailureThreshold = 1
	cfg.Timeout = 10 * time.Second
	done := make(chan struct{})
	reported := atomic.Int64{}
	go func() {
		defer close(done)
		NewProber(srv.Client()).Run(ctx, Target{BaseURL: srv.URL}, cfg, func(Transition) { reported.Add(1) })
	}()
	time.Sleep(20 * time.Millisecond)
	cancel()
	select {
	case <-done:
	case <-time.After(3 * time.Second):
		t.Fatal("Run did not return after cancel")
	}
	assert.Zero(t, reported.Load())
}
