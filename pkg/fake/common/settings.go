package common

import (
	"context"
	"net"
	"strconv"
	"sync"
	"time"
)

// Settings holds a fake's effective configuration C, the configuration to
// restore on Reset, and the end of its startup window (during which health
// checks answer 503). It is safe for concurrent use.
type Settings[C any] struct {
	mu           sync.RWMutex
	cur, initial C
	startupUntil time.Time
	window       func(C) time.Duration
}

// NewSettings returns settings holding c, both as the effective and as the
// initial configuration; window extracts a configuration's startup window.
func NewSettings[C any](c C, window func(C) time.Duration) *Settings[C] {
	return &Settings[C]{cur: c, initial: c, window: window}
}

// Get returns the effective configuration.
func (s *Settings[C]) Get() C {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.cur
}

// Starting reports whether the startup window is still open.
func (s *Settings[C]) Starting() bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return time.Now().Before(s.startupUntil)
}

// Started applies pin to both the effective and the initial configuration
// (e.g. to record the ports actually bound) and opens the startup window.
func (s *Settings[C]) Started(pin func(*C)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	pin(&s.cur)
	pin(&s.initial)
	s.startupUntil = time.Now().Add(s.window(s.cur))
}

// Update replaces the effective configuration with next's result, under the
// lock. When next fails, nothing changes and the current configuration is
// returned with the error. When restart(old, new) is true the startup window
// opens again from now.
func (s *Settings[C]) Update(next func(cur C) (C, error), restart func(old, new C) bool) (C, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	c, err := next(s.cur)
	if err != nil {
		return s.cur, err
	}
	if restart(s.cur, c) {
		s.startupUntil = time.Now().Add(s.window(c))
	}
	s.cur = c
	return c, nil
}

// Reset restores the initial configuration and closes the startup window.
func (s *Settings[C]) Reset() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.cur = s.initial
	s.startupUntil = time.Time{}
}

// ListenTCP listens on host:port (port 0 picks a free port) and returns the
// listener with the port it is bound to.
func ListenTCP(ctx context.Context, host string, port int) (net.Listener, int, error) {
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", net.JoinHostPort(host, strconv.Itoa(port)))
	if err != nil {
		return nil, 0, err
	}
	return ln, ln.Addr().(*net.TCPAddr).Port, nil
}

// HTTPURL is "http://host:port".
func HTTPURL(host string, port int) string {
	return "http://" + net.JoinHostPort(host, strconv.Itoa(port))
}
