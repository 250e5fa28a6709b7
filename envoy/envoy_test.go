package envoy

import (
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"
)

var pdRoutes = []string{
	"/generate", "/v1/chat/completions", "/v1/completions", "/v1/messages",
	"/v1/responses", "/v1/rerank", "/rerank", "/v1/messages/count_tokens",
}

func typical() Params {
	return Params{
		NodeID: "smg-envoy", Host: "0.0.0.0", Port: 30000, EnvoyAdminPort: 9901,
		ControlHost: "127.0.0.1", ExtProcPort: 18001, AdminPort: 18002,
		MaxPayloadSize: 512 << 20, RequestTimeoutSecs: 1800, RouteTimeoutSecs: 1802, MessageTimeoutSecs: 1830,
		PDRoutes: pdRoutes,
	}
}

// render renders p and parses the result into a generic tree.
func render(t *testing.T, p Params) (string, map[string]any) {
	t.Helper()
	b, err := Render(p)
	require.NoError(t, err)
	var doc map[string]any
	require.NoError(t, yaml.Unmarshal(b, &doc), "rendered bootstrap must be valid YAML:\n%s", b)
	return string(b), doc
}

// at walks a parsed YAML tree: string keys index maps, ints index lists.
func at(t *testing.T, v any, path ...any) any {
	t.Helper()
	for i, p := range path {
		switch k := p.(type) {
		case string:
			m, ok := v.(map[string]any)
			require.True(t, ok, "path %v: element %d is %T, not a map", path, i, v)
			v, ok = m[k]
			require.True(t, ok, "path %v: key %q missing", path, k)
		case int:
			l, ok := v.([]any)
			require.True(t, ok, "path %v: element %d is %T, not a list", path, i, v)
			require.Less(t, k, len(l), "path %v: index %d out of range", path, k)
			v = l[k]
		default:
			t.Fatalf("bad path element %v", p)
		}
	}
	return v
}

func has(v any, key string) bool {
	m, ok := v.(map[string]any)
	if !ok {
		return false
	}
	_, ok = m[key]
	return ok
}

func hcm(t *testing.T, doc map[string]any) map[string]any {
	t.Helper()
	v := at(t, doc, "static_resources", "listeners", 0, "filter_chains", 0, "filters", 0, "typed_config")
	m, ok := v.(map[string]any)
	require.True(t, ok)
	return m
}

func routes(t *testing.T, doc map[string]any) []any {
	t.Helper()
	v := at(t, hcm(t, doc), "route_config", "virtual_hosts", 0, "routes")
	l, ok := v.([]any)
	require.True(t, ok)
	return l
}

func clusterByName(t *testing.T, doc map[string]any, name string) any {
	t.Helper()
	for _, c := range at(t, doc, "static_resources", "clusters").([]any) {
		if at(t, c, "name") == name {
			return c
		}
	}
	t.Fatalf("cluster %s not found", name)
	return nil
}

