package xds

import (
	"context"
	"strconv"
	"testing"
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	upstreamcodecv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/upstream_codec/v3"
	overridehostv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/load_balancing_policies/override_host/v3"
	roundrobinv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/load_balancing_policies/round_robin/v3"
	httpv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
	resourcev3 "github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/rs/zerolog"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/smg-project/smg-extproc/pkg/workers"
)

func resolveLiteral(host string) ([]string, error) { return []string{host}, nil }

func decodeWorker(t *testing.T, url string) *workers.Worker {
	t.Helper()
	w, err := workers.New(workers.Spec{URL: url, Type: workers.Decode}, resolveLiteral)
	require.NoError(t, err)
	w.SetStatus(workers.StatusReady)
	return w
}

func newServer(t *testing.T, opts ...func(*Server)) *Server {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	s, err := New(ctx, zerolog.Nop(), opts...)
	require.NoError(t, err)
	return s
}

// published returns the current cluster, load assignment and version.
func published(t *testing.T, s *Server) (*clusterv3.Cluster, *endpointv3.ClusterLoadAssignment, string) {
	t.Helper()
	snap, err := s.cache.GetSnapshot("all")
	require.NoError(t, err)
	clusters := snap.GetResources(resourcev3.ClusterType)
	eps := snap.GetResources(resourcev3.EndpointType)
	require.Len(t, clusters, 1)
	require.Len(t, eps, 1)
	cl, ok := clusters[DecodeCluster].(*clusterv3.Cluster)
	require.True(t, ok, "cluster %q published", DecodeCluster)
	cla, ok := eps[DecodeCluster].(*endpointv3.ClusterLoadAssignment)
	require.True(t, ok, "load assignment %q published", DecodeCluster)
	require.NoError(t, cl.ValidateAll())
	require.NoError(t, cla.ValidateAll())
	v := snap.GetVersion(resourcev3.ClusterType)
	assert.Equal(t, v, snap.GetVersion(resourcev3.EndpointType))
	return cl, cla, v
}

