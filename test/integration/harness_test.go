package integration

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Shared across the package: the gateway binary built once and the Envoy to run.
var (
	gatewayBin string
	envoyBin   string
)

func repoRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Clean(filepath.Join(filepath.Dir(file), "..", ".."))
}

func TestMain(m *testing.M) {
	root := repoRoot()
	dir, err := os.MkdirTemp("", "smg-it-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	gatewayBin = filepath.Join(dir, "smg-extproc")
	build := exec.Command("go", "build", "-o", gatewayBin, "./cmd/smg-extproc")
	build.Dir = root
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "build smg-extproc:", err)
		os.Exit(1)
	}
	envoyBin = os.Getenv("ENVOY_BIN")
	if envoyBin == "" {
		if p, err := exec.LookPath("envoy"); err == nil {
			envoyBin = p
		} else if ms, _ := filepath.Glob(filepath.Join(root, ".venv", "lib", "python3*", "site-packages", "envoy", "_bin", "envoy")); len(ms) > 0 {
			envoyBin = ms[0]
		}
	}
	if envoyBin != "" && !filepath.IsAbs(envoyBin) {
		// Relative to the repository root (the Makefile's working directory).
		envoyBin = filepath.Join(root, envoyBin)
	}
	if envoyBin == "" {
		// Not a skip: these tests exist to run through a real Envoy.
		fmt.Fprintln(os.Stderr, "integration tests need Envoy: run `make envoy` or set ENVOY_BIN")
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

func freePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// syncBuffer collects a child's output for failure reports.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// Gateway is a running `smg-extproc launch` with its Envoy child.
type Gateway struct {
	URL        string
	MetricsURL string
	cmd        *exec.Cmd
	logs       *syncBuffer
	exited     chan struct{}
}

// prefillSpec is one --prefill URL [PORT|none].
type prefillSpec struct {
	URL  string
	Port string // "" = omit, "none", or a number
}

type gwOpts struct {
	Prefills []prefillSpec
	Decodes  []string
	Extra    []string
}

func startGateway(t testing.TB, o gwOpts) *Gateway {
	t.Helper()
	// Free ports are picked then released, so another process can take one
	// first; a start that loses that race is retried on new ports.
	for try := 0; ; try++ {
		g, err := tryStartGateway(t, o)
		if err == nil {
			return g
		}
		if try == 2 || !strings.Contains(strings.ToLower(err.Error()), "address already in use") {
			t.Fatal(err)
		}
	}
}

func tryStartGateway(t testing.TB, o gwOpts) (*Gateway, error) {
	t.Helper()
	port, prom := freePort(t), freePort(t)
	args := []string{"launch", "--pd-disaggregation", "--host", "127.0.0.1", "--port", strconv.Itoa(port),
		"--prometheus-port", strconv.Itoa(prom), "--envoy-path", envoyBin, "--log-level", "debug",
		"--envoy-concurrency", "2"}
	for _, p := range o.Prefills {
		args = append(args, "--prefill", p.URL)
		if p.Port != "" {
			args = append(args, p.Port)
		}
	}
	for _, d := range o.Decodes {
		args = append(args, "--decode", d)
	}
	args = append(args, o.Extra...)
	g := &Gateway{URL: fmt.Sprintf("http://127.0.0.1:%d", port), MetricsURL: fmt.Sprintf("http://127.0.0.1:%d/metrics", prom),
		logs: &syncBuffer{}, exited: make(chan struct{})}
	g.cmd = exec.Command(gatewayBin, args...)
	g.cmd.Stdout, g.cmd.Stderr = g.logs, g.logs
	g.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	require.NoError(t, g.cmd.Start())
	go func() { _ = g.cmd.Wait(); close(g.exited) }()
	deadline := time.Now().Add(60 * time.Second)
	for {
		select {
		case <-g.exited:
			return nil, fmt.Errorf("gateway exited during startup:\n%s", g.logs.String())
		default:
		}
		resp, err := http.Get(g.URL + "/liveness")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 && strings.Contains(g.logs.String(), "gateway ready") {
				break
			}
		}
		if time.Now().After(deadline) {
			g.Stop()
			return nil, fmt.Errorf("gateway not ready in time:\n%s", g.logs.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Cleanup(func() {
		g.Stop()
		if t.Failed() {
			t.Logf("gateway logs:\n%s", tail(g.logs.String(), 12000))
		}
	})
	// Envoy reports LIVE only after its initial CDS/EDS fetch, so the decode
	// cluster is in place once the gateway logs "gateway ready".
	return g, nil
}

// Stop sends SIGTERM and waits.
func (g *Gateway) Stop() {
	select {
	case <-g.exited:
		return
	default:
	}
	_ = g.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-g.exited:
	case <-time.After(15 * time.Second):
		_ = g.cmd.Process.Kill()
		<-g.exited
	}
}

func (g *Gateway) Logs() string { return g.logs.String() }

func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return "..." + s[len(s)-n:]
}

// Response is a fully read client response.
type Response struct {
	Status int
	Header http.Header
	Body   []byte
}

var client = &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 256, DisableCompression: true}}

func do(t testing.TB, method, url string, body []byte, hdr map[string]string) Response {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, url, bytes.NewReader(body))
	require.NoError(t, err)
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := client.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return Response{Status: resp.StatusCode, Header: resp.Header, Body: b}
}

func post(t testing.TB, url string, body string, hdr map[string]string) Response {
	return do(t, http.MethodPost, url, []byte(body), hdr)
}
