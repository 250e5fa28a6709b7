package integration

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/smg-project/smg-extproc/pkg/fake/sglang"
)

func workerStatus(t testing.TB, gw *Gateway, url string) string {
	for _, w := range listWorkers(t, gw, nil) {
		if w.URL == url {
			return w.Status
		}
	}
	return "absent"
}

// TestHealthChecksTakeWorkersOutAndBack: a decode failing its health checks
// stops being routable (and /readiness follows), then comes back.
func TestHealthChecksTakeWorkersOutAndBack(t *testing.T) {
	p := startFake(t, fastFake(sglang.Prefill))
	d := startFake(t, fastFake(sglang.Decode))
	gw := startGateway(t, gwOpts{
		Prefills: []prefillSpec{{URL: p.URL(), Port: fmt.Sprint(p.BootstrapPort())}}, Decodes: []string{d.URL()},
		Extra: []string{"--health-check-interval-secs", "1", "--health-failure-threshold", "2", "--health-success-threshold", "2"},
	})
	require.Equal(t, "ready", workerStatus(t, gw, d.URL()))
	require.Equal(t, 200, post(t, gw.URL+"/v1/completions", `{"prompt":"a"}`, nil).Status)

	// /health answers 503 for the next 4 s.
	d.UpdateConfig(func(c *sglang.Config) { c.StartupWindow = 4 * time.Second })
	waitFor(t, 10*time.Second, func() bool { return workerStatus(t, gw, d.URL()) == "not_ready" }, "decode never marked not_ready")
	d.Reset()
	r := post(t, gw.URL+"/v1/completions", `{"prompt":"b"}`, nil)
	require.Equal(t, 503, r.Status)
	code, msg, _ := errorBody(t, r)
	assert.Equal(t, "no_available_workers", code)
	assert.Contains(t, msg, "decode")
	assert.Zero(t, len(d.Requests()), "an unhealthy decode must not be contacted")
	assert.Equal(t, 503, do(t, "GET", gw.URL+"/readiness", nil, nil).Status)

	waitFor(t, 15*time.Second, func() bool { return workerStatus(t, gw, d.URL()) == "ready" }, "decode never came back")
	assert.Equal(t, 200, do(t, "GET", gw.URL+"/readiness", nil, nil).Status)
	assert.Equal(t, 200, post(t, gw.URL+"/v1/completions", `{"prompt":"c"}`, nil).Status)
	assert.Contains(t, gw.Logs(), "worker health changed")
}

// TestCircuitBreakerOpensAndRecovers: consecutive decode failures open the
// decode's breaker; after the open timeout a success closes it again. A
// prefill failure never counts against the decode.
func TestCircuitBreakerOpensAndRecovers(t *testing.T) {
	p := startFake(t, fastFake(sglang.Prefill))
	d := startFake(t, fastFake(sglang.Decode))
	gw := startGateway(t, gwOpts{
		Prefills: []prefillSpec{{URL: p.URL(), Port: fmt.Sprint(p.BootstrapPort())}}, Decodes: []string{d.URL()},
		Extra: []string{"--cb-failure-threshold", "3", "--cb-success-threshold", "1", "--cb-timeout-duration-secs", "2", "--disable-retries"},
	})
	metric := func(name string) string {
		r := do(t, "GET", gw.MetricsURL, nil, nil)
		for _, l := range strings.Split(string(r.Body), "\n") {
			if strings.HasPrefix(l, name) {
				return l
			}
		}
		return ""
	}

	// Prefill failures (503 from the prefill) leave the decode's breaker alone.
	p.UpdateConfig(func(c *sglang.Config) { c.FailStatus, c.FailBody = 503, "busy" })
	for i := 0; i < 2; i++ { // below the prefill's own threshold of 3
		r := post(t, gw.URL+"/v1/completions", `{"prompt":"x"}`, nil)
		require.Equal(t, 503, r.Status, "%s", r.Body)
	}
	p.UpdateConfig(func(c *sglang.Config) { c.FailStatus, c.FailBody = 0, "" })
	require.Equal(t, 200, post(t, gw.URL+"/v1/completions", `{"prompt":"ok"}`, nil).Status)
	assert.NotContains(t, metric(fmt.Sprintf(`smg_worker_cb_state{worker=%q}`, d.URL())), " 1", "decode breaker must stay closed")

	// 429s count as neither success nor failure.
	d.UpdateConfig(func(c *sglang.Config) { c.FailStatus, c.FailBody = 429, `{"error":{"message":"full"}}` })
	for i := 0; i < 4; i++ {
		post(t, gw.URL+"/v1/completions", `{"prompt":"x"}`, nil)
	}
	assert.Equal(t, 500, post(t, gw.URL+"/v1/completions", `{"prompt":"x"}`, nil).Status, "429 is mapped to 500 but the breaker stays closed")

	d.UpdateConfig(func(c *sglang.Config) { c.FailStatus, c.FailBody = 500, `{"error":{"message":"boom"}}` })
	for i := 0; i < 3; i++ {
		r := post(t, gw.URL+"/v1/completions", `{"prompt":"x"}`, nil)
		require.Equal(t, 500, r.Status, "%s", r.Body)
	}
	d.Reset() // healthy again, but the breaker is open
	r := post(t, gw.URL+"/v1/completions", `{"prompt":"x"}`, nil)
	require.Equal(t, 503, r.Status, "open breaker: %s", r.Body)
	code, _, _ := errorBody(t, r)
	assert.Equal(t, "no_available_workers", code)
	assert.Zero(t, len(d.Requests()), "an open breaker keeps the decode out of selection")
	assert.Contains(t, metric(fmt.Sprintf(`smg_worker_cb_state{worker=%q}`, d.URL())), " 1")

	waitFor(t, 10*time.Second, func() bool {
		return post(t, gw.URL+"/v1/completions", `{"prompt":"y"}`, nil).Status == 200
	}, "breaker never recovered")
	assert.Contains(t, metric(fmt.Sprintf(`smg_worker_cb_state{worker=%q}`, d.URL())), " 0")
}
