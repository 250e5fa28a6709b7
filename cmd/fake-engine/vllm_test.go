package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestRunVLLMArguments(t *testing.T) {
	cases := []struct {
		name   string
		args   []string
		code   int
		stderr string
	}{
		{"bad role", []string{"vllm", "--role", "router"}, 2, "--role: unknown kv role"},
		{"bad connector", []string{"vllm", "--connector", "lmcache"}, 2, "--connector: unknown kv connector"},
		{"bad moriio mode", []string{"vllm", "--moriio-mode", "push"}, 2, "--moriio-mode must be read or write"},
		{"bad policy", []string{"vllm", "--kv-load-failure-policy", "retry"}, 2, "--kv-load-failure-policy must be fail or recompute"},
		{"bad dp rank", []string{"vllm", "--dp-size", "2", "--dp-rank", "2"}, 2, "--dp-rank 2 not in"},
		{"extra args", []string{"vllm", "x"}, 2, "unexpected arguments"},
		{"flag help", []string{"vllm", "-h"}, 0, "-abort-request-timeout-ms"},
		{"listed in help", []string{"--help"}, 0, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var out, errb bytes.Buffer
			assert.Equal(t, tc.code, run(t.Context(), tc.args, &out, &errb))
			assert.Contains(t, errb.String(), tc.stderr)
			if tc.name == "listed in help" {
				assert.Contains(t, out.String(), "vllm ")
				assert.Contains(t, out.String(), "sglang ")
			}
		})
	}
}

// startBinary runs `fake-engine <args>` in-process and returns the printed
// line's submatches and a stop function that asserts a clean exit.
func startBinary(t *testing.T, want string, args ...string) ([]string, func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	pr, pw := io.Pipe()
	done := make(chan int, 1)
	go func() {
		done <- run(ctx, args, pw, io.Discard)
		pw.Close()
	}()
	line, err := bufio.NewReader(pr).ReadString('\n')
	require.NoError(t, err)
	m := regexp.MustCompile(want).FindStringSubmatch(strings.TrimSpace(line))
	require.NotNil(t, m, line)
	return m, func() {
		cancel()
		select {
		case code := <-done:
			assert.Equal(t, 0, code)
		case <-time.After(5 * time.Second):
			t.Fatal("fake-engine did not exit")
		}
	}
}

func TestRunVLLMServesUntilCancelled(t *testing.T) {
	ports := []string{"--http-port", "0", "--side-channel-port", "0", "--bootstrap-port", "0", "--handshake-port", "0", "--notify-port", "0"}
	cases := []struct {
		args []string
		want string
	}{
		{[]string{"--role", "producer", "--connector", "nixl", "--dp-size", "2"}, `^fake-engine vllm producer \(nixl\) listening on (http://127\.0\.0\.1:\d+) \(side channel \d+,\d+\)$`},
		{[]string{"--role", "kv_consumer", "--connector", "NixlConnector"}, `^fake-engine vllm consumer \(nixl\) listening on (http://127\.0\.0\.1:\d+)$`},
		{[]string{"--role", "producer", "--connector", "mooncake", "--engine-id", "e"}, `^fake-engine vllm producer \(mooncake\) listening on (http://127\.0\.0\.1:\d+) \(bootstrap \d+\)$`},
		{[]string{"--role", "both", "--connector", "moriio", "--moriio-mode", "read"}, `^fake-engine vllm both \(moriio\) listening on (http://127\.0\.0\.1:\d+) \(handshake \d+, notify \d+\)$`},
		{[]string{"--connector", "none"}, `^fake-engine vllm both \(none\) listening on (http://127\.0\.0\.1:\d+)$`},
	}
	for _, tc := range cases {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			m, stop := startBinary(t, tc.want, append(append([]string{"vllm"}, ports...), append(tc.args, "--abort-request-timeout-ms", "1000")...)...)
			defer stop()
			res, err := http.Get(m[1] + "/health")
			require.NoError(t, err)
			res.Body.Close()
			assert.Equal(t, http.StatusOK, res.StatusCode)
			res, err = http.Get(m[1] + "/_fake/config")
			require.NoError(t, err)
			b, _ := io.ReadAll(res.Body)
			res.Body.Close()
			assert.Contains(t, string(b), `"abort_request_timeout_ms":1000`)
		})
	}
}

// The binary's NIXL pair hands off end to end.
func TestRunVLLMPair(t *testing.T) {
	const want = `^fake-engine vllm \w+ \(nixl\) listening on (http://127\.0\.0\.1:\d+)`
	pm, stopP := startBinary(t, want, "vllm", "--role", "producer", "--connector", "nixl", "--http-port", "0", "--side-channel-port", "0")
	defer stopP()
	dm, stopD := startBinary(t, want, "vllm", "--role", "consumer", "--connector", "nixl", "--http-port", "0")
	defer stopD()
	postJSON := func(url string, body any) (*http.Response, map[string]any) {
		b, _ := json.Marshal(body)
		res, err := http.Post(url, "application/json", bytes.NewReader(b))
		require.NoError(t, err)
		defer res.Body.Close()
		var m map[string]any
		require.NoError(t, json.NewDecoder(res.Body).Decode(&m))
		return res, m
	}
	res, pb := postJSON(pm[1]+"/v1/completions", map[string]any{"prompt": "a b c", "max_tokens": 1, "kv_transfer_params": map[string]any{"do_remote_decode": true}})
	require.Equal(t, http.StatusOK, res.StatusCode, pb)
	require.NotNil(t, pb["kv_transfer_params"])
	res, db := postJSON(dm[1]+"/v1/completions", map[string]any{"prompt": "a b c", "max_tokens": 4, "kv_transfer_params": pb["kv_transfer_params"]})
	require.Equal(t, http.StatusOK, res.StatusCode, db)
	assert.Equal(t, "transferred", res.Header.Get("X-Fake-KV"))
}