func TestRenderTypical(t *testing.T) {
	text, doc := render(t, typical())
	h := hcm(t, doc)

	t.Run("node and admin", func(t *testing.T) {
		assert.Equal(t, "smg-envoy", at(t, doc, "node", "id"))
		assert.Equal(t, "smg-gateway", at(t, doc, "node", "cluster"))
		assert.Equal(t, "127.0.0.1", at(t, doc, "admin", "address", "socket_address", "address"))
		assert.Equal(t, 9901, at(t, doc, "admin", "address", "socket_address", "port_value"))
	})

	t.Run("listener", func(t *testing.T) {
		sa := at(t, doc, "static_resources", "listeners", 0, "address", "socket_address")
		assert.Equal(t, "0.0.0.0", at(t, sa, "address"))
		assert.Equal(t, 30000, at(t, sa, "port_value"))
	})

	t.Run("hcm settings", func(t *testing.T) {
		assert.Equal(t, false, at(t, h, "generate_request_id"), "the gateway mints request ids")
		assert.Equal(t, true, at(t, h, "preserve_external_request_id"))
		assert.Equal(t, "1800s", at(t, h, "stream_idle_timeout"))
		assert.False(t, has(h, "access_log"), "no access log unless asked")
	})

	t.Run("ext_proc fails closed", func(t *testing.T) {
		f := at(t, h, "http_filters", 0)
		assert.Equal(t, "envoy.filters.http.ext_proc", at(t, f, "name"))
		assert.Equal(t, false, at(t, f, "typed_config", "failure_mode_allow"))
		assert.Equal(t, "smg_extproc", at(t, f, "typed_config", "grpc_service", "envoy_grpc", "cluster_name"))
		assert.Equal(t, "1830s", at(t, f, "typed_config", "message_timeout"))
		assert.Equal(t, "1830s", at(t, f, "typed_config", "max_message_timeout"))
		assert.Equal(t, "BUFFERED", at(t, f, "typed_config", "processing_mode", "request_body_mode"))
		assert.Equal(t, []any{"envoy.lb", "smg"}, at(t, f, "typed_config", "metadata_options", "receiving_namespaces", "untyped"))
		assert.Equal(t, "envoy.filters.http.router", at(t, h, "http_filters", 1, "name"))
	})

	t.Run("PD routes", func(t *testing.T) {
		rs := routes(t, doc)
		require.Len(t, rs, len(pdRoutes)+1, "one route per PD path plus the admin catch-all")
		for i, p := range pdRoutes {
			r := rs[i]
			assert.Equal(t, fmt.Sprintf("smg_pd_%d", i), at(t, r, "name"))
			assert.Equal(t, p, at(t, r, "match", "path"))
			assert.Equal(t, ":method", at(t, r, "match", "headers", 0, "name"))
			assert.Equal(t, "POST", at(t, r, "match", "headers", 0, "string_match", "exact"))
			assert.Equal(t, 512<<20, at(t, r, "request_body_buffer_limit"))
			assert.Equal(t, "smg_decode", at(t, r, "route", "cluster"))
			assert.Equal(t, "1802s", at(t, r, "route", "timeout"))
			assert.Equal(t, "1802s", at(t, r, "route", "idle_timeout"))
			assert.False(t, has(at(t, r, "route"), "internal_redirect_policy"), "no redirects when MaxRedirects is 0")
		}
		last := rs[len(rs)-1]
		assert.Equal(t, "/", at(t, last, "match", "prefix"))
		assert.Equal(t, "smg_admin", at(t, last, "route", "cluster"))
		assert.Equal(t, true, at(t, last, "typed_per_filter_config", "envoy.filters.http.ext_proc", "disabled"))
	})

	t.Run("static clusters dial the control host", func(t *testing.T) {
		tests := []struct {
			cluster string
			port    int
		}{
			{"smg_extproc", 18001},
			{"smg_xds", 18001},
			{"smg_admin", 18002},
		}
		for _, tc := range tests {
			c := clusterByName(t, doc, tc.cluster)
			sa := at(t, c, "load_assignment", "endpoints", 0, "lb_endpoints", 0, "endpoint", "address", "socket_address")
			assert.Equal(t, "127.0.0.1", at(t, sa, "address"), tc.cluster)
			assert.Equal(t, tc.port, at(t, sa, "port_value"), tc.cluster)
		}
	})

	t.Run("local replies mention the limits", func(t *testing.T) {
		assert.Contains(t, text, "maximum payload size of 536870912 bytes")
		assert.Contains(t, text, "did not answer within 1802s")
	})

	t.Run("ADS", func(t *testing.T) {
		assert.Equal(t, "GRPC", at(t, doc, "dynamic_resources", "ads_config", "api_type"))
		assert.Equal(t, "smg_xds", at(t, doc, "dynamic_resources", "ads_config", "grpc_services", 0, "envoy_grpc", "cluster_name"))
	})
}

func TestRenderRedirects(t *testing.T) {
	tests := []struct {
		name         string
		maxRedirects int
		want         bool
	}{
		{"none", 0, false},
		{"one", 1, true},
		{"five", 5, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p := typical()
			p.MaxRedirects = tc.maxRedirects
			text, doc := render(t, p)
			assert.Equal(t, tc.want, strings.Contains(text, "internal_redirect_policy"))
			rs := routes(t, doc)
			for i := range pdRoutes {
				route := at(t, rs[i], "route")
				if !tc.want {
					assert.False(t, has(route, "internal_redirect_policy"))
					continue
				}
				irp := at(t, route, "internal_redirect_policy")
				assert.Equal(t, tc.maxRedirects, at(t, irp, "max_internal_redirects"))
				assert.Equal(t, []any{307}, at(t, irp, "redirect_response_codes"))
				allowed := at(t, irp, "predicates", 0, "typed_config", "allowed_route_names").([]any)
				require.Len(t, allowed, len(pdRoutes))
				for j := range pdRoutes {
					assert.Equal(t, fmt.Sprintf("smg_pd_%d", j), allowed[j])
				}
			}
			assert.False(t, has(at(t, rs[len(rs)-1], "route"), "internal_redirect_policy"), "never on the admin route")
		})
	}
}

