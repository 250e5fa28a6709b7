package fleet

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// sample finds one series in a gathered registry; for histograms it returns
// the sample count.
func sample(t *testing.T, reg *prometheus.Registry, name string, labels map[string]string) (float64, bool) {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	metrics:
		for _, m := range mf.GetMetric() {
			have := map[string]string{}
			for _, lp := range m.GetLabel() {
				have[lp.GetName()] = lp.GetValue()
			}
			for k, v := range labels {
				if have[k] != v {
					continue metrics
				}
			}
			switch {
			case m.GetGauge() != nil:
				return m.GetGauge().GetValue(), true
			case m.GetCounter() != nil:
				return m.GetCounter().GetValue(), true
			case m.GetHistogram() != nil:
				return float64(m.GetHistogram().GetSampleCount()), true
			}
		}
	}
	return 0, false
}

func TestMetricsBreakerHooks(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := NewMetrics(reg)
	clk := newFakeClock()
	const w = "http://d:8000"
	b := NewBreaker(DefaultBreakerConfig(), clk.Now, m.BreakerHooks(w))
	worker := map[string]string{"worker": w}

	tests := []struct {
		name   string
		act    func()
		metric string
		labels map[string]string
		want   float64
	}{
		{"new breaker publishes closed", func() {}, "smg_worker_cb_state", worker, 0},
		{"failures counted", func() {
			for range 9 {
				b.Record(OutcomeFailure)
			}
		}, "smg_worker_cb_outcomes_total", map[string]string{"worker": w, "outcome": "failure"}, 9},
		{"streak gauge", func() {}, "smg_worker_cb_consecutive_failures", worker, 9},
		{"ignore records nothing", func() { b.Record(OutcomeIgnore) }, "smg_worker_cb_outcomes_total", map[string]string{"worker": w, "outcome": "failure"}, 9},
		{"tenth failure opens", func() { b.Record(OutcomeFailure) }, "smg_worker_cb_state", worker, 1},
		{"transition counted", func() {}, "smg_worker_cb_transitions_total", map[string]string{"worker": w, "from": "closed", "to": "open"}, 1},
		{"half-open after timeout", func() {
			clk.Advance(time.Minute)
			b.Allow()
		}, "smg_worker_cb_state", worker, 2},
		{"successes counted", func() {
			for range 3 {
				b.Record(OutcomeSuccess)
			}
		}, "smg_worker_cb_outcomes_total", map[string]string{"worker": w, "outcome": "success"}, 3},
		{"closed again", func() {}, "smg_worker_cb_state", worker, 0},
		{"close transition counted", func() {}, "smg_worker_cb_transitions_total", map[string]string{"worker": w, "from": "half_open", "to": "closed"}, 1},
		{"streak gauge reset", func() {}, "smg_worker_cb_consecutive_failures", worker, 0},
	}
	for _, tt := range tests {
		tt.act()
		got, ok := sample(t, reg, tt.metric, tt.labels)
		require.Truef(t, ok, "%s: %s%v missing", tt.name, tt.metric, tt.labels)
		assert.Equalf(t, tt.want, got, "%s", tt.name)
	}
}

func TestMetricsHealthRetriesAndDelete(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := NewMetrics(reg)
	m.SetHealth("a", true)
	m.SetHealth("b", false)
	m.RecordRetry("decode", "chat", 1, 50*time.Millisecond)
	m.RecordRetry("prefill", "chat", 1, 50*time.Millisecond)
	m.RecordRetry("decode", "chat", 2, 75*time.Millisecond)
	m.RecordRetriesExhausted("decode", "chat")
	m.BreakerHooks("a").OnTransition(StateClosed, StateOpen)
	m.BreakerHooks("b")

	tests := []struct {
		metric string
		labels map[string]string
		want   float64
	}{
		{"smg_worker_health", map[string]string{"worker": "a"}, 1},
		{"smg_worker_health", map[string]string{"worker": "b"}, 0},
		{"smg_worker_retries_total", map[string]string{"worker_type": "decode", "endpoint": "chat"}, 2},
		{"smg_worker_retries_total", map[string]string{"worker_type": "prefill", "endpoint": "chat"}, 1},
		{"smg_worker_retries_exhausted_total", map[string]string{"worker_type": "decode", "endpoint": "chat"}, 1},
		{"smg_worker_retry_backoff_seconds", map[string]string{"attempt": "1"}, 2},
		{"smg_worker_retry_backoff_seconds", map[string]string{"attempt": "2"}, 1},
		{"smg_worker_cb_state", map[string]string{"worker": "a"}, 1},
	}
	for _, tt := range tests {
		got, ok := sample(t, reg, tt.metric, tt.labels)
		require.Truef(t, ok, "%s%v missing", tt.metric, tt.labels)
		assert.Equalf(t, tt.want, got, "%s%v", tt.metric, tt.labels)
	}

	m.DeleteWorker("a")
	for _, name := range []string{"smg_worker_health", "smg_worker_cb_state", "smg_worker_cb_transitions_total", "smg_worker_cb_consecutive_failures"} {
		_, ok := sample(t, reg, name, map[string]string{"worker": "a"})
		assert.Falsef(t, ok, "%s for a survived DeleteWorker", name)
		_, ok = sample(t, reg, name, map[string]string{"worker": "b"})
		assert.Truef(t, ok || name == "smg_worker_cb_transitions_total", "%s for b was deleted", name)
	}
}

func TestMetricsNilSafe(t *testing.T) {
	var m *Metrics
	assert.NotPanics(t, func() {
		h := m.BreakerHooks("w")
		b := NewBreaker(DefaultBreakerConfig(), nil, h)
		b.Record(OutcomeFailure)
		m.SetHealth("w", true)
		m.RecordRetry("decode", "chat", 1, time.Second)
		m.RecordRetriesExhausted("decode", "chat")
		m.DeleteWorker("w")
	})
	assert.NotPanics(t, func() { NewMetrics(nil).SetHealth("w", true) })
}
