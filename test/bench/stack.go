package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
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
	"github.com/smg-project/smg-extproc/pkg/fake/vllm"
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

// startVLLMFake starts one strict in-process fake vLLM engine with the NIXL
// connector and no artificial delays; the request and event logs keep one
// entry each.
func startVLLMFake(ctx context.Context, role vllm.Role) (*vllm.Server, error) {
	s := vllm.New(vllm.Config{Role: role, Connector: vllm.Nixl, MaxRecorded: 1})
	if err := s.Start(ctx); err != nil {
		return nil, err
	}
	return s, nil
}

// workerSpec is one POST /workers body.
type workerSpec struct {
	URL         string `json:"url"`
	WorkerType  string `json:"worker_type"`
	KVConnector string `json:"kv_connector,omitempty"`
}

// workerInfo is the part of GET /workers the bench checks.
type workerInfo struct {
	URL         string `json:"url"`
	WorkerType  string `json:"worker_type"`
	RuntimeType string `json:"runtime_type"`
	KVConnector string `json:"kv_connector"`
	PDPairing   string `json:"pd_pairing"`
	Status      string `json:"status"`
}

// registerWorkers adds specs through the gateway's worker API (POST /workers
// on the client port) and waits until GET /workers lists every one of them
// as ready with the vLLM runtime (detected from /v1/models) and its
// connector: only then does a request take the sequential NIXL path.
func registerWorkers(ctx context.Context, gwURL string, specs []workerSpec) ([]workerInfo, error) {
	c := &http.Client{Timeout: 10 * time.Second}
	for _, sp := range specs {
		b, _ := json.Marshal(sp)
		resp, err := c.Post(gwURL+"/workers", "application/json", bytes.NewReader(b))
		if err != nil {
			return nil, fmt.Errorf("POST /workers %s: %w", b, err)
		}
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 500))
		resp.Body.Close()
		if resp.StatusCode != http.StatusAccepted {
			return nil, fmt.Errorf("POST /workers %s: status %d: %s", b, resp.StatusCode, body)
		}
	}
	deadline := time.Now().Add(30 * time.Second)
	last := ""
	for {
		var list struct {
			Workers []workerInfo `json:"workers"`
		}
		resp, err := c.Get(gwURL + "/workers")
		if err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			last = string(b)
			if resp.StatusCode == http.StatusOK && json.Unmarshal(b, &list) == nil {
				var got []workerInfo
				for _, sp := range specs {
					for _, w := range list.Workers {
						if w.URL == sp.URL && w.WorkerType == sp.WorkerType && w.Status == "ready" {
							got = append(got, w)
						}
					}
				}
				if len(got) == len(specs) && len(list.Workers) == len(specs) {
					for _, w := range got {
						if w.RuntimeType != "vllm" || w.KVConnector != string(vllm.Nixl) {
							return nil, fmt.Errorf("worker %s registered as runtime %q, kv_connector %q: want vllm, %s",
								w.URL, w.RuntimeType, w.KVConnector, vllm.Nixl)
						}
					}
					return got, nil
				}
			}
		} else {
			last = err.Error()
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("workers not ready after 30 s; GET /workers: %s", tail(last, 1000))
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
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

// startGateway runs the launch command of the brief on free loopback ports,
// with workers (--prefill/--decode arguments; none for a gateway whose
// workers arrive through the worker API); extprocPort > 0 also fixes the
// ext_proc gRPC port so the bench can dial it. setup, when set, runs once
// Envoy answers /liveness (the vLLM stack registers its workers there);
// the gateway is ready when a PD request through Envoy passes validation.
func startGateway(ctx context.Context, bin, envoy string, workers []string, extprocPort int, env []string,
	setup func(context.Context, *gateway) error) (*gateway, error) {
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	prom, err := freePort()
	if err != nil {
		return nil, err
	}
	args := []string{"launch", "--pd-disaggregation", "--host", "127.0.0.1", "--port", strconv.Itoa(port),
		"--prometheus-port", strconv.Itoa(prom)}
	args = append(args, workers...)
	args = append(args, "--policy", "round_robin", "--envoy-path", envoy, "--log-level", "warn", "--envoy-log-level", "error")
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
	if err := g.waitReady(ctx, setup); err != nil {
		g.Stop()
		return nil, fmt.Errorf("%w\ngateway output:\n%s", err, tail(g.logs.String(), 4000))
	}
	return g, nil
}

// waitReady returns once Envoy serves PD requests: /liveness answers
// through Envoy, setup (if any) has run, and one small PD request through
// Envoy comes back 200 with X-Fake-KV: transferred.
func (g *gateway) waitReady(ctx context.Context, setup func(context.Context, *gateway) error) error {
	deadline := time.Now().Add(90 * time.Second)
	c := &http.Client{Timeout: 10 * time.Second}
	live, lastErr := false, "no answer"
	for {
		select {
		case <-g.exited:
			return errors.New("gateway exited during startup")
		case <-ctx.Done():
			return ctx.Err()
		default:
		}
		if !live {
			if resp, err := c.Get(g.URL + "/liveness"); err == nil {
				resp.Body.Close()
				live = resp.StatusCode == http.StatusOK
			}
			if live && setup != nil {
				if err := setup(ctx, g); err != nil {
					return err
				}
			}
		}
		if live {
			body := `{"model":"fake-model","messages":[{"role":"user","content":"ready?"}],"max_tokens":1}`
			resp, err := c.Post(g.URL+"/v1/chat/completions", "application/json", strings.NewReader(body))
			if err == nil {
				b, _ := io.ReadAll(io.LimitReader(resp.Body, 300))
				resp.Body.Close()
				if resp.StatusCode == http.StatusOK && resp.Header.Get("X-Fake-KV") == "transferred" {
					return nil
				}
				lastErr = fmt.Sprintf("status %d, X-Fake-KV %q: %s", resp.StatusCode, resp.Header.Get("X-Fake-KV"), b)
			} else {
				lastErr = err.Error()
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("gateway not ready after 90 s (live %v; last PD request: %s)", live, lastErr)
		}
		// A probe that fails counts against a worker's circuit breaker, so
		// PD probes are spaced out; /liveness is polled faster.
		if live {
			time.Sleep(250 * time.Millisecond)
		} else {
			time.Sleep(100 * time.Millisecond)
		}
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