func TestRenderAccessLog(t *testing.T) {
	tests := []struct {
		name string
		path string
	}{
		{"off", ""},
		{"stdout", "/dev/stdout"},
		{"file", "/var/log/envoy/access.log"},
		{"path with spaces and colon", "/tmp/my logs/a: b.log"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p := typical()
			p.AccessLogPath = tc.path
			_, doc := render(t, p)
			h := hcm(t, doc)
			if tc.path == "" {
				assert.False(t, has(h, "access_log"))
				return
			}
			al := at(t, h, "access_log", 0)
			assert.Equal(t, "envoy.access_loggers.file", at(t, al, "name"))
			assert.Equal(t, tc.path, at(t, al, "typed_config", "path"))
			jf := at(t, al, "typed_config", "log_format", "json_format")
			assert.Equal(t, "%RESP(X-SMG-ERROR-CODE)%", at(t, jf, "error_code"))
			assert.Equal(t, "%UPSTREAM_HOST%", at(t, jf, "upstream_host"))
			// The hcm keeps its other settings next to the log.
			assert.Equal(t, false, at(t, h, "generate_request_id"))
		})
	}
}

func TestRenderQuoting(t *testing.T) {
	// YAML 1.1 readers (Envoy's yaml-cpp) take unquoted n/y/on/off/yes/no as
	// booleans; the template must keep these strings quoted.
	tricky := []string{"n", "y", "on", "off", "yes", "no", "true", "False", "null", "~", "123", "0x1f", "1e3", "a: b", "#x", "it's", `a"b`, `back\slash`}
	for _, id := range tricky {
		t.Run("node id "+id, func(t *testing.T) {
			p := typical()
			p.NodeID = id
			text, doc := render(t, p)
			assert.Equal(t, id, at(t, doc, "node", "id"))
			// Quoted in the text itself, not merely parsed as a string by a YAML 1.2 reader.
			assert.Contains(t, text, fmt.Sprintf("\n  id: %q\n", id))
		})
	}

	hosts := []string{"0.0.0.0", "::", "on", "n", "localhost", "fd00::1"}
	for _, host := range hosts {
		t.Run("listen host "+host, func(t *testing.T) {
			p := typical()
			p.Host = host
			text, doc := render(t, p)
			assert.Equal(t, host, at(t, doc, "static_resources", "listeners", 0, "address", "socket_address", "address"))
			assert.Contains(t, text, fmt.Sprintf("address: %q,", host))
		})
	}

	controls := []string{"on", "n", "10.0.0.1", "fd00::2", "control.example"}
	for _, host := range controls {
		t.Run("control host "+host, func(t *testing.T) {
			p := typical()
			p.ControlHost = host
			_, doc := render(t, p)
			for _, name := range []string{"smg_extproc", "smg_xds", "smg_admin"} {
				c := clusterByName(t, doc, name)
				got := at(t, c, "load_assignment", "endpoints", 0, "lb_endpoints", 0, "endpoint", "address", "socket_address", "address")
				assert.Equal(t, host, got, name)
			}
		})
	}
}

func TestControlConnectHost(t *testing.T) {
	tests := []struct {
		in, want string
	}{
		{"", "127.0.0.1"},
		{"0.0.0.0", "127.0.0.1"},
		{"::", "127.0.0.1"},
		{"[::]", "127.0.0.1"},
		{"127.0.0.1", "127.0.0.1"},
		{"10.1.2.3", "10.1.2.3"},
		{"::1", "::1"},
		{"smg-control", "smg-control"},
	}
	for _, tc := range tests {
		t.Run(fmt.Sprintf("%q", tc.in), func(t *testing.T) {
			assert.Equal(t, tc.want, Params{ControlHost: tc.in}.ControlConnectHost())
		})
	}

	t.Run("wildcard control host renders loopback", func(t *testing.T) {
		for _, h := range []string{"", "0.0.0.0", "::"} {
			p := typical()
			p.ControlHost = h
			_, doc := render(t, p)
			c := clusterByName(t, doc, "smg_extproc")
			assert.Equal(t, "127.0.0.1", at(t, c, "load_assignment", "endpoints", 0, "lb_endpoints", 0, "endpoint", "address", "socket_address", "address"))
		}
	})
}

func TestRenderNoRoutes(t *testing.T) {
	p := typical()
	p.PDRoutes = nil
	p.MaxRedirects = 3
	_, doc := render(t, p)
	rs := routes(t, doc)
	require.Len(t, rs, 1, "only the admin catch-all")
	assert.Equal(t, "smg_admin", at(t, rs[0], "route", "cluster"))
}
