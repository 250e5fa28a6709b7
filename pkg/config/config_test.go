package config

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func intp(n int) *int { return &n }

func TestDefaults(t *testing.T) {
	c, err := Parse(nil)
	require.NoError(t, err)

	tests := []struct {
		name string
		got  any
		want any
	}{
		{"port", c.Port, 30000},
		{"host", c.Host, "0.0.0.0"},
		{"prometheus port", c.PrometheusPort, 29000},
		{"prometheus host", c.PrometheusHost, "0.0.0.0"},
		{"policy", c.Policy, "cache_aware"},
		{"request timeout", c.RequestTimeoutSecs, 1800},
		{"max payload", c.MaxPayloadSize, int64(512 * 1024 * 1024)},
		{"retries", c.RetryMaxRetries, 5},
		{"health interval", c.HealthCheckIntervalSecs, 60},
		{"health timeout", c.HealthCheckTimeoutSecs, 5},
		{"health failure threshold", c.HealthFailureThreshold, 3},
		{"health success threshold", c.HealthSuccessThreshold, 2},
		{"health endpoint", c.HealthCheckEndpoint, "/health"},
		{"cb failure threshold", c.CBFailureThreshold, 10},
		{"cb success threshold", c.CBSuccessThreshold, 3},
		{"cb timeout", c.CBTimeoutDurationSecs, 60},
		{"cb window", c.CBWindowDurationSecs, 120},
		{"pairing mode", c.PDPairingMode, "lenient"},
		{"log format", c.LogFormat, "json"},
		{"log level", c.LogLevel, "info"},
		{"pd disaggregation", c.PDDisaggregation, false},
		{"prefills", len(c.Prefills), 0},
		{"decodes", len(c.Decodes), 0},
		{"node id", c.NodeID, "smg-envoy"},
		{"control host", c.ControlHost, "127.0.0.1"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, tc.want, tc.got)
		})
	}
	assert.Equal(t, 1800*time.Second, c.RequestTimeout())
	assert.Equal(t, Defaults(), c, "Parse(nil) must equal Defaults()")
}

func TestParsePrefill(t *testing.T) {
	tests := []struct {
		name    string
		args    []string
		want    []PrefillArg
		decodes []string
		wantErr string
	}{
		{
			name: "url and port",
			args: []string{"--prefill", "http://p:8000", "8998"},
			want: []PrefillArg{{URL: "http://p:8000", BootstrapPort: intp(8998)}},
		},
		{
			name: "url and none",
			args: []string{"--prefill", "http://p:8000", "none"},
			want: []PrefillArg{{URL: "http://p:8000"}},
		},
		{
			name: "url and NONE (case-insensitive)",
			args: []string{"--prefill", "http://p:8000", "NONE"},
			want: []PrefillArg{{URL: "http://p:8000"}},
		},
		{
			name: "url alone at the end",
			args: []string{"--prefill", "http://p:8000"},
			want: []PrefillArg{{URL: "http://p:8000"}},
		},
		{
			name:    "url followed by another flag",
			args:    []string{"--prefill", "http://p:8000", "--decode", "http://d:8000"},
			want:    []PrefillArg{{URL: "http://p:8000"}},
			decodes: []string{"http://d:8000"},
		},
		{
			name: "inline url takes no port",
			args: []string{"--prefill=http://p:8000"},
			want: []PrefillArg{{URL: "http://p:8000"}},
		},
		{
			name: "repeated prefills with mixed forms",
			args: []string{"--prefill", "http://p1:8000", "8998", "--prefill", "http://p2:8000", "none", "--prefill", "http://p3:8000", "9000"},
			want: []PrefillArg{
				{URL: "http://p1:8000", BootstrapPort: intp(8998)},
				{URL: "http://p2:8000"},
				{URL: "http://p3:8000", BootstrapPort: intp(9000)},
			},
		},
		{name: "port 1 is in range", args: []string{"--prefill", "u", "1"}, want: []PrefillArg{{URL: "u", BootstrapPort: intp(1)}}},
		{name: "port 65535 is in range", args: []string{"--prefill", "u", "65535"}, want: []PrefillArg{{URL: "u", BootstrapPort: intp(65535)}}},
		{name: "not a port", args: []string{"--prefill", "http://p:8000", "notaport"}, wantErr: "neither a bootstrap port nor"},
		{name: "port zero", args: []string{"--prefill", "http://p:8000", "0"}, wantErr: "out of range"},
		{name: "port too large", args: []string{"--prefill", "http://p:8000", "65536"}, wantErr: "out of range"},
		{name: "negative port", args: []string{"--prefill", "http://p:8000", "-1"}, wantErr: "out of range"},
		{name: "missing url", args: []string{"--prefill"}, wantErr: "needs a value"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c, err := Parse(tc.args)
			if tc.wantErr != "" {
				require.Error(t, err)
				assert.Contains(t, err.Error(), tc.wantErr)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tc.want, c.Prefills)
			assert.Equal(t, tc.decodes, c.Decodes)
		})
	}
}

