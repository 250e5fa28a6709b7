package workers

import (
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func intp(n int) *int { return &n }

// stubResolver answers from a table; IP literals resolve to themselves.
type stubResolver struct {
	mu    sync.Mutex
	table map[string][]string
	calls []string
}

func (s *stubResolver) resolve(host string) ([]string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.calls = append(s.calls, host)
	if ips, ok := s.table[host]; ok {
		return ips, nil
	}
	if strings.Count(host, ".") == 3 || strings.Contains(host, ":") {
		return []string{host}, nil
	}
	return nil, fmt.Errorf("no such host %q", host)
}

func newStub() *stubResolver {
	return &stubResolver{table: map[string][]string{
		"localhost":   {"127.0.0.1"},
		"decode-0":    {"10.0.0.5"},
		"dual":        {"fd00::1", "10.0.0.7"},
		"v6only":      {"fd00::2"},
		"Prefill-UPP": {"10.0.0.9"},
	}}
}

func TestNew(t *testing.T) {
	tests := []struct {
		name          string
		spec          Spec
		wantURL       string
		wantBase      string
		wantAddr      string
		wantBootstrap string
		wantRank      *int
		wantRuntime   string
	}{
		{name: "http", spec: Spec{URL: "http://10.1.2.3:8000", Type: Decode},
			wantURL: "http://10.1.2.3:8000", wantBase: "http://10.1.2.3:8000", wantAddr: "10.1.2.3:8000", wantBootstrap: "10.1.2.3", wantRuntime: "sglang"},
		{name: "https", spec: Spec{URL: "https://10.1.2.3:8443", Type: Prefill},
			wantURL: "https://10.1.2.3:8443", wantBase: "https://10.1.2.3:8443", wantAddr: "10.1.2.3:8443", wantBootstrap: "10.1.2.3", wantRuntime: "sglang"},
		{name: "schemeless defaults to http", spec: Spec{URL: "10.1.2.3:8000", Type: Decode},
			wantURL: "10.1.2.3:8000", wantBase: "http://10.1.2.3:8000", wantAddr: "10.1.2.3:8000", wantBootstrap: "10.1.2.3", wantRuntime: "sglang"},
		{name: "surrounding whitespace trimmed", spec: Spec{URL: "  http://10.1.2.3:8000 \n"},
			wantURL: "http://10.1.2.3:8000", wantBase: "http://10.1.2.3:8000", wantAddr: "10.1.2.3:8000", wantBootstrap: "10.1.2.3", wantRuntime: "sglang"},
		{name: "trailing slash allowed", spec: Spec{URL: "http://10.1.2.3:8000/"},
			wantURL: "http://10.1.2.3:8000/", wantBase: "http://10.1.2.3:8000", wantAddr: "10.1.2.3:8000", wantBootstrap: "10.1.2.3", wantRuntime: "sglang"},
		{name: "http default port 80", spec: Spec{URL: "http://10.1.2.3"},
			wantURL: "http://10.1.2.3", wantBase: "http://10.1.2.3", wantAddr: "10.1.2.3:80", wantBootstrap: "10.1.2.3", wantRuntime: "sglang"},
		{name: "https default port 443", spec: Spec{URL: "https://10.1.2.3"},
			wantURL: "https://10.1.2.3", wantBase: "https://10.1.2.3", wantAddr: "10.1.2.3:443", wantBootstrap: "10.1.2.3", wantRuntime: "sglang"},
		{name: "rank suffix", spec: Spec{URL: "http://10.1.2.3:8000@3", Type: Decode},
			wantURL: "http://10.1.2.3:8000@3", wantBase: "http://10.1.2.3:8000", wantAddr: "10.1.2.3:8000", wantBootstrap: "10.1.2.3", wantRank: intp(3), wantRuntime: "sglang"},
		{name: "rank zero", spec: Spec{URL: "http://10.1.2.3:8000@0"},
			wantURL: "http://10.1.2.3:8000@0", wantBase: "http://10.1.2.3:8000", wantAddr: "10.1.2.3:8000", wantBootstrap: "10.1.2.3", wantRank: intp(0), wantRuntime: "sglang"},
		{name: "spec rank overrides suffix", spec: Spec{URL: "http://10.1.2.3:8000@3", DPRank: intp(5)},
			wantURL: "http://10.1.2.3:8000@3", wantBase: "http://10.1.2.3:8000", wantAddr: "10.1.2.3:8000", wantBootstrap: "10.1.2.3", wantRank: intp(5), wantRuntime: "sglang"},
		{name: "spec rank without suffix", spec: Spec{URL: "http://10.1.2.3:8000", DPRank: intp(1)},
			wantURL: "http://10.1.2.3:8000", wantBase: "http://10.1.2.3:8000", wantAddr: "10.1.2.3:8000", wantBootstrap: "10.1.2.3", wantRank: intp(1), wantRuntime: "sglang"},
		{name: "ipv6 literal", spec: Spec{URL: "http://[fd00::9]:8000", Type: Prefill},
			wantURL: "http://[fd00::9]:8000", wantBase: "http://[fd00::9]:8000", wantAddr: "[fd00::9]:8000", wantBootstrap: "[fd00::9]", wantRuntime: "sglang"},
		{name: "ipv6 literal with rank", spec: Spec{URL: "http://[::1]:30001@2"},
			wantURL: "http://[::1]:30001@2", wantBase: "http://[::1]:30001", wantAddr: "[::1]:30001", wantBootstrap: "[::1]", wantRank: intp(2), wantRuntime: "sglang"},
		{name: "schemeless ipv6", spec: Spec{URL: "[::1]:8000"},
			wantURL: "[::1]:8000", wantBase: "http://[::1]:8000", wantAddr: "[::1]:8000", wantBootstrap: "[::1]", wantRuntime: "sglang"},
		{name: "hostname resolved", spec: Spec{URL: "http://decode-0:8000", Type: Decode},
			wantURL: "http://decode-0:8000", wantBase: "http://decode-0:8000", wantAddr: "10.0.0.5:8000", wantBootstrap: "decode-0", wantRuntime: "sglang"},
		{name: "resolution prefers ipv4", spec: Spec{URL: "http://dual:8000"},
			wantURL: "http://dual:8000", wantBase: "http://dual:8000", wantAddr: "10.0.0.7:8000", wantBootstrap: "dual", wantRuntime: "sglang"},
		{name: "ipv6-only hostname", spec: Spec{URL: "http://v6only:8000"},
			wantURL: "http://v6only:8000", wantBase: "http://v6only:8000", wantAddr: "[fd00::2]:8000", wantBootstrap: "v6only", wantRuntime: "sglang"},
		{name: "bootstrap host lowercased", spec: Spec{URL: "http://Prefill-UPP:8000"},
			wantURL: "http://Prefill-UPP:8000", wantBase: "http://Prefill-UPP:8000", wantAddr: "10.0.0.9:8000", wantBootstrap: "prefill-upp", wantRuntime: "sglang"},
		{name: "explicit runtime kept", spec: Spec{URL: "http://10.1.2.3:8000", Runtime: "vllm"},
			wantURL: "http://10.1.2.3:8000", wantBase: "http://10.1.2.3:8000", wantAddr: "10.1.2.3:8000", wantBootstrap: "10.1.2.3", wantRuntime: "vllm"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			w, err := New(tc.spec, newStub().resolve)
			require.NoError(t, err)
			assert.Equal(t, tc.wantURL, w.URL)
			assert.Equal(t, tc.wantBase, w.BaseURL)
			assert.Equal(t, tc.wantAddr, w.Addr)
			assert.Equal(t, tc.wantBootstrap, w.BootstrapHost)
			assert.Equal(t, tc.wantRank, w.DPRank)
			assert.Equal(t, tc.wantRuntime, w.Runtime)
			assert.Equal(t, tc.spec.Type, w.Type)
			assert.NotEmpty(t, w.ID)
			assert.Equal(t, StatusPending, w.Status(), "new workers start pending")
			assert.False(t, w.Healthy())
		})
	}
}

