package main

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestRunArguments(t *testing.T) {
	cases := []struct {
		name   string
		args   []string
		code   int
		stderr string
	}{
		{"no kind", nil, 2, "usage: fake-engine"},
		{"unknown kind", []string{"tgi"}, 2, `unknown kind "tgi"`},
		{"help", []string{"--help"}, 0, ""},
		{"bad mode", []string{"sglang", "--mode", "both"}, 2, "--mode must be prefill, decode or null"},
		{"bad flag", []string{"sglang", "--nope"}, 2, "flag provided but not defined"},
		{"bad level", []string{"sglang", "--log-level", "loud"}, 2, "Unknown Level"},
		{"extra args", []string{"sglang", "x"}, 2, "unexpected arguments"},
		{"flag help", []string{"sglang", "-h"}, 0, "-bootstrap-timeout-ms"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var out, errb bytes.Buffer
			assert.Equal(t, tc.code, run(t.Context(), tc.args, &out, &errb))
			assert.Contains(t, errb.String(), tc.stderr)
		})
	}
}

func TestRunServesUntilCancelled(t *testing.T) {
	cases := []struct {
		mode string
		want string
	}{
		{"prefill", `^fake-engine sglang prefill listening on (http://127\.0\.0\.1:\d+) \(bootstrap \d+\)$`},
		{"decode", `^fake-engine sglang decode listening on (http://127\.0\.0\.1:\d+)$`},
	}
	for _, tc := range cases {
		t.Run(tc.mode, func(t *testing.T) {
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			pr, pw := io.Pipe()
			done := make(chan int, 1)
			go func() {
				done <- run(ctx, []string{"sglang", "--mode", tc.mode, "--http-port", "0", "--bootstrap-port", "0", "--bootstrap-timeout-ms", "100"}, pw, io.Discard)
				pw.Close()
			}()
			line, err := bufio.NewReader(pr).ReadString('\n')
			require.NoError(t, err)
			m := regexp.MustCompile(tc.want).FindStringSubmatch(strings.TrimSpace(line))
			require.NotNil(t, m, line)
			res, err := http.Get(m[1] + "/health")
			require.NoError(t, err)
			res.Body.Close()
			assert.Equal(t, http.StatusOK, res.StatusCode)
			res, err = http.Get(m[1] + "/_fake/config")
			require.NoError(t, err)
			b, _ := io.ReadAll(res.Body)
			res.Body.Close()
			assert.Contains(t, string(b), `"bootstrap_timeout_ms":100`)
			cancel()
			select {
			case code := <-done:
				assert.Equal(t, 0, code)
			case <-time.After(5 * time.Second):
				t.Fatal("fake-engine did not exit")
			}
		})
	}
}