func protocolOptions(t *testing.T, cl *clusterv3.Cluster) *httpv3.HttpProtocolOptions {
	t.Helper()
	a, ok := cl.TypedExtensionProtocolOptions["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
	require.True(t, ok)
	opts := &httpv3.HttpProtocolOptions{}
	require.NoError(t, a.UnmarshalTo(opts))
	require.NoError(t, opts.ValidateAll())
	return opts
}

func lbEndpoints(cla *endpointv3.ClusterLoadAssignment) []*endpointv3.LbEndpoint {
	var out []*endpointv3.LbEndpoint
	for _, l := range cla.GetEndpoints() {
		out = append(out, l.GetLbEndpoints()...)
	}
	return out
}

func addrOf(e *endpointv3.LbEndpoint) string {
	sa := e.GetEndpoint().GetAddress().GetSocketAddress()
	return sa.GetAddress() + ":" + strconv.Itoa(int(sa.GetPortValue()))
}

func TestNewPublishesEmptyCluster(t *testing.T) {
	s := newServer(t)
	cl, cla, v := published(t, s)
	assert.Equal(t, DecodeCluster, cl.Name)
	assert.Equal(t, DecodeCluster, cla.ClusterName)
	assert.Empty(t, lbEndpoints(cla))
	assert.Equal(t, "1", v)
}

func TestDecodeCluster(t *testing.T) {
	s := newServer(t)
	require.NoError(t, s.Publish(context.Background(), []*workers.Worker{decodeWorker(t, "http://10.0.0.1:8000")}))
	cl, _, _ := published(t, s)

	t.Run("EDS over ADS", func(t *testing.T) {
		assert.Equal(t, clusterv3.Cluster_EDS, cl.GetType())
		src := cl.GetEdsClusterConfig().GetEdsConfig()
		require.NotNil(t, src.GetAds(), "EDS comes over ADS")
		assert.Equal(t, corev3.ApiVersion_V3, src.GetResourceApiVersion())
		assert.Equal(t, 10*time.Second, cl.GetConnectTimeout().AsDuration())
	})

	t.Run("override_host from metadata only", func(t *testing.T) {
		pols := cl.GetLoadBalancingPolicy().GetPolicies()
		require.Len(t, pols, 1)
		tec := pols[0].GetTypedExtensionConfig()
		assert.Equal(t, "envoy.load_balancing_policies.override_host", tec.GetName())
		oh := &overridehostv3.OverrideHost{}
		require.NoError(t, tec.GetTypedConfig().UnmarshalTo(oh))
		require.NoError(t, oh.ValidateAll())

		srcs := oh.GetOverrideHostSources()
		require.Len(t, srcs, 1, "exactly one host source")
		// Security: a header source would let a client choose the upstream.
		assert.Empty(t, srcs[0].GetHeader(), "no header source")
		md := srcs[0].GetMetadata()
		require.NotNil(t, md)
		assert.Equal(t, "envoy.lb", md.GetKey())
		assert.Equal(t, MetadataNamespace, md.GetKey())
		require.Len(t, md.GetPath(), 1)
		assert.Equal(t, "x-gateway-destination-endpoint", md.GetPath()[0].GetKey())
		assert.Equal(t, MetadataKey, md.GetPath()[0].GetKey())

		fb := oh.GetFallbackPolicy().GetPolicies()
		require.Len(t, fb, 1)
		assert.Equal(t, "envoy.load_balancing_policies.round_robin", fb[0].GetTypedExtensionConfig().GetName())
		rr := &roundrobinv3.RoundRobin{}
		require.NoError(t, fb[0].GetTypedExtensionConfig().GetTypedConfig().UnmarshalTo(rr))
	})

	t.Run("circuit breakers raised", func(t *testing.T) {
		th := cl.GetCircuitBreakers().GetThresholds()
		require.Len(t, th, 1)
		tests := []struct {
			name string
			got  uint32
		}{
			{"max_connections", th[0].GetMaxConnections().GetValue()},
			{"max_pending_requests", th[0].GetMaxPendingRequests().GetValue()},
			{"max_requests", th[0].GetMaxRequests().GetValue()},
			{"max_retries", th[0].GetMaxRetries().GetValue()},
		}
		for _, tc := range tests {
			// Envoy's defaults are 1024 (3 for retries): far too few for long streams.
			assert.GreaterOrEqual(t, tc.got, uint32(100000), tc.name)
		}
	})

	t.Run("HTTP/1 upstream without filters", func(t *testing.T) {
		opts := protocolOptions(t, cl)
		assert.NotNil(t, opts.GetExplicitHttpConfig().GetHttpProtocolOptions(), "HTTP/1.1 to the engines")
		assert.Empty(t, opts.GetHttpFilters(), "no upstream filters without PerTry")
	})
}

func TestPerTryFilters(t *testing.T) {
	s := newServer(t, func(s *Server) {
		s.PerTry = true
		s.ProcessorCluster = "my_proc"
		s.PerTryTimeout = 7 * time.Second
	})
	cl, _, _ := published(t, s)
	opts := protocolOptions(t, cl)
	filters := opts.GetHttpFilters()
	require.Len(t, filters, 2)
	assert.Equal(t, "envoy.filters.http.ext_proc", filters[0].GetName())
	assert.Equal(t, "envoy.filters.http.upstream_codec", filters[1].GetName(), "the codec is the last upstream filter")

	ep := &extprocfilterv3.ExternalProcessor{}
	require.NoError(t, filters[0].GetTypedConfig().UnmarshalTo(ep))
	require.NoError(t, ep.ValidateAll())
	assert.Equal(t, "my_proc", ep.GetGrpcService().GetEnvoyGrpc().GetClusterName())
	md := ep.GetGrpcService().GetInitialMetadata()
	require.Len(t, md, 1)
	assert.Equal(t, "x-smg-role", md[0].GetKey())
	assert.Equal(t, "per-try", md[0].GetValue())
	assert.True(t, ep.GetFailureModeAllow(), "a per-try failure only loses a retry")
	assert.Equal(t, 7*time.Second, ep.GetMessageTimeout().AsDuration())

	pm := ep.GetProcessingMode()
	tests := []struct {
		name string
		got  any
		want any
	}{
		{"request headers", pm.GetRequestHeaderMode(), extprocfilterv3.ProcessingMode_SKIP},
		{"response headers", pm.GetResponseHeaderMode(), extprocfilterv3.ProcessingMode_SEND},
		{"request body", pm.GetRequestBodyMode(), extprocfilterv3.ProcessingMode_NONE},
		{"response body", pm.GetResponseBodyMode(), extprocfilterv3.ProcessingMode_NONE},
		{"request trailers", pm.GetRequestTrailerMode(), extprocfilterv3.ProcessingMode_SKIP},
		{"response trailers", pm.GetResponseTrailerMode(), extprocfilterv3.ProcessingMode_SKIP},
	}
	for _, tc := range tests {
		assert.Equal(t, tc.want, tc.got, tc.name)
	}
	assert.Equal(t, []string{"smg"}, ep.GetMetadataOptions().GetForwardingNamespaces().GetUntyped())

	codec := &upstreamcodecv3.UpstreamCodec{}
	require.NoError(t, filters[1].GetTypedConfig().UnmarshalTo(codec))
}

func TestEndpoints(t *testing.T) {
	ready := decodeWorker(t, "http://10.0.0.1:8000")
	notReady := decodeWorker(t, "http://10.0.0.2:8000")
	notReady.SetHealthy(false)
	pending, err := workers.New(workers.Spec{URL: "http://10.0.0.3:8000", Type: workers.Decode}, resolveLiteral)
	require.NoError(t, err)
	draining := decodeWorker(t, "http://10.0.0.4:8000")
	draining.SetDraining()
	drainingUnhealthy := decodeWorker(t, "http://10.0.0.5:8000")
	drainingUnhealthy.SetHealthy(false)
	drainingUnhealthy.SetDraining()
	v6 := decodeWorker(t, "http://[fd00::1]:9000")

	tests := []struct {
		name       string
		w          *workers.Worker
		wantAddr   string
		wantStatus corev3.HealthStatus
	}{
		{"ready", ready, "10.0.0.1:8000", corev3.HealthStatus_HEALTHY},
		{"not ready", notReady, "10.0.0.2:8000", corev3.HealthStatus_UNHEALTHY},
		{"pending", pending, "10.0.0.3:8000", corev3.HealthStatus_UNHEALTHY},
		{"draining", draining, "10.0.0.4:8000", corev3.HealthStatus_DRAINING},
		{"draining wins over unhealthy", drainingUnhealthy, "10.0.0.5:8000", corev3.HealthStatus_DRAINING},
		{"ipv6", v6, "fd00::1:9000", corev3.HealthStatus_HEALTHY},
	}
	ws := make([]*workers.Worker, 0, len(tests))
	for _, tc := range tests {
		ws = append(ws, tc.w)
	}
	s := newServer(t)
	require.NoError(t, s.Publish(context.Background(), ws))
	_, cla, _ := published(t, s)
	eps := lbEndpoints(cla)
	require.Len(t, eps, len(tests))

	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := eps[i]
			assert.Equal(t, tc.wantAddr, addrOf(e))
			assert.Equal(t, tc.wantStatus, e.GetHealthStatus())
			md := e.GetMetadata().GetFilterMetadata()["smg"]
			require.NotNil(t, md, "smg metadata namespace")
			assert.Equal(t, tc.w.ID, md.GetFields()["worker_id"].GetStringValue())
			assert.Equal(t, tc.w.URL, md.GetFields()["url"].GetStringValue())
		})
	}
}

