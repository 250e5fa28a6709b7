// Package xds publishes the decode fleet to Envoy over ADS: one EDS cluster
// whose load-balancing policy is override_host, so Envoy connects only to the
// decode the processor named in `envoy.lb` metadata, and only if it is a
// published endpoint.
package xds

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"sync/atomic"
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	upstreamcodecv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/upstream_codec/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	overridehostv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/load_balancing_policies/override_host/v3"
	roundrobinv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/load_balancing_policies/round_robin/v3"
	httpv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	metadatav3 "github.com/envoyproxy/go-control-plane/envoy/type/metadata/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	cachev3 "github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	resourcev3 "github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	serverv3 "github.com/envoyproxy/go-control-plane/pkg/server/v3"
	"github.com/rs/zerolog"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/smg-project/smg-extproc/pkg/workers"
)

// DecodeCluster is the cluster every PD route sends its decode leg to.
const DecodeCluster = "smg_decode"

// MetadataNamespace carries the processor's host choice (override_host source).
const MetadataNamespace = "envoy.lb"

// MetadataKey is the key inside MetadataNamespace.
const MetadataKey = "x-gateway-destination-endpoint"

// WorkerMetadataNamespace holds per-endpoint identity, for per-try processors and logs.
const WorkerMetadataNamespace = "smg"

// Server owns the snapshot cache and the ADS service.
type Server struct {
	cache   cachev3.SnapshotCache
	ads     serverv3.Server
	log     zerolog.Logger
	version atomic.Uint64
	// ConnectTimeout for decode connections.
	ConnectTimeout time.Duration
	// PerTry installs the per-try processor (an upstream ext_proc on the
	// decode cluster, served by ProcessorCluster) that drives retries.
	PerTry           bool
	ProcessorCluster string
	PerTryTimeout    time.Duration
}

// anyNode serves one snapshot to every Envoy, so replicas need no shared node id.
type anyNode struct{}

func (anyNode) ID(*corev3.Node) string { return "all" }

type cacheLogger struct{ l zerolog.Logger }

func (c cacheLogger) Debugf(f string, a ...any) { c.l.Debug().Msgf(f, a...) }
func (c cacheLogger) Infof(f string, a ...any)  { c.l.Debug().Msgf(f, a...) }
func (c cacheLogger) Warnf(f string, a ...any)  { c.l.Warn().Msgf(f, a...) }
func (c cacheLogger) Errorf(f string, a ...any) { c.l.Error().Msgf(f, a...) }

// New returns a server with an empty decode cluster published.
func New(ctx context.Context, log zerolog.Logger, opts ...func(*Server)) (*Server, error) {
	s := &Server{log: log, ConnectTimeout: 10 * time.Second, ProcessorCluster: "smg_extproc", PerTryTimeout: time.Minute}
	for _, o := range opts {
		o(s)
	}
	s.cache = cachev3.NewSnapshotCache(true, anyNode{}, cacheLogger{log})
	s.ads = serverv3.NewServer(ctx, s.cache, serverv3.CallbackFuncs{
		StreamOpenFunc: func(_ context.Context, id int64, typ string) error {
			log.Debug().Int64("stream", id).Str("type", typ).Msg("xds stream open")
			return nil
		},
	})
	if err := s.Publish(ctx, nil); err != nil {
		return nil, err
	}
	return s, nil
}

// Register adds the ADS service to g.
func (s *Server) Register(g *grpc.Server) {
	discoveryv3.RegisterAggregatedDiscoveryServiceServer(g, s.ads)
}

// Publish replaces the snapshot with the given decode workers. Removing an
// endpoint does not cut streams already running on it: Envoy drains them.
func (s *Server) Publish(ctx context.Context, decodes []*workers.Worker) error {
	cl, err := s.decodeCluster()
	if err != nil {
		return err
	}
	cla, err := loadAssignment(decodes)
	if err != nil {
		return err
	}
	v := strconv.FormatUint(s.version.Add(1), 10)
	snap, err := cachev3.NewSnapshot(v, map[resourcev3.Type][]types.Resource{
		resourcev3.ClusterType:  {cl},
		resourcev3.EndpointType: {cla},
	})
	if err != nil {
		return fmt.Errorf("build xds snapshot: %w", err)
	}
	if err := snap.Consistent(); err != nil {
		return fmt.Errorf("inconsistent xds snapshot: %w", err)
	}
	if err := s.cache.SetSnapshot(ctx, "all", snap); err != nil {
		return fmt.Errorf("set xds snapshot: %w", err)
	}
	s.log.Debug().Str("version", v).Int("decodes", len(decodes)).Msg("xds snapshot published")
	return nil
}

