package policy

import (
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/smg-project/smg-extproc/pkg/workers"
)

// fakeClock is a settable Clock.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func newFakeClock() *fakeClock { return &fakeClock{t: time.Unix(1_700_000_000, 0)} }

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// seqRand returns the given values in turn (modulo n), then zeros.
type seqRand struct {
	mu   sync.Mutex
	vals []int
}

func (r *seqRand) IntN(n int) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.vals) == 0 {
		return 0
	}
	v := r.vals[0]
	r.vals = r.vals[1:]
	return v % n
}

// mkw returns an available worker named name (URL http://name:8000).
func mkw(name string) *workers.Worker {
	w := &workers.Worker{ID: name, URL: "http://" + name + ":8000", BaseURL: "http://" + name + ":8000", Runtime: "sglang"}
	w.SetHealthy(true)
	return w
}

func mkws(names ...string) []*workers.Worker {
	out := make([]*workers.Worker, len(names))
	for i, n := range names {
		out[i] = mkw(n)
	}
	return out
}

// setLoad raises w's in-flight count to n (it only ever grows in tests).
func setLoad(t testing.TB, w *workers.Worker, n int64) {
	t.Helper()
	require.GreaterOrEqual(t, n, w.Load())
	for w.Load() < n {
		w.Acquire()
	}
}

// staticLoads is a LoadSource over a fixed map.
type staticLoads struct {
	mu sync.Mutex
	m  map[*workers.Worker]EngineLoad
}

func (s *staticLoads) EngineLoad(w *workers.Worker) (EngineLoad, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	l, ok := s.m[w]
	return l, ok
}

func (s *staticLoads) set(w *workers.Worker, l EngineLoad) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.m == nil {
		s.m = map[*workers.Worker]EngineLoad{}
	}
	s.m[w] = l
}

func build(t testing.TB, name string, o Options, d Deps) Policy {
	t.Helper()
	p, err := Build(name, LegPrefill, o, d)
	require.NoError(t, err)
	return p
}
