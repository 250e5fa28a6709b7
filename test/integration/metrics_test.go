package integration

import (
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestMetricsExposed: after real traffic the Prometheus endpoint carries
// SMG's series with SMG's labels, the gateway's own overhead, and Envoy's stats.
func TestMetricsExposed(t *testing.T) {
	s := newStack(t)
	require.Equal(t, 200, post(t, s.GW.URL+"/v1/chat/completions", `{"model":"fake-model","messages":[{"role":"user","content":"metrics"}],"max_tokens":2}`, nil).Status)
	require.Equal(t, 200, post(t, s.GW.URL+"/generate", `{"text":"metrics","stream":true,"sampling_params":{"max_new_tokens":2}}`, nil).Status)
	require.Equal(t, 400, post(t, s.GW.URL+"/v1/completions", `{bad`, nil).Status)
	m := string(do(t, "GET", s.GW.MetricsURL, nil, nil).Body)
	for _, want := range []string{
		`smg_router_requests_total{backend_type="pd",connection_mode="http",endpoint="chat",model="fake-model",router_type="http",streaming="false"} 1`,
		`smg_router_requests_total{backend_type="pd",connection_mode="http",endpoint="generate",model="unknown",router_type="http",streaming="true"} 1`,
		`smg_router_request_errors_total{backend_type="pd",connection_mode="http",endpoint="completions",error_type="validation_error"`,
		`smg_router_request_duration_seconds_count{backend_type="pd",connection_mode="http",endpoint="chat",model="fake-model",router_type="http"} 1`,
		`smg_pd_ttft_seconds_count{backend_type="pd",model="fake-model",runtime="sglang"} 1`,
		`smg_pd_prefill_duration_seconds_count{backend_type="pd",model="fake-model",runtime="sglang"} 1`,
		`smg_pd_bootstrap_failures_total 0`,
		`smg_worker_selection_total{connection_mode="http",model="fake-model",policy="round_robin",worker_type="prefill"} 1`,
		`smg_worker_selection_total{connection_mode="http",model="fake-model",policy="round_robin",worker_type="decode"} 1`,
		fmt.Sprintf(`smg_worker_requests_active{worker=%q} 0`, s.P.URL()),
		fmt.Sprintf(`smg_worker_health{worker=%q} 1`, s.D.URL()),
		fmt.Sprintf(`smg_worker_cb_state{worker=%q} 0`, s.D.URL()),
		`smg_gateway_processing_seconds_count{endpoint="chat"} 1`,
	} {
		assert.Contains(t, m, want)
	}
	e := do(t, "GET", strings.TrimSuffix(s.GW.MetricsURL, "/metrics")+"/envoy/metrics", nil, nil)
	require.Equal(t, 200, e.Status)
	assert.Contains(t, string(e.Body), `envoy_cluster_upstream_rq{envoy_response_code="200",envoy_cluster_name="smg_decode"}`)
}