func TestParseForms(t *testing.T) {
	tests := []struct {
		name  string
		args  []string
		check func(t *testing.T, c Config)
	}{
		{"separate value", []string{"--port", "8080"}, func(t *testing.T, c Config) { assert.Equal(t, 8080, c.Port) }},
		{"inline value", []string{"--port=8081"}, func(t *testing.T, c Config) { assert.Equal(t, 8081, c.Port) }},
		{"underscores", []string{"--request_timeout_secs", "60"}, func(t *testing.T, c Config) { assert.Equal(t, 60, c.RequestTimeoutSecs) }},
		{"underscores inline", []string{"--prometheus_port=9100"}, func(t *testing.T, c Config) { assert.Equal(t, 9100, c.PrometheusPort) }},
		{"inline value containing =", []string{"--api-key=a=b"}, func(t *testing.T, c Config) { assert.Equal(t, "a=b", c.APIKey) }},
		{"int64", []string{"--max-payload-size", "1024"}, func(t *testing.T, c Config) { assert.Equal(t, int64(1024), c.MaxPayloadSize) }},
		{"float", []string{"--retry-jitter-factor=0.5"}, func(t *testing.T, c Config) { assert.InDelta(t, 0.5, c.RetryJitterFactor, 1e-9) }},
		{"repeatable decode", []string{"--decode", "http://d1:1", "--decode=http://d2:2", "--decode", "http://d3:3"}, func(t *testing.T, c Config) {
			assert.Equal(t, []string{"http://d1:1", "http://d2:2", "http://d3:3"}, c.Decodes)
		}},
		{"bool bare", []string{"--pd-disaggregation"}, func(t *testing.T, c Config) { assert.True(t, c.PDDisaggregation) }},
		{"bool =true", []string{"--pd-disaggregation=true"}, func(t *testing.T, c Config) { assert.True(t, c.PDDisaggregation) }},
		{"bool =false", []string{"--pd-disaggregation=false"}, func(t *testing.T, c Config) { assert.False(t, c.PDDisaggregation) }},
		{"bool later =false wins", []string{"--disable-retries", "--disable-retries=false"}, func(t *testing.T, c Config) { assert.False(t, c.DisableRetries) }},
		{"bool underscore", []string{"--disable_health_check"}, func(t *testing.T, c Config) { assert.True(t, c.DisableHealthCheck) }},
		{"log-json forces json", []string{"--log-format", "console", "--log-json"}, func(t *testing.T, c Config) { assert.Equal(t, "json", c.LogFormat) }},
		{"log-json=false keeps console", []string{"--log-format", "console", "--log-json=false"}, func(t *testing.T, c Config) { assert.Equal(t, "console", c.LogFormat) }},
		{"ignored flags recorded", []string{"--model-path", "/m", "--dp-aware", "--log_dir=/tmp"}, func(t *testing.T, c Config) {
			assert.Equal(t, []string{"--model-path", "--dp-aware", "--log-dir"}, c.Ignored)
		}},
		{"later value wins", []string{"--policy", "random", "--policy", "round_robin"}, func(t *testing.T, c Config) { assert.Equal(t, "round_robin", c.Policy) }},
		{"log level case-insensitive", []string{"--log-level", "WARN"}, func(t *testing.T, c Config) { assert.Equal(t, "WARN", c.LogLevel) }},
		{"prometheus port 0 allowed", []string{"--prometheus-port", "0"}, func(t *testing.T, c Config) { assert.Equal(t, 0, c.PrometheusPort) }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c, err := Parse(tc.args)
			require.NoError(t, err)
			tc.check(t, c)
		})
	}
}

func TestParseErrors(t *testing.T) {
	tests := []struct {
		name    string
		args    []string
		wantErr string
	}{
		{"unknown flag", []string{"--no-such-flag"}, "unknown flag --no-such-flag"},
		{"unknown flag underscored", []string{"--no_such_flag=1"}, "unknown flag --no-such-flag"},
		{"positional", []string{"stray"}, `unexpected argument "stray"`},
		{"single dash", []string{"-port", "1"}, "unexpected argument"},
		{"bare --", []string{"--"}, "unexpected argument"},
		{"missing value", []string{"--port"}, "needs a value"},
		{"not an int", []string{"--port", "abc"}, "is not an integer"},
		{"not an int64", []string{"--max-payload-size=1.5"}, "is not an integer"},
		{"not a float", []string{"--retry-jitter-factor", "x"}, "is not a number"},
		{"bad bool", []string{"--pd-disaggregation=maybe"}, "flag --pd-disaggregation"},
		{"bool takes no separate value", []string{"--pd-disaggregation", "false"}, `unexpected argument "false"`},
		{"port zero", []string{"--port", "0"}, "--port 0 out of range"},
		{"port too large", []string{"--port", "65536"}, "--port 65536 out of range"},
		{"prometheus port too large", []string{"--prometheus-port", "70000"}, "out of range"},
		{"prometheus port negative", []string{"--prometheus-port=-1"}, "out of range"},
		{"zero timeout", []string{"--request-timeout-secs", "0"}, "must be positive"},
		{"zero payload", []string{"--max-payload-size", "0"}, "must be positive"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse(tc.args)
			require.Error(t, err)
			assert.Contains(t, err.Error(), tc.wantErr)
		})
	}
}