func TestHealthFollowsWorker(t *testing.T) {
	w := decodeWorker(t, "http://10.0.0.1:8000")
	s := newServer(t)
	steps := []struct {
		name   string
		change func()
		want   corev3.HealthStatus
	}{
		{"ready", func() {}, corev3.HealthStatus_HEALTHY},
		{"goes unhealthy", func() { w.SetHealthy(false) }, corev3.HealthStatus_UNHEALTHY},
		{"recovers", func() { w.SetHealthy(true) }, corev3.HealthStatus_HEALTHY},
		{"drains", func() { w.SetDraining() }, corev3.HealthStatus_DRAINING},
	}
	for _, st := range steps {
		st.change()
		require.NoError(t, s.Publish(context.Background(), []*workers.Worker{w}))
		_, cla, _ := published(t, s)
		eps := lbEndpoints(cla)
		require.Len(t, eps, 1, st.name)
		assert.Equal(t, st.want, eps[0].GetHealthStatus(), st.name)
	}
}

func TestDPRanksShareOneEndpoint(t *testing.T) {
	r0 := decodeWorker(t, "http://10.0.0.1:8000@0")
	r1 := decodeWorker(t, "http://10.0.0.1:8000@1")
	other := decodeWorker(t, "http://10.0.0.2:8000@0")
	require.Equal(t, r0.Addr, r1.Addr)

	s := newServer(t)
	require.NoError(t, s.Publish(context.Background(), []*workers.Worker{r0, r1, other}))
	_, cla, _ := published(t, s)
	eps := lbEndpoints(cla)
	require.Len(t, eps, 2, "two ranks at one address give one endpoint")
	assert.Equal(t, "10.0.0.1:8000", addrOf(eps[0]))
	assert.Equal(t, "10.0.0.2:8000", addrOf(eps[1]))
	assert.Equal(t, r0.ID, eps[0].GetMetadata().GetFilterMetadata()["smg"].GetFields()["worker_id"].GetStringValue())
}