func TestNewCopiesSpecFields(t *testing.T) {
	spec := Spec{
		URL: "http://10.0.0.1:8000", Type: Prefill, BootstrapPort: intp(8998), Runtime: "vllm",
		Labels: map[string]string{"a": "b"}, APIKey: "k", KVConnector: "NixlConnector", KVRole: "kv_producer",
		KVEngineID: "e1", DPSize: intp(4),
	}
	w, err := New(spec, newStub().resolve)
	require.NoError(t, err)
	assert.Equal(t, intp(8998), w.BootstrapPort)
	assert.Equal(t, map[string]string{"a": "b"}, w.Labels)
	assert.Equal(t, "k", w.APIKey)
	assert.Equal(t, "NixlConnector", w.KVConnector)
	assert.Equal(t, "kv_producer", w.KVRole)
	assert.Equal(t, "e1", w.KVEngineID)
	assert.Equal(t, intp(4), w.DPSize)
}

func TestNewErrors(t *testing.T) {
	tests := []struct {
		name    string
		spec    Spec
		wantErr string
		notErr  string
	}{
		{name: "empty", spec: Spec{URL: "   "}, wantErr: "worker url is empty"},
		{name: "bad rank suffix", spec: Spec{URL: "http://10.0.0.1:8000@abc"}, wantErr: "bad DP rank suffix"},
		{name: "negative rank", spec: Spec{URL: "http://10.0.0.1:8000@-1"}, wantErr: "bad DP rank suffix"},
		{name: "plus rank", spec: Spec{URL: "http://10.0.0.1:8000@+1"}, wantErr: "bad DP rank suffix"},
		{name: "empty rank", spec: Spec{URL: "http://10.0.0.1:8000@"}, wantErr: "bad DP rank suffix"},
		{name: "userinfo", spec: Spec{URL: "http://user:pw@10.0.0.1:8000"}, wantErr: "bad DP rank suffix"},
		{name: "ipc prefill", spec: Spec{URL: "ipc:///tmp/p0", Type: Prefill}, wantErr: "cannot be PD legs"},
		{name: "ipc decode", spec: Spec{URL: "ipc:///tmp/d0", Type: Decode}, wantErr: "cannot be PD legs"},
		{name: "ipc regular", spec: Spec{URL: "ipc:///tmp/r0", Type: Regular}, wantErr: "ipc:// workers are not supported", notErr: "PD legs"},
		{name: "grpc", spec: Spec{URL: "grpc://10.0.0.1:8000"}, wantErr: `unsupported scheme "grpc"`},
		{name: "ftp", spec: Spec{URL: "ftp://10.0.0.1:21"}, wantErr: `unsupported scheme "ftp"`},
		{name: "path", spec: Spec{URL: "http://10.0.0.1:8000/v1"}, wantErr: "must be scheme://host:port"},
		{name: "query", spec: Spec{URL: "http://10.0.0.1:8000?x=1"}, wantErr: "must be scheme://host:port"},
		{name: "fragment", spec: Spec{URL: "http://10.0.0.1:8000#f"}, wantErr: "must be scheme://host:port"},
		{name: "no host", spec: Spec{URL: "http://:8000"}, wantErr: "no host"},
		{name: "port zero", spec: Spec{URL: "http://10.0.0.1:0"}, wantErr: "bad port"},
		{name: "port too large", spec: Spec{URL: "http://10.0.0.1:65536"}, wantErr: "bad port"},
		{name: "non-numeric port", spec: Spec{URL: "http://10.0.0.1:http"}, wantErr: "invalid worker url"},
		{name: "unresolvable host", spec: Spec{URL: "http://nowhere.invalid:8000"}, wantErr: "no such host"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			w, err := New(tc.spec, newStub().resolve)
			require.Error(t, err)
			assert.Nil(t, w)
			assert.Contains(t, err.Error(), tc.wantErr)
			if tc.notErr != "" {
				assert.NotContains(t, err.Error(), tc.notErr)
			}
		})
	}
}

