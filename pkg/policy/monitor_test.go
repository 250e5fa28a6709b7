package policy

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/smg-project/smg-extproc/pkg/workers"
)

func engine(t *testing.T, routes map[string]string) (*httptest.Server, *atomic.Int64) {
	t.Helper()
	var hits atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		body, ok := routes[r.URL.Path]
		if !ok {
			http.NotFound(w, r)
			return
		}
		if body == "500" {
			w.WriteHeader(http.StatusInternalServerError)
			return
		}
		_, _ = w.Write([]byte(body))
	}))
	t.Cleanup(srv.Close)
	return srv, &hits
}

func engineWorker(srv *httptest.Server, runtime string, rank *int) *workers.Worker {
	w := &workers.Worker{URL: srv.URL, BaseURL: srv.URL, Runtime: runtime, DPRank: rank}
	w.SetHealthy(true)
	return w
}

const vllmMetrics = `# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.9
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:generation_tokens_total{engine="0",model_name="m"} 12345
`

func TestEngineLoadMonitor(t *testing.T) {
	one := 1
	tests := []struct {
		name    string
		runtime string
		routes  map[string]string
		rank    *int
		want    EngineLoad
		ok      bool
	}{
		{"sglang object shape", "sglang", map[string]string{"/v1/loads": `{"timestamp":"x","dp_rank_count":2,"loads":[
			{"dp_rank":0,"num_running_reqs":2,"num_waiting_reqs":3,"num_waiting_uncached_tokens":300,"token_usage":0.2,"gen_throughput":100},
			{"dp_rank":1,"num_running_reqs":4,"num_waiting_reqs":1,"num_waiting_uncached_tokens":100,"token_usage":0.4,"gen_throughput":50}]}`},
			nil, EngineLoad{QueuedTokens: 400, WaitingRequests: 4, RunningRequests: 6, Throughput: 150, KVUsage: 0.3}, true},
		{"sglang one DP rank", "sglang", map[string]string{"/v1/loads": `{"loads":[
			{"dp_rank":0,"num_waiting_reqs":3},{"dp_rank":1,"num_waiting_reqs":9,"token_usage":0.5}]}`},
			&one, EngineLoad{WaitingRequests: 9, KVUsage: 0.5}, true},
		{"sglang legacy list", "sglang", map[string]string{"/v1/loads": `[{"dp_rank":0,"num_reqs":5,"num_waiting_reqs":2,"num_tokens":10,"num_pending_tokens":64,"ts_tic":1.5}]`},
			nil, EngineLoad{QueuedTokens: 64, WaitingRequests: 2, RunningRequests: 5}, true},
		{"sglang falls back to /get_load", "sglang", map[string]string{"/get_load": `[{"dp_rank":0,"num_reqs":1,"num_waiting_reqs":0}]`},
			nil, EngineLoad{RunningRequests: 1}, true},
		{"sglang error", "sglang", map[string]string{"/v1/loads": "500"}, nil, EngineLoad{}, false},
		{"sglang garbage", "sglang", map[string]string{"/v1/loads": "<html>"}, nil, EngineLoad{}, false},
		{"vllm metrics", "vllm", map[string]string{"/metrics": vllmMetrics},
			nil, EngineLoad{WaitingRequests: 7, RunningRequests: 3, KVUsage: 0.25}, true},
		{"vllm older kv gauge", "vllm", map[string]string{"/metrics": "vllm:num_requests_waiting 2\nvllm:gpu_cache_usage_perc 0.5\n"},
			nil, EngineLoad{WaitingRequests: 2, KVUsage: 0.5}, true},
		{"vllm without gauges", "vllm", map[string]string{"/metrics": "other_metric 1\n"}, nil, EngineLoad{}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv, _ := engine(t, tt.routes)
			w := engineWorker(srv, tt.runtime, tt.rank)
			m := NewEngineLoadMonitor(srv.Client(), time.Second)
			_, ok := m.EngineLoad(w)
			require.False(t, ok, "nothing known before the first poll")
			m.Poll(context.Background(), []*workers.Worker{w})
			got, ok := m.EngineLoad(w)
			require.Equal(t, tt.ok, ok)
			if ok {
				assert.NotZero(t, got.Epoch)
				got.Epoch = 0
				assert.InDelta(t, tt.want.KVUsage, got.KVUsage, 1e-9)
				got.KVUsage, tt.want.KVUsage = 0, 0
				assert.Equal(t, tt.want, got)
			}
		})
	}
}