func TestVersionsIncrease(t *testing.T) {
	s := newServer(t)
	_, _, v0 := published(t, s)
	prev, err := strconv.ParseUint(v0, 10, 64)
	require.NoError(t, err)
	sets := [][]*workers.Worker{
		{decodeWorker(t, "http://10.0.0.1:8000")},
		{decodeWorker(t, "http://10.0.0.1:8000"), decodeWorker(t, "http://10.0.0.2:8000")},
		nil,
		nil, // republishing the same set still bumps the version
	}
	for i, ws := range sets {
		require.NoError(t, s.Publish(context.Background(), ws))
		cl, cla, v := published(t, s)
		n, err := strconv.ParseUint(v, 10, 64)
		require.NoError(t, err)
		assert.Greater(t, n, prev, "publish %d", i)
		prev = n
		assert.Len(t, lbEndpoints(cla), len(ws))
		assert.Equal(t, DecodeCluster, cl.Name)
	}
}

func TestRunRepublishesOnRegistryChange(t *testing.T) {
	s := newServer(t)
	reg := workers.NewRegistry()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); s.Run(ctx, reg) }()
	t.Cleanup(func() { cancel(); <-done })

	prefill, err := workers.New(workers.Spec{URL: "http://10.0.0.9:8000", Type: workers.Prefill}, resolveLiteral)
	require.NoError(t, err)
	require.NoError(t, reg.Add(prefill))
	d := decodeWorker(t, "http://10.0.0.1:8000")
	require.NoError(t, reg.Add(d))

	require.Eventually(t, func() bool {
		snap, err := s.cache.GetSnapshot("all")
		if err != nil {
			return false
		}
		cla, _ := snap.GetResources(resourcev3.EndpointType)[DecodeCluster].(*endpointv3.ClusterLoadAssignment)
		eps := lbEndpoints(cla)
		return len(eps) == 1 && addrOf(eps[0]) == "10.0.0.1:8000"
	}, 2*time.Second, 5*time.Millisecond, "only decodes are published")

	d.SetDraining()
	reg.Changed()
	require.Eventually(t, func() bool {
		snap, _ := s.cache.GetSnapshot("all")
		cla, _ := snap.GetResources(resourcev3.EndpointType)[DecodeCluster].(*endpointv3.ClusterLoadAssignment)
		eps := lbEndpoints(cla)
		return len(eps) == 1 && eps[0].GetHealthStatus() == corev3.HealthStatus_DRAINING
	}, 2*time.Second, 5*time.Millisecond)
}
