package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/smg-project/smg-extproc/pkg/fake/sglang"
)

// repoRoot walks up from the working directory to the directory holding go.mod.
func repoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("go.mod not found above the working directory")
		}
		dir = parent
	}
}

// findEnvoy resolves the Envoy binary as the Makefile does: $ENVOY_BIN, PATH, ./.venv.
func findEnvoy(root string) (string, error) {
	if p := os.Getenv("ENVOY_BIN"); p != "" {
		return filepath.Abs(p)
	}
	if p, err := exec.LookPath("envoy"); err == nil {
		return p, nil
	}
	ms, _ := filepath.Glob(filepath.Join(root, ".venv", "lib", "python3*", "site-packages", "envoy", "_bin", "envoy"))
	if len(ms) > 0 {
		return ms[0], nil
	}
	return "", errors.New("no Envoy: set ENVOY_BIN or run `make envoy`")
}

func copyExecutable(src, dst string) (string, error) {
	b, err := os.ReadFile(src)
	if err != nil {
		return "", err
	}
	if err := os.WriteFile(dst, b, 0o755); err != nil {
		return "", err
	}
	return dst, nil
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// startFake starts one in-process fake SGLang engine with no artificial
// delays. Rendezvous timeouts are short so a broken request fails in seconds,
// and the request log keeps one entry so 400 KB bodies are not retained.
func startFake(ctx context.Context, mode sglang.Mode) (*sglang.Server, error) {
	s := sglang.New(sglang.Config{
		Mode: mode, MaxRecorded: 1,
		PrefillDelay: 0, PerTokenDelay: 0, TransferDelay: 0,
		BootstrapTimeout: 20 * time.Second, WaitingTimeout: 20 * time.Second,
		FetchRetryInterval: 50 * time.Millisecond, FetchAttempts: 40,
	})
	if err := s.Start(ctx); err != nil {
		return nil, err
	}
	return s, nil
}

// syncBuffer collects the gateway's output.
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

// gateway is the real `smg-extproc launch` child (with its own Envoy child).
type gateway struct {
	URL    string
	Args   []string
	Env    []string // additions to the inherited environment
	cmd    *exec.Cmd
	logs   *syncBuffer
	exited chan struct{}
}

// startGateway runs the launch command of the brief on free loopback ports;
// extprocPort > 0 also fixes the ext_proc gRPC port so the bench can dial it.
func startGateway(ctx context.Context, bin, envoy string, prefill *sglang.Server, decode *sglang.Server, extprocPort int, env []string) (*gateway, error) {
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	prom, err := freePort()
	if err != nil {
		return nil, err
	}
	args := []string{"launch", "--pd-disaggregation", "--host", "127.0.0.1", "--port", strconv.Itoa(port),
		"--prometheus-port", strconv.Itoa(prom),
		"--prefill", prefill.URL(), strconv.Itoa(prefill.BootstrapPort()),
		"--decode", decode.URL(),
		"--policy", "round_robin", "--envoy-path", envoy, "--log-level", "warn", "--envoy-log-level", "error"}
	if extprocPort > 0 {
		args = append(args, "--extproc-port", strconv.Itoa(extprocPort))
	}
	g := &gateway{URL: fmt.Sprintf("http://127.0.0.1:%d", port), Args: args, logs: &syncBuffer{}, exited: make(chan struct{})}
	g.cmd = exec.Command(bin, args...)
	g.cmd.Stdout, g.cmd.Stderr = g.logs, g.logs
	g.Env = env
	if len(env) > 0 {
		g.cmd.Env = append(os.Environ(), env...)
	}
	// Own process group: a Ctrl-C reaches only the bench, which then stops the
	// gateway with SIGTERM; Pdeathsig covers a bench that dies outright.
	g.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := g.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", bin, err)
	}
	go func() { _ = g.cmd.Wait(); close(g.exited) }()
	if err := g.waitReady(ctx); err != nil {
		g.Stop()
		return nil, fmt.Errorf("%w\ngateway output:\n%s", err, tail(g.logs.String(), 4000))
	}
	return g, nil
}

// waitReady returns once Envoy serves PD requests: the launcher's "gateway
// ready" line (logged when Envoy is LIVE) or, at log levels that hide it, a
// /liveness answer through Envoy followed by one PD request that succeeds.
func (g *gateway) waitReady(ctx context.Context) error {
	deadline := time.Now().Add(90 * time.Second)
	c := &http.Client{Timeout: 10 * time.Second}
	for {
		select {
		case <-g.exited:
			return errors.New("gateway exited during startup")
		case <-ctx.Done():
			return ctx.Err()
		default:
		}
		if strings.Contains(g.logs.String(), "gateway ready") {
			return nil
		}
		if resp, err := c.Get(g.URL + "/liveness"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				body := `{"model":"fake-model","messages":[{"role":"user","content":"ready?"}],"max_tokens":1}`
				resp, err := c.Post(g.URL+"/v1/chat/completions", "application/json", strings.NewReader(body))
				if err == nil {
					resp.Body.Close()
					if resp.StatusCode == http.StatusOK {
						return nil
					}
				}
			}
		}
		if time.Now().After(deadline) {
			return errors.New("gateway not ready after 90 s")
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// exitedEarly reports whether the gateway is already gone (before Stop).
func (g *gateway) exitedEarly() bool {
	select {
	case <-g.exited:
		return true
	default:
		return false
	}
}

// Pid is the smg-extproc process id.
func (g *gateway) Pid() int { return g.cmd.Process.Pid }

// Stop sends SIGTERM and waits (SIGKILL after 15 s).
func (g *gateway) Stop() {
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

func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return "..." + s[len(s)-n:]
}