func TestEngineLoadMonitorRun(t *testing.T) {
	srv, hits := engine(t, map[string]string{"/v1/loads": `{"loads":[{"dp_rank":0,"num_waiting_reqs":1}]}`})
	// Two DP ranks of one engine share one fetch per poll.
	r0, r1 := 0, 1
	ws := []*workers.Worker{engineWorker(srv, "sglang", &r0), engineWorker(srv, "sglang", &r1)}
	m := NewEngineLoadMonitor(srv.Client(), 10*time.Millisecond)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { m.Run(ctx, func() []*workers.Worker { return ws }); close(done) }()
	require.Eventually(t, func() bool { return hits.Load() >= 3 }, 2*time.Second, time.Millisecond)
	cancel()
	<-done
	l, ok := m.EngineLoad(ws[0])
	require.True(t, ok)
	assert.Equal(t, int64(1), l.WaitingRequests)
	_, ok = m.EngineLoad(ws[1])
	assert.False(t, ok, "rank 1 is not in the report")

	// Epochs advance per poll, so policies reset their dispatch credit.
	e := l.Epoch
	m.Poll(context.Background(), ws)
	l, _ = m.EngineLoad(ws[0])
	assert.Greater(t, l.Epoch, e)
}

func TestEngineLoadMonitorSendsAPIKey(t *testing.T) {
	var auth atomic.Value
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		auth.Store(r.Header.Get("Authorization"))
		_, _ = w.Write([]byte(`[]`))
	}))
	defer srv.Close()
	w := engineWorker(srv, "sglang", nil)
	w.APIKey = "sk"
	NewEngineLoadMonitor(srv.Client(), time.Second).Poll(context.Background(), []*workers.Worker{w})
	assert.Equal(t, "Bearer sk", auth.Load())
}

func TestParsePromLine(t *testing.T) {
	tests := []struct {
		line, name, labels string
		v                  float64
		ok                 bool
	}{
		{`vllm:x{a="1",engine="2"} 3.5 1700000000`, "vllm:x", `a="1",engine="2"`, 3.5, true},
		{`vllm:x 4`, "vllm:x", "", 4, true},
		{`vllm:x{a="1"}`, "", "", 0, false},
		{`vllm:x NaNx`, "", "", 0, false},
	}
	for _, tt := range tests {
		name, labels, v, ok := parsePromLine(tt.line)
		assert.Equal(t, tt.ok, ok, tt.line)
		if ok {
			assert.Equal(t, tt.name, name)
			assert.Equal(t, tt.labels, labels)
			assert.Equal(t, tt.v, v)
		}
	}
	e, ok := promLabel(`model_name="m", engine="3"`, "engine")
	assert.True(t, ok)
	assert.Equal(t, "3", e)
}

// The monitor plugs into least_load as its LoadSource.
func TestMonitorFeedsLeastLoad(t *testing.T) {
	busy, _ := engine(t, map[string]string{"/v1/loads": `{"loads":[{"num_waiting_reqs":50,"gen_throughput":100}]}`})
	idle, _ := engine(t, map[string]string{"/v1/loads": `{"loads":[{"num_waiting_reqs":0,"gen_throughput":100}]}`})
	ws := []*workers.Worker{engineWorker(busy, "sglang", nil), engineWorker(idle, "sglang", nil)}
	m := NewEngineLoadMonitor(http.DefaultClient, time.Second)
	m.Poll(context.Background(), ws)
	p := build(t, "least_load", DefaultOptions(), Deps{Loads: m})
	assert.Equal(t, 1, p.Pick(ws, Request{}))
}

func TestNilMonitorIsEmpty(t *testing.T) {
	var m *EngineLoadMonitor
	p := build(t, "least_load", DefaultOptions(), Deps{Loads: m})
	ws := mkws("a", "b")
	setLoad(t, ws[0], 2)
	assert.Equal(t, 1, p.Pick(ws, Request{}))
}
