package extproc

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// maxErrorBody caps how much of an upstream error body is kept for the message.
const maxErrorBody = 1 << 20

// NewHTTPClient returns the pooled client for the legs the gateway sends itself.
// Timeouts come from contexts, so one request timeout bounds the whole leg.
func NewHTTPClient(connectTimeout time.Duration) *http.Client {
	d := &net.Dialer{Timeout: connectTimeout, KeepAlive: 30 * time.Second}
	return &http.Client{Transport: &http.Transport{
		DialContext:         d.DialContext,
		MaxIdleConns:        4096,
		MaxIdleConnsPerHost: 1024,
		IdleConnTimeout:     50 * time.Second,
		DisableCompression:  true,
		ForceAttemptHTTP2:   false,
		WriteBufferSize:     64 << 10,
		ReadBufferSize:      64 << 10,
	}}
}

// prefillLeg is one in-flight prefill request. Its result is published in two
// steps: the head (status or transport error), then the end of the body drain.
type prefillLeg struct {
	url     string
	started time.Time

	head chan struct{} // closed once status or err is set
	done chan struct{} // closed once the body is drained (or failed)

	mu      sync.Mutex
	status  int
	err     error  // transport error before a head
	errBody []byte // body of a non-2xx head
	body    []byte // kept 2xx body when keepBody
	bodyErr error
	headAt  time.Time
	doneAt  time.Time

	cancel   context.CancelFunc
	unlinkFn func() bool // detaches the leg from the client's lifetime
	aborted  atomic.Bool // the gateway dropped the leg
	// byAbort marks an error caused by the gateway dropping the leg, which
	// records no outcome; a failure seen before the drop still counts.
	byAbort bool
}

// startPrefill sends body to url and drains the answer in a goroutine. ctx is
// the client's lifetime; timeout bounds the leg even after it is detached.
func startPrefill(ctx context.Context, client *http.Client, url string, hdr http.Header, body []byte,
	timeout time.Duration, keepBody bool, onDone func(*prefillLeg)) *prefillLeg {
	legCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), timeout)
	l := &prefillLeg{url: url, started: time.Now(), head: make(chan struct{}), done: make(chan struct{}), cancel: cancel}
	// Until the decode commits, a client that goes away takes the prefill with it.
	l.unlinkFn = context.AfterFunc(ctx, cancel)
	go l.run(legCtx, client, hdr, body, timeout, keepBody, onDone)
	return l
}

func (l *prefillLeg) run(ctx context.Context, client *http.Client, hdr http.Header, body []byte,
	timeout time.Duration, keepBody bool, onDone func(*prefillLeg)) {
	defer l.cancel()
	defer func() {
		l.mu.Lock()
		l.doneAt = time.Now()
		l.mu.Unlock()
		close(l.done)
		if onDone != nil {
			onDone(l)
		}
	}()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, l.url, bytes.NewReader(body))
	if err != nil {
		l.setHead(0, fmt.Errorf("build prefill request: %w", err), nil)
		return
	}
	req.Header = hdr
	req.ContentLength = int64(len(body))
	resp, err := client.Do(req)
	if err != nil {
		if ctx.Err() == context.DeadlineExceeded {
			err = fmt.Errorf("prefill request to %s timed out after %s: %w", l.url, timeout, err)
		}
		l.setHead(0, err, nil)
		return
	}
	defer resp.Body.Close()
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		eb, _ := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
		l.setHead(resp.StatusCode, nil, eb)
		_, _ = io.Copy(io.Discard, resp.Body)
		return
	}
	l.setHead(resp.StatusCode, nil, nil)
	// Drain to EOF: closing early makes SGLang abort the KV transfer.
	var kept []byte
	var rerr error
	if keepBody {
		kept, rerr = io.ReadAll(resp.Body)
	} else {
		_, rerr = io.Copy(io.Discard, resp.Body)
	}
	l.mu.Lock()
	l.body, l.bodyErr = kept, rerr
	if rerr != nil {
		l.byAbort = l.aborted.Load()
	}
	l.mu.Unlock()
}

func (l *prefillLeg) setHead(status int, err error, errBody []byte) {
	l.mu.Lock()
	l.status, l.err, l.errBody, l.headAt = status, err, errBody, time.Now()
	if err != nil {
		l.byAbort = l.aborted.Load()
	}
	l.mu.Unlock()
	close(l.head)
}

// result reads the head; call only after head is closed.
func (l *prefillLeg) result() (status int, errBody []byte, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.status, l.errBody, l.err
}

// failed reports whether the head is an error (transport or non-2xx).
func (l *prefillLeg) failed() bool {
	s, _, err := l.result()
	return err != nil || s < 200 || s > 299
}

// detach lets the drain outlive the client stream (after the decode commits).
func (l *prefillLeg) detach() { l.unlinkFn() }

// abort cancels the leg now.
func (l *prefillLeg) abort() {
	l.aborted.Store(true)
	l.cancel()
}

// outcome is the leg's result for its worker's circuit breaker; ok is false
// when the leg was dropped (no outcome is recorded then).
func (l *prefillLeg) outcome() (status int, transportErr, ok bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	switch {
	case l.byAbort:
		return 0, false, false
	case l.err != nil:
		return 0, true, true
	case l.bodyErr != nil:
		return 502, false, true // a failed drain is a failed leg
	}
	return l.status, false, true
}
