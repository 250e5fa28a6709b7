package fleet

import (
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics is the worker-resilience series of SMG's metrics table (§6.1),
// with SMG's names and labels. The `worker` label is the worker URL as
// registered. All methods are safe on a nil *Metrics (they do nothing), so
// callers need no "metrics enabled" branches.
type Metrics struct {
	CBState                *prometheus.GaugeVec     // worker
	CBTransitions          *prometheus.CounterVec   // worker, from, to
	CBOutcomes             *prometheus.CounterVec   // worker, outcome
	CBConsecutiveFailures  *prometheus.GaugeVec     // worker
	CBConsecutiveSuccesses *prometheus.GaugeVec     // worker
	WorkerHealth           *prometheus.GaugeVec     // worker
	Retries                *prometheus.CounterVec   // worker_type, endpoint
	RetriesExhausted       *prometheus.CounterVec   // worker_type, endpoint
	RetryBackoff           *prometheus.HistogramVec // attempt
}

// NewMetrics creates the series and registers them on reg (skipped when reg
// is nil). Registering twice on one registry panics, as MustRegister does.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		CBState: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "smg_worker_cb_state", Help: "Circuit breaker state per worker (0 closed, 1 open, 2 half-open).",
		}, []string{"worker"}),
		CBTransitions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "smg_worker_cb_transitions_total", Help: "Circuit breaker state transitions.",
		}, []string{"worker", "from", "to"}),
		CBOutcomes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "smg_worker_cb_outcomes_total", Help: "Outcomes recorded by circuit breakers (capacity pushback records none).",
		}, []string{"worker", "outcome"}),
		CBConsecutiveFailures: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "smg_worker_cb_consecutive_failures", Help: "Current consecutive-failure streak per worker.",
		}, []string{"worker"}),
		CBConsecutiveSuccesses: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "smg_worker_cb_consecutive_successes", Help: "Current consecutive-success streak per worker.",
		}, []string{"worker"}),
		WorkerHealth: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "smg_worker_health", Help: "1 when the worker passes health checks (Ready), else 0.",
		}, []string{"worker"}),
		Retries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "smg_worker_retries_total", Help: "Retries per leg type and endpoint.",
		}, []string{"worker_type", "endpoint"}),
		RetriesExhausted: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "smg_worker_retries_exhausted_total", Help: "Retryable final responses with no attempts left.",
		}, []string{"worker_type", "endpoint"}),
		RetryBackoff: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "smg_worker_retry_backoff_seconds", Help: "Backoff slept before each retry.",
			Buckets: []float64{.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60},
		}, []string{"attempt"}),
	}
	if reg != nil {
		reg.MustRegister(m.CBState, m.CBTransitions, m.CBOutcomes, m.CBConsecutiveFailures,
			m.CBConsecutiveSuccesses, m.WorkerHealth, m.Retries, m.RetriesExhausted, m.RetryBackoff)
	}
	return m
}

// BreakerHooks returns hooks that keep worker's breaker series current, and
// publishes the closed state a new breaker starts in. Call it when building
// the worker's Breaker.
func (m *Metrics) BreakerHooks(worker string) BreakerHooks {
	if m == nil {
		return BreakerHooks{}
	}
	m.SetBreakerState(worker, StateClosed)
	m.CBConsecutiveFailures.WithLabelValues(worker).Set(0)
	m.CBConsecutiveSuccesses.WithLabelValues(worker).Set(0)
	return BreakerHooks{
		OnTransition: func(from, to State) { m.RecordTransition(worker, from, to) },
		OnOutcome: func(o Outcome, failures, successes int) {
			m.RecordOutcome(worker, o, failures, successes)
		},
	}
}

// SetBreakerState sets smg_worker_cb_state.
func (m *Metrics) SetBreakerState(worker string, s State) {
	if m == nil {
		return
	}
	m.CBState.WithLabelValues(worker).Set(float64(s))
}

// RecordTransition counts a transition and updates the state gauge.
func (m *Metrics) RecordTransition(worker string, from, to State) {
	if m == nil {
		return
	}
	m.CBTransitions.WithLabelValues(worker, from.String(), to.String()).Inc()
	m.SetBreakerState(worker, to)
}

// RecordOutcome counts a success or failure (OutcomeIgnore records nothing,
// as in SMG) and updates the streak gauges.
func (m *Metrics) RecordOutcome(worker string, o Outcome, consecutiveFailures, consecutiveSuccesses int) {
	if m == nil || o == OutcomeIgnore {
		return
	}
	m.CBOutcomes.WithLabelValues(worker, o.String()).Inc()
	m.CBConsecutiveFailures.WithLabelValues(worker).Set(float64(consecutiveFailures))
	m.CBConsecutiveSuccesses.WithLabelValues(worker).Set(float64(consecutiveSuccesses))
}

// SetHealth sets smg_worker_health to 1 (Ready) or 0.
func (m *Metrics) SetHealth(worker string, healthy bool) {
	if m == nil {
		return
	}
	v := 0.0
	if healthy {
		v = 1
	}
	m.WorkerHealth.WithLabelValues(worker).Set(v)
}

// RecordRetry counts one retry of an attempt on a leg of workerType
// ("prefill"/"decode"; a PD retry counts once per leg) and observes the
// backoff slept before it. attempt is the 1-based retry number.
func (m *Metrics) RecordRetry(workerType, endpoint string, attempt int, backoff time.Duration) {
	if m == nil {
		return
	}
	m.Retries.WithLabelValues(workerType, endpoint).Inc()
	m.RetryBackoff.WithLabelValues(strconv.Itoa(attempt)).Observe(backoff.Seconds())
}

// RecordRetriesExhausted counts a retryable final response with no attempts
// left.
func (m *Metrics) RecordRetriesExhausted(workerType, endpoint string) {
	if m == nil {
		return
	}
	m.RetriesExhausted.WithLabelValues(workerType, endpoint).Inc()
}

// DeleteWorker drops every series labelled with worker, so a removed
// worker does not linger on dashboards (and label cardinality stays bounded
// under churn).
func (m *Metrics) DeleteWorker(worker string) {
	if m == nil {
		return
	}
	l := prometheus.Labels{"worker": worker}
	m.CBState.DeletePartialMatch(l)
	m.CBTransitions.DeletePartialMatch(l)
	m.CBOutcomes.DeletePartialMatch(l)
	m.CBConsecutiveFailures.DeletePartialMatch(l)
	m.CBConsecutiveSuccesses.DeletePartialMatch(l)
	m.WorkerHealth.DeletePartialMatch(l)
}