// Run republishes on every registry change until ctx ends.
func (s *Server) Run(ctx context.Context, reg *workers.Registry) {
	ch := reg.Subscribe()
	publish := func() {
		if err := s.Publish(ctx, workers.ByType(reg.Snapshot(), workers.Decode)); err != nil {
			s.log.Error().Err(err).Msg("xds publish failed")
		}
	}
	publish()
	for {
		select {
		case <-ctx.Done():
			return
		case <-ch:
			publish()
		}
	}
}

func (s *Server) decodeCluster() (*clusterv3.Cluster, error) {
	rr, err := anypb.New(&roundrobinv3.RoundRobin{})
	if err != nil {
		return nil, fmt.Errorf("round robin policy: %w", err)
	}
	oh, err := anypb.New(&overridehostv3.OverrideHost{
		// Metadata only: a header source would let a client pick the upstream.
		OverrideHostSources: []*overridehostv3.OverrideHost_OverrideHostSource{{
			Metadata: &metadatav3.MetadataKey{
				Key:  MetadataNamespace,
				Path: []*metadatav3.MetadataKey_PathSegment{{Segment: &metadatav3.MetadataKey_PathSegment_Key{Key: MetadataKey}}},
			},
		}},
		FallbackPolicy: &clusterv3.LoadBalancingPolicy{Policies: []*clusterv3.LoadBalancingPolicy_Policy{{
			TypedExtensionConfig: &corev3.TypedExtensionConfig{Name: "envoy.load_balancing_policies.round_robin", TypedConfig: rr},
		}}},
	})
	if err != nil {
		return nil, fmt.Errorf("override_host policy: %w", err)
	}
	opts := &httpv3.HttpProtocolOptions{
		UpstreamProtocolOptions: &httpv3.HttpProtocolOptions_ExplicitHttpConfig_{ExplicitHttpConfig: &httpv3.HttpProtocolOptions_ExplicitHttpConfig{
			ProtocolConfig: &httpv3.HttpProtocolOptions_ExplicitHttpConfig_HttpProtocolOptions{HttpProtocolOptions: &corev3.Http1ProtocolOptions{}},
		}},
		CommonHttpProtocolOptions: &corev3.HttpProtocolOptions{IdleTimeout: durationpb.New(50 * time.Second)},
	}
	if s.PerTry {
		filters, err := s.perTryFilters()
		if err != nil {
			return nil, err
		}
		opts.HttpFilters = filters
	}
	proto, err := anypb.New(opts)
	if err != nil {
		return nil, fmt.Errorf("protocol options: %w", err)
	}
	const many = 100000
	return &clusterv3.Cluster{
		Name:                 DecodeCluster,
		ClusterDiscoveryType: &clusterv3.Cluster_Type{Type: clusterv3.Cluster_EDS},
		EdsClusterConfig: &clusterv3.Cluster_EdsClusterConfig{EdsConfig: &corev3.ConfigSource{
			ResourceApiVersion:    corev3.ApiVersion_V3,
			ConfigSourceSpecifier: &corev3.ConfigSource_Ads{Ads: &corev3.AggregatedConfigSource{}},
		}},
		ConnectTimeout: durationpb.New(s.ConnectTimeout),
		LoadBalancingPolicy: &clusterv3.LoadBalancingPolicy{Policies: []*clusterv3.LoadBalancingPolicy_Policy{{
			TypedExtensionConfig: &corev3.TypedExtensionConfig{Name: "envoy.load_balancing_policies.override_host", TypedConfig: oh},
		}}},
		TypedExtensionProtocolOptions: map[string]*anypb.Any{"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": proto},
		// Every in-flight stream holds a request (and an HTTP/1 connection).
		CircuitBreakers: &clusterv3.CircuitBreakers{Thresholds: []*clusterv3.CircuitBreakers_Thresholds{{
			MaxConnections:     wrapperspb.UInt32(many),
			MaxPendingRequests: wrapperspb.UInt32(many),
			MaxRequests:        wrapperspb.UInt32(many),
			MaxRetries:         wrapperspb.UInt32(many),
		}}},
	}, nil
}