func TestNewResolverUsage(t *testing.T) {
	t.Run("hostname goes through the injected resolver", func(t *testing.T) {
		s := newStub()
		_, err := New(Spec{URL: "http://decode-0:8000@1"}, s.resolve)
		require.NoError(t, err)
		assert.Equal(t, []string{"decode-0"}, s.calls, "the resolver sees the bare host (no port, rank or brackets)")
	})
	t.Run("ipv6 literal is passed without brackets", func(t *testing.T) {
		s := newStub()
		_, err := New(Spec{URL: "http://[fd00::9]:8000"}, s.resolve)
		require.NoError(t, err)
		assert.Equal(t, []string{"fd00::9"}, s.calls)
	})
	t.Run("resolver error", func(t *testing.T) {
		boom := errors.New("dns down")
		_, err := New(Spec{URL: "http://decode-0:8000"}, func(string) ([]string, error) { return nil, boom })
		require.Error(t, err)
		assert.ErrorIs(t, err, boom)
		assert.Contains(t, err.Error(), "http://decode-0:8000")
	})
	t.Run("resolver returns no addresses", func(t *testing.T) {
		_, err := New(Spec{URL: "http://decode-0:8000"}, func(string) ([]string, error) { return nil, nil })
		require.Error(t, err)
		assert.Contains(t, err.Error(), "invalid worker url")
	})
	t.Run("default resolver handles IP literals without DNS", func(t *testing.T) {
		w, err := New(Spec{URL: "http://127.0.0.1:9"}, nil)
		require.NoError(t, err)
		assert.Equal(t, "127.0.0.1:9", w.Addr)
		ips, err := DefaultResolver("[::1]")
		require.NoError(t, err)
		assert.Equal(t, []string{"::1"}, ips)
	})
}

