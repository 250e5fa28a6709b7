package common

import (
	"context"
	"errors"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"
)

// closeGrace is how long Close lets handlers finish their answers before it
// closes whatever connections are left.
const closeGrace = 250 * time.Millisecond

// Listener is one bound listener and the handler a Lifecycle serves on it.
type Listener struct {
	Ln      net.Listener
	Handler http.Handler
}

// Lifecycle runs a fake's HTTP servers: it serves a set of listeners with a
// shared base context, counts in-flight handlers (answering 503 once closing
// has begun), runs background goroutines, and closes everything exactly once,
// when Close is called or the context given to Serve is done.
type Lifecycle struct {
	name    string
	onClose func()

	baseCtx   context.Context
	cancel    context.CancelFunc
	wg        sync.WaitGroup // serve loops, the ctx watcher, background goroutines
	hmu       sync.Mutex
	closing   bool
	handlers  sync.WaitGroup // in-flight handlers
	started   atomic.Bool
	closeOnce sync.Once
	closeErr  error
	closed    chan struct{}
	servers   []*http.Server
}

// NewLifecycle returns a lifecycle for the fake called name (used in errors,
// e.g. "sglang fake"). afterHandlers, if not nil, runs during Close once every
// in-flight handler has returned and before the background goroutines are
// waited for.
func NewLifecycle(name string, afterHandlers func()) *Lifecycle {
	return &Lifecycle{name: name, onClose: afterHandlers, closed: make(chan struct{})}
}

// Begin marks the lifecycle started; it fails if it already was.
func (l *Lifecycle) Begin() error {
	if !l.started.CompareAndSwap(false, true) {
		return errors.New(l.name + ": already started")
	}
	return nil
}

// Serve serves every listener in the background with a base context that
// outlives ctx's cancellation but is cancelled by Close; when ctx is done,
// the lifecycle closes itself. Serve errors are logged to log.
func (l *Lifecycle) Serve(ctx context.Context, log zerolog.Logger, lns ...Listener) {
	l.baseCtx, l.cancel = context.WithCancel(context.WithoutCancel(ctx))
	base := func(net.Listener) context.Context { return l.baseCtx }
	for _, ln := range lns {
		srv := &http.Server{Handler: l.track(ln.Handler), BaseContext: base, ReadHeaderTimeout: 10 * time.Second}
		l.servers = append(l.servers, srv)
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			if err := srv.Serve(ln.Ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				log.Error().Err(err).Msg("serve")
			}
		}()
	}
	l.wg.Add(1)
	go func() {
		defer l.wg.Done()
		select {
		case <-ctx.Done():
			go func() { _ = l.Close() }()
		case <-l.closed:
		}
	}()
}

// track counts in-flight handlers so Close can wait for them.
func (l *Lifecycle) track(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		l.hmu.Lock()
		if l.closing {
			l.hmu.Unlock()
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		l.handlers.Add(1)
		l.hmu.Unlock()
		defer l.handlers.Done()
		h.ServeHTTP(w, r)
	})
}

// Go runs fn on a tracked goroutine with the base context (cancelled by
// Close). It returns false when the lifecycle is closing or not serving.
func (l *Lifecycle) Go(fn func(ctx context.Context)) bool {
	l.hmu.Lock()
	defer l.hmu.Unlock()
	if l.closing || l.baseCtx == nil {
		return false
	}
	l.wg.Add(1)
	go func() {
		defer l.wg.Done()
		fn(l.baseCtx)
	}()
	return true
}

// Close stops every listener, cancels in-flight requests (their clients see
// the connection close), runs the afterHandlers hook and waits for the
// lifecycle's goroutines. It is safe to call more than once.
func (l *Lifecycle) Close() error {
	l.closeOnce.Do(func() {
		close(l.closed)
		if !l.started.Load() || l.cancel == nil {
			return
		}
		l.hmu.Lock()
		l.closing = true
		l.hmu.Unlock()
		l.cancel()
		// Handlers wake up on the cancelled base context; give them a moment
		// to finish their answers, then close whatever is left (including
		// connections that never sent a request, which Shutdown would wait
		// 5 s for).
		ctx, cancel := context.WithTimeout(context.Background(), closeGrace)
		defer cancel()
		for _, srv := range l.servers {
			if err := srv.Shutdown(ctx); err != nil && !errors.Is(err, context.DeadlineExceeded) {
				l.closeErr = errors.Join(l.closeErr, err)
			}
			if err := srv.Close(); err != nil {
				l.closeErr = errors.Join(l.closeErr, err)
			}
		}
		l.handlers.Wait()
		if l.onClose != nil {
			l.onClose()
		}
		l.wg.Wait()
	})
	return l.closeErr
}