func TestEffectivePolicies(t *testing.T) {
	tests := []struct {
		name                    string
		args                    []string
		wantPrefill, wantDecode string
	}{
		{"default", nil, "cache_aware", "cache_aware"},
		{"policy both legs", []string{"--policy", "round_robin"}, "round_robin", "round_robin"},
		{"prefill override", []string{"--policy", "random", "--prefill-policy", "bucket"}, "bucket", "random"},
		{"decode override", []string{"--decode-policy", "least_load"}, "cache_aware", "least_load"},
		{"both overrides", []string{"--prefill-policy", "prefix_hash", "--decode-policy", "power_of_two"}, "prefix_hash", "power_of_two"},
		{"bucket policy with decode override", []string{"--policy", "bucket", "--decode-policy", "round_robin"}, "bucket", "round_robin"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c, err := Parse(tc.args)
			require.NoError(t, err)
			p, d := c.EffectivePolicies()
			assert.Equal(t, tc.wantPrefill, p)
			assert.Equal(t, tc.wantDecode, d)
		})
	}
}

func TestValidateRefusals(t *testing.T) {
	tests := []struct {
		name    string
		mutate  func(c *Config)
		wantErr string
	}{
		{"bucket as decode policy via --policy", func(c *Config) { c.Policy = "bucket" }, "bucket cannot be used as the decode policy"},
		{"bucket as decode policy via --decode-policy", func(c *Config) { c.DecodePolicy = "bucket" }, "bucket cannot be used as the decode policy"},
		{"unknown policy", func(c *Config) { c.Policy = "fastest" }, `unknown policy "fastest"`},
		{"unknown prefill policy", func(c *Config) { c.PrefillPolicy = "nope" }, `unknown policy "nope"`},
		{"unknown decode policy", func(c *Config) { c.DecodePolicy = "nope" }, `unknown policy "nope"`},
		{"unknown base policy even when both legs overridden", func(c *Config) {
			c.Policy, c.PrefillPolicy, c.DecodePolicy = "nope", "random", "random"
		}, `unknown policy "nope"`},
		{"bad pairing mode", func(c *Config) { c.PDPairingMode = "loose" }, "--pd-pairing-mode"},
		{"bad log level", func(c *Config) { c.LogLevel = "verbose" }, "--log-level"},
		{"bad log format", func(c *Config) { c.LogFormat = "xml" }, "--log-format"},
		{"bad port", func(c *Config) { c.Port = -3 }, "--port -3 out of range"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c := Defaults()
			tc.mutate(&c)
			err := c.Validate()
			require.Error(t, err)
			assert.Contains(t, err.Error(), tc.wantErr)
		})
	}

	t.Run("accepted values", func(t *testing.T) {
		for _, mode := range []string{"off", "lenient", "strict"} {
			c := Defaults()
			c.PDPairingMode = mode
			assert.NoError(t, c.Validate(), mode)
		}
		for _, lvl := range []string{"trace", "debug", "info", "warn", "warning", "error", "DEBUG"} {
			c := Defaults()
			c.LogLevel = lvl
			assert.NoError(t, c.Validate(), lvl)
		}
		for _, p := range []string{"random", "round_robin", "power_of_two", "least_load", "cache_aware", "prefix_hash", "consistent_hashing", "manual"} {
			c := Defaults()
			c.Policy = p
			assert.NoError(t, c.Validate(), p)
		}
		c := Defaults()
		c.PrefillPolicy = "bucket"
		assert.NoError(t, c.Validate(), "bucket is fine on the prefill leg")
	})

	t.Run("Parse reports Validate errors", func(t *testing.T) {
		_, err := Parse([]string{"--decode-policy", "bucket"})
		require.ErrorContains(t, err, "bucket cannot be used as the decode policy")
		_, err = Parse([]string{"--pd-pairing-mode", "sometimes"})
		require.ErrorContains(t, err, "--pd-pairing-mode")
		_, err = Parse([]string{"--log-format=text"})
		require.ErrorContains(t, err, "--log-format")
		_, err = Parse([]string{"--log-level=loud"})
		require.ErrorContains(t, err, "--log-level")
	})
}

func TestUsageListsFlags(t *testing.T) {
	var b strings.Builder
	Usage(&b)
	out := b.String()
	for _, f := range []string{"--prefill", "--decode", "--policy", "--pd-pairing-mode", "--config"} {
		assert.Contains(t, out, f)
	}
	assert.NotContains(t, out, "--model-path", "ignored flags carry no help")
}

func TestLogJSONThenLogFormatCommandLineWins(t *testing.T) {
	c, err := Parse([]string{"--log-json", "--log-format", "console"})
	require.NoError(t, err)
	assert.Equal(t, "console", c.LogFormat)
	c, err = Parse([]string{"--log-format", "console", "--log-json"})
	require.NoError(t, err)
	assert.Equal(t, "json", c.LogFormat)
}