func TestNewID(t *testing.T) {
	parse := func(t *testing.T, id string) []byte {
		t.Helper()
		require.Len(t, id, 36)
		for _, i := range []int{8, 13, 18, 23} {
			require.Equal(t, byte('-'), id[i], "dash at %d in %s", i, id)
		}
		b, err := hex.DecodeString(strings.ReplaceAll(id, "-", ""))
		require.NoError(t, err)
		require.Len(t, b, 16)
		return b
	}

	t.Run("version and variant", func(t *testing.T) {
		for i := 0; i < 200; i++ {
			id := NewID()
			b := parse(t, id)
			assert.Equal(t, byte(0x7), b[6]>>4, "version nibble of %s", id)
			assert.Equal(t, byte(0x2), b[8]>>6, "variant bits of %s", id)
			assert.Equal(t, byte('7'), id[14])
			assert.Contains(t, "89ab", string(id[19]))
		}
	})

	t.Run("timestamp is now", func(t *testing.T) {
		before := time.Now().UnixMilli()
		b := parse(t, NewID())
		after := time.Now().UnixMilli()
		var ms int64
		for _, x := range b[:6] {
			ms = ms<<8 | int64(x)
		}
		assert.GreaterOrEqual(t, ms, before)
		assert.LessOrEqual(t, ms, after)
	})

	t.Run("time ordered across milliseconds", func(t *testing.T) {
		prev := NewID()
		for i := 0; i < 5; i++ {
			time.Sleep(2 * time.Millisecond)
			id := NewID()
			assert.Less(t, prev, id, "ids sort by creation time")
			prev = id
		}
	})

	t.Run("unique", func(t *testing.T) {
		seen := map[string]bool{}
		for i := 0; i < 1000; i++ {
			id := NewID()
			require.False(t, seen[id], "duplicate id %s", id)
			seen[id] = true
		}
	})
}
