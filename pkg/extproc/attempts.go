package extproc

import (
	"crypto/rand"
	"encoding/hex"
	"sync"
	"time"

	"github.com/smg-project/smg-extproc/pkg/workers"
)

// Retries are whole new attempts (new pair, new room, new prefill). Envoy's
// own retry would resend the same bytes, so the per-try processor (an
// upstream ext_proc on the decode cluster) turns a retryable decode answer
// into an internal redirect: Envoy re-runs the router-level processor, which
// re-selects and re-mints. The attempt state below links the attempts of one
// client request; it is keyed by a random id carried in the redirect's
// Location (query parameter attemptParam), never by anything a client sets.
const attemptParam = "smg_attempt"

type attemptState struct {
	mu         sync.Mutex
	attempts   int             // attempts started so far
	decode     *workers.Worker // the current attempt's decode
	recorded   bool            // the per-try processor recorded the decode's outcome
	redirected bool            // an internal redirect is in flight: keep the state
	owner      *exchange       // the attempt currently holding the state
	reqID      string          // the client request's id, kept across attempts
	authority  string
	path       string // client path (a PD route) to redirect to
	expires    time.Time
}

// attemptTable is shared by the two processor roles of one gateway process.
type attemptTable struct {
	mu sync.Mutex
	m  map[string]*attemptState
}

func newAttemptTable() *attemptTable { return &attemptTable{m: map[string]*attemptState{}} }

func newAttemptKey() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

func (t *attemptTable) get(key string) *attemptState {
	if key == "" {
		return nil
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.m[key]
}

func (t *attemptTable) put(key string, s *attemptState) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.m[key] = s
}

func (t *attemptTable) del(key string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.m, key)
}

// sweep drops states whose request is long gone (a client that left during a
// backoff, say), bounding the table.
func (t *attemptTable) sweep(now time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for k, s := range t.m {
		s.mu.Lock()
		dead := now.After(s.expires)
		s.mu.Unlock()
		if dead {
			delete(t.m, k)
		}
	}
}
