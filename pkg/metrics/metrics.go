// Package metrics defines the gateway's Prometheus series with SMG's names and
// labels. The registry is injected; nothing is registered globally.
package metrics

import (
	"github.com/prometheus/client_golang/prometheus"
)

// Metrics is every series the request path records.
type Metrics struct {
	RouterRequests    *prometheus.CounterVec
	RouterErrors      *prometheus.CounterVec
	RouterDuration    *prometheus.HistogramVec
	PDTTFT            *prometheus.HistogramVec
	PDPrefillDuration *prometheus.HistogramVec
	PDBootstrapFail   prometheus.Counter
	PDKVTransfer      *prometheus.HistogramVec
	PDKVTransferFail  prometheus.Counter
	PDConnectorMode   *prometheus.CounterVec
	WorkerSelection   *prometheus.CounterVec
	WorkerActive      *prometheus.GaugeVec
	WorkerErrors      *prometheus.CounterVec
	// GatewayProcessing is what the gateway adds: time in the processor's
	// handlers per request, excluding waits for the prefill leg.
	GatewayProcessing *prometheus.HistogramVec
}

var latencyBuckets = []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300}

// New creates and registers the series on reg.
func New(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		RouterRequests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "smg_router_requests_total", Help: "Client requests by endpoint.",
		}, []string{"router_type", "backend_type", "connection_mode", "model", "endpoint", "streaming"}),
		RouterErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "smg_router_request_errors_total", Help: "Client requests that ended in an error status.",
		}, []string{"router_type", "backend_type", "connection_mode", "model", "endpoint", "error_type"}),
		RouterDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "smg_router_request_duration_seconds", Help: "Time to the committed response head of successful requests.", Buckets: latencyBuckets,
		}, []string{"router_type", "backend_type", "connection_mode", "model", "endpoint"}),
		PDTTFT: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "smg_pd_ttft_seconds", Help: "Dispatch to the decode response head.", Buckets: latencyBuckets,
		}, []string{"backend_type", "model", "runtime"}),
		PDPrefillDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "smg_pd_prefill_duration_seconds", Help: "Prefill leg duration (head and body drain).", Buckets: latencyBuckets,
		}, []string{"backend_type", "model", "runtime"}),
		PDBootstrapFail: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "smg_pd_bootstrap_failures_total", Help: "Requests whose bootstrap injection failed.",
		}),
		PDKVTransfer: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "smg_pd_kv_transfer_duration_seconds", Help: "vLLM: prefill completion to decode dispatch.", Buckets: latencyBuckets,
		}, []string{"backend_type", "model", "runtime"}),
		PDKVTransferFail: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "smg_pd_kv_transfer_failures_total", Help: "NIXL prefills without kv_transfer_params (decode recomputes) and failed MoRI-IO pair or handoff checks.",
		}),
		PDConnectorMode: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "smg_pd_kv_connector_mode_total", Help: "vLLM dispatches by KV connector mode.",
		}, []string{"mode"}),
		WorkerSelection: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "smg_worker_selection_total", Help: "Worker picks per leg.",
		}, []string{"worker_type", "connection_mode", "model", "policy"}),
		WorkerActive: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "smg_worker_requests_active", Help: "In-flight requests per worker.",
		}, []string{"worker"}),
		GatewayProcessing: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "smg_gateway_processing_seconds",
			Help:    "Time the processor spends on a request (all ext_proc phases), excluding prefill waits.",
			Buckets: []float64{.00005, .0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1},
		}, []string{"endpoint"}),
		WorkerErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "smg_worker_errors_total", Help: "5xx outcomes per leg.",
		}, []string{"worker_type", "connection_mode", "error_type"}),
	}
	reg.MustRegister(m.RouterRequests, m.RouterErrors, m.RouterDuration, m.PDTTFT, m.PDPrefillDuration,
		m.PDBootstrapFail, m.PDKVTransfer, m.PDKVTransferFail, m.PDConnectorMode, m.WorkerSelection, m.WorkerActive, m.WorkerErrors, m.GatewayProcessing)
	return m
}

// ErrorType is SMG's error_type label for a status.
func ErrorType(status int) string {
	switch {
	case status == 400:
		return "validation_error"
	case status == 404:
		return "no_workers"
	case status == 408 || status == 504:
		return "timeout"
	case status >= 500:
		return "backend_error"
	default:
		return "internal_error"
	}
}