// perTryFilters is the decode cluster's upstream filter chain: the per-try
// processor sees each try's response head (only), then the codec.
func (s *Server) perTryFilters() ([]*hcmv3.HttpFilter, error) {
	ep, err := anypb.New(&extprocfilterv3.ExternalProcessor{
		GrpcService: &corev3.GrpcService{
			TargetSpecifier: &corev3.GrpcService_EnvoyGrpc_{EnvoyGrpc: &corev3.GrpcService_EnvoyGrpc{ClusterName: s.ProcessorCluster}},
			InitialMetadata: []*corev3.HeaderValue{{Key: "x-smg-role", Value: "per-try"}},
		},
		// Failing open here only loses a retry; the request itself is sound.
		FailureModeAllow: true,
		StatPrefix:       "smg_per_try",
		MessageTimeout:   durationpb.New(s.PerTryTimeout),
		ProcessingMode: &extprocfilterv3.ProcessingMode{
			RequestHeaderMode:   extprocfilterv3.ProcessingMode_SKIP,
			ResponseHeaderMode:  extprocfilterv3.ProcessingMode_SEND,
			RequestBodyMode:     extprocfilterv3.ProcessingMode_NONE,
			ResponseBodyMode:    extprocfilterv3.ProcessingMode_NONE,
			RequestTrailerMode:  extprocfilterv3.ProcessingMode_SKIP,
			ResponseTrailerMode: extprocfilterv3.ProcessingMode_SKIP,
		},
		MetadataOptions: &extprocfilterv3.MetadataOptions{
			ForwardingNamespaces: &extprocfilterv3.MetadataOptions_MetadataNamespaces{Untyped: []string{"smg"}},
		},
	})
	if err != nil {
		return nil, fmt.Errorf("per-try ext_proc config: %w", err)
	}
	codec, err := anypb.New(&upstreamcodecv3.UpstreamCodec{})
	if err != nil {
		return nil, fmt.Errorf("upstream codec config: %w", err)
	}
	return []*hcmv3.HttpFilter{
		{Name: "envoy.filters.http.ext_proc", ConfigType: &hcmv3.HttpFilter_TypedConfig{TypedConfig: ep}},
		{Name: "envoy.filters.http.upstream_codec", ConfigType: &hcmv3.HttpFilter_TypedConfig{TypedConfig: codec}},
	}, nil
}

func loadAssignment(decodes []*workers.Worker) (*endpointv3.ClusterLoadAssignment, error) {
	// DP ranks of one engine share an address: Envoy gets one endpoint, as
	// healthy as its best rank (the processor picks the rank).
	type ep struct {
		w      *workers.Worker
		status corev3.HealthStatus
	}
	rank := func(w *workers.Worker) corev3.HealthStatus {
		switch {
		case w.Draining():
			return corev3.HealthStatus_DRAINING // streams in flight finish; nothing new goes there
		case !w.Healthy():
			return corev3.HealthStatus_UNHEALTHY
		}
		return corev3.HealthStatus_HEALTHY
	}
	better := func(a, b corev3.HealthStatus) bool { // a preferred over b
		order := map[corev3.HealthStatus]int{corev3.HealthStatus_HEALTHY: 0, corev3.HealthStatus_DRAINING: 1, corev3.HealthStatus_UNHEALTHY: 2}
		return order[a] < order[b]
	}
	var order []string
	byAddr := map[string]*ep{}
	for _, w := range decodes {
		st := rank(w)
		if e, ok := byAddr[w.Addr]; ok {
			if better(st, e.status) {
				e.w, e.status = w, st
			}
			continue
		}
		byAddr[w.Addr] = &ep{w: w, status: st}
		order = append(order, w.Addr)
	}
	lbs := make([]*endpointv3.LbEndpoint, 0, len(order))
	for _, addr := range order {
		e := byAddr[addr]
		host, portStr, err := net.SplitHostPort(addr)
		if err != nil {
			return nil, fmt.Errorf("worker %s address %q: %w", e.w.ID, addr, err)
		}
		port, _ := strconv.Atoi(portStr)
		md, err := structpb.NewStruct(map[string]any{"worker_id": e.w.ID, "url": e.w.URL})
		if err != nil {
			return nil, fmt.Errorf("endpoint metadata: %w", err)
		}
		lbs = append(lbs, &endpointv3.LbEndpoint{
			HostIdentifier: &endpointv3.LbEndpoint_Endpoint{Endpoint: &endpointv3.Endpoint{
				Address: &corev3.Address{Address: &corev3.Address_SocketAddress{SocketAddress: &corev3.SocketAddress{
					Address:       host,
					PortSpecifier: &corev3.SocketAddress_PortValue{PortValue: uint32(port)},
				}}},
			}},
			HealthStatus: e.status,
			Metadata:     &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{WorkerMetadataNamespace: md}},
		})
	}
	return &endpointv3.ClusterLoadAssignment{
		ClusterName: DecodeCluster,
		Endpoints:   []*endpointv3.LocalityLbEndpoints{{LbEndpoints: lbs}},
	}, nil
}
