// Package launcher finds an Envoy binary and runs it as a child process.
package launcher

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// FindEnvoy resolves the Envoy binary: explicit path, $ENVOY_BIN, PATH, then
// the project's virtualenv (next to the executable or the working directory).
func FindEnvoy(explicit string) (string, error) {
	if explicit != "" {
		return checkExec(explicit)
	}
	if p := os.Getenv("ENVOY_BIN"); p != "" {
		return checkExec(p)
	}
	if p, err := exec.LookPath("envoy"); err == nil {
		return p, nil
	}
	var roots []string
	if exe, err := os.Executable(); err == nil {
		roots = append(roots, filepath.Join(filepath.Dir(exe), ".."))
	}
	if wd, err := os.Getwd(); err == nil {
		roots = append(roots, wd)
	}
	for _, r := range roots {
		matches, _ := filepath.Glob(filepath.Join(r, ".venv", "lib", "python3*", "site-packages", "envoy", "_bin", "envoy"))
		for _, m := range matches {
			if p, err := checkExec(m); err == nil {
				return p, nil
			}
		}
	}
	return "", errors.New("no Envoy binary found: pass --envoy-path, set $ENVOY_BIN, put envoy on PATH, or run `make envoy`")
}

func checkExec(p string) (string, error) {
	st, err := os.Stat(p)
	if err != nil {
		return "", fmt.Errorf("envoy binary %q: %w", p, err)
	}
	if st.IsDir() || st.Mode()&0o111 == 0 {
		return "", fmt.Errorf("envoy binary %q is not executable", p)
	}
	return filepath.Abs(p)
}

// Envoy is a running child.
type Envoy struct {
	cmd       *exec.Cmd
	dir       string
	adminPath string
	exited    chan struct{}
	err       error
}

// Options configure the child.
type Options struct {
	Binary      string
	Bootstrap   []byte
	LogLevel    string
	Concurrency int
	Log         io.Writer // Envoy's stdout+stderr
}

// Start writes the bootstrap to a private directory and starts Envoy.
func Start(o Options) (*Envoy, error) {
	dir, err := os.MkdirTemp("", "smg-envoy-")
	if err != nil {
		return nil, fmt.Errorf("envoy temp dir: %w", err)
	}
	cfg := filepath.Join(dir, "bootstrap.yaml")
	if err := os.WriteFile(cfg, o.Bootstrap, 0o600); err != nil {
		return nil, fmt.Errorf("write bootstrap: %w", err)
	}
	e := &Envoy{dir: dir, adminPath: filepath.Join(dir, "admin-address"), exited: make(chan struct{})}
	args := []string{"-c", cfg, "--disable-hot-restart", "--admin-address-path", e.adminPath,
		"--log-level", o.LogLevel, "--log-format", "[envoy][%Y-%m-%d %T.%e][%l] %v"}
	if o.Concurrency > 0 {
		args = append(args, "--concurrency", fmt.Sprint(o.Concurrency))
	}
	cmd := exec.Command(o.Binary, args...)
	cmd.Stdout, cmd.Stderr = o.Log, o.Log
	// Envoy must not outlive the gateway, even on SIGKILL.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM, Setpgid: true}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start envoy %s: %w", o.Binary, err)
	}
	e.cmd = cmd
	go func() {
		e.err = cmd.Wait()
		close(e.exited)
	}()
	return e, nil
}

// Exited is closed when Envoy ends.
func (e *Envoy) Exited() <-chan struct{} { return e.exited }

// Err is Envoy's exit error, after Exited.
func (e *Envoy) Err() error { return e.err }

// AdminAddress returns "host:port" once Envoy wrote it.
func (e *Envoy) AdminAddress() string {
	b, err := os.ReadFile(e.adminPath)
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

// WaitReady polls Envoy's /ready until LIVE.
func (e *Envoy) WaitReady(ctx context.Context) error {
	c := &http.Client{Timeout: time.Second}
	for {
		if a := e.AdminAddress(); a != "" {
			if resp, err := c.Get("http://" + a + "/ready"); err == nil {
				s := bufio.NewScanner(resp.Body)
				s.Scan()
				resp.Body.Close()
				if resp.StatusCode == 200 && strings.TrimSpace(s.Text()) == "LIVE" {
					return nil
				}
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("envoy not ready: %w", ctx.Err())
		case <-e.exited:
			return fmt.Errorf("envoy exited during startup: %v", e.err)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// Stop asks Envoy to exit and waits up to grace before killing it.
func (e *Envoy) Stop(grace time.Duration) {
	defer os.RemoveAll(e.dir)
	select {
	case <-e.exited:
		return
	default:
	}
	_ = e.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-e.exited:
	case <-time.After(grace):
		_ = e.cmd.Process.Kill()
		<-e.exited
	}
}
