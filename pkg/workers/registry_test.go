package workers

import (
	"errors"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func mustWorker(t *testing.T, url string, typ Type) *Worker {
	t.Helper()
	w, err := New(Spec{URL: url, Type: typ}, newStub().resolve)
	require.NoError(t, err)
	return w
}

func urlsOf(ws []*Worker) []string {
	out := make([]string, len(ws))
	for i, w := range ws {
		out[i] = w.URL
	}
	return out
}

func TestRegistryAddRemove(t *testing.T) {
	r := NewRegistry()
	require.NotNil(t, r.Snapshot())
	assert.Empty(t, r.Snapshot())

	a := mustWorker(t, "http://10.0.0.1:8000", Prefill)
	b := mustWorker(t, "http://10.0.0.2:8000", Decode)
	c := mustWorker(t, "http://10.0.0.3:8000", Decode)
	for _, w := range []*Worker{a, b, c} {
		require.NoError(t, r.Add(w))
	}
	assert.Equal(t, []string{a.URL, b.URL, c.URL}, urlsOf(r.Snapshot()), "registration order")

	t.Run("duplicate URL", func(t *testing.T) {
		dup := mustWorker(t, a.URL, Decode)
		err := r.Add(dup)
		require.Error(t, err)
		var ee *ErrExists
		require.True(t, errors.As(err, &ee))
		assert.Same(t, a, ee.Existing)
		assert.Contains(t, err.Error(), a.URL)
		assert.Contains(t, err.Error(), a.ID)
		assert.Len(t, r.Snapshot(), 3)
	})

	t.Run("get and find", func(t *testing.T) {
		tests := []struct {
			name string
			got  func() (*Worker, bool)
			want *Worker
		}{
			{"get a", func() (*Worker, bool) { return r.Get(a.ID) }, a},
			{"get c", func() (*Worker, bool) { return r.Get(c.ID) }, c},
			{"get unknown", func() (*Worker, bool) { return r.Get(NewID()) }, nil},
			{"find b", func() (*Worker, bool) { return r.FindURL(b.URL) }, b},
			{"find unknown", func() (*Worker, bool) { return r.FindURL("http://10.9.9.9:1") }, nil},
		}
		for _, tc := range tests {
			t.Run(tc.name, func(t *testing.T) {
				w, ok := tc.got()
				assert.Equal(t, tc.want != nil, ok)
				assert.Same(t, tc.want, w)
			})
		}
	})

	t.Run("by type", func(t *testing.T) {
		assert.Equal(t, []string{a.URL}, urlsOf(ByType(r.Snapshot(), Prefill)))
		assert.Equal(t, []string{b.URL, c.URL}, urlsOf(ByType(r.Snapshot(), Decode)))
		assert.Empty(t, ByType(r.Snapshot(), Regular))
	})

	t.Run("remove", func(t *testing.T) {
		assert.True(t, r.Remove(b.ID))
		assert.False(t, r.Remove(b.ID), "second remove reports absence")
		assert.Equal(t, []string{a.URL, c.URL}, urlsOf(r.Snapshot()))
		_, ok := r.Get(b.ID)
		assert.False(t, ok)
		// The URL is free again.
		require.NoError(t, r.Add(mustWorker(t, b.URL, Decode)))
		assert.Equal(t, []string{a.URL, c.URL, b.URL}, urlsOf(r.Snapshot()))
	})
}

func TestRegistryReplace(t *testing.T) {
	r := NewRegistry()
	a := mustWorker(t, "http://10.0.0.1:8000", Decode)
	b := mustWorker(t, "http://10.0.0.2:8000", Decode)
	require.NoError(t, r.Add(a))
	require.NoError(t, r.Add(b))

	nw := mustWorker(t, a.URL, Decode)
	nw.ID = a.ID
	nw.Labels = map[string]string{"v": "2"}
	require.True(t, r.Replace(a, nw))
	snap := r.Snapshot()
	require.Len(t, snap, 2)
	assert.Same(t, nw, snap[0], "replacement keeps the position")
	assert.Same(t, b, snap[1])
	got, ok := r.Get(a.ID)
	require.True(t, ok)
	assert.Same(t, nw, got)

	assert.False(t, r.Replace(a, mustWorker(t, a.URL, Decode)), "the old record is no longer registered")
	assert.False(t, r.Replace(mustWorker(t, "http://10.0.0.3:1", Decode), nw))
}

func TestRegistrySnapshotImmutable(t *testing.T) {
	r := NewRegistry()
	a := mustWorker(t, "http://10.0.0.1:8000", Decode)
	b := mustWorker(t, "http://10.0.0.2:8000", Decode)
	c := mustWorker(t, "http://10.0.0.3:8000", Decode)
	require.NoError(t, r.Add(a))
	require.NoError(t, r.Add(b))

	before := r.Snapshot()
	require.NoError(t, r.Add(c))
	require.True(t, r.Remove(a.ID))
	nb := mustWorker(t, b.URL, Decode)
	require.True(t, r.Replace(b, nb))

	assert.Equal(t, []*Worker{a, b}, before, "an old snapshot never changes")
	assert.Equal(t, []*Worker{nb, c}, r.Snapshot())

	mid := r.Snapshot()
	require.True(t, r.Remove(nb.ID))
	assert.Equal(t, []*Worker{nb, c}, mid)
	assert.Equal(t, []*Worker{c}, r.Snapshot())
}

func TestRegistrySubscribe(t *testing.T) {
	tests := []struct {
		name   string
		change func(t *testing.T, r *Registry, seed *Worker)
	}{
		{"add", func(t *testing.T, r *Registry, _ *Worker) {
			require.NoError(t, r.Add(mustWorker(t, "http://10.0.0.9:1", Decode)))
		}},
		{"remove", func(t *testing.T, r *Registry, seed *Worker) { require.True(t, r.Remove(seed.ID)) }},
		{"replace", func(t *testing.T, r *Registry, seed *Worker) {
			require.True(t, r.Replace(seed, mustWorker(t, seed.URL, Decode)))
		}},
		{"changed", func(t *testing.T, r *Registry, _ *Worker) { r.Changed() }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r := NewRegistry()
			seed := mustWorker(t, "http://10.0.0.1:1", Decode)
			require.NoError(t, r.Add(seed))
			ch := r.Subscribe()
			select {
			case <-ch:
				t.Fatal("a new subscription has no pending signal")
			default:
			}
			tc.change(t, r, seed)
			select {
			case <-ch:
			default:
				t.Fatal("change not signalled")
			}
		})
	}

	t.Run("no signal for failed operations", func(t *testing.T) {
		r := NewRegistry()
		a := mustWorker(t, "http://10.0.0.1:1", Decode)
		require.NoError(t, r.Add(a))
		ch := r.Subscribe()
		require.Error(t, r.Add(mustWorker(t, a.URL, Decode)))
		assert.False(t, r.Remove(NewID()))
		assert.False(t, r.Replace(mustWorker(t, "http://10.0.0.2:1", Decode), a))
		select {
		case <-ch:
			t.Fatal("unexpected signal")
		default:
		}
	})

	t.Run("coalescing and never blocking", func(t *testing.T) {
		r := NewRegistry()
		ch1 := r.Subscribe()
		ch2 := r.Subscribe() // never read until the end
		done := make(chan struct{})
		go func() {
			defer close(done)
			for i := 0; i < 500; i++ {
				r.Changed()
			}
		}()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			t.Fatal("publishing blocked on an unread subscriber")
		}
		n := 0
		for {
			select {
			case <-ch1:
				n++
				continue
			default:
			}
			break
		}
		assert.Equal(t, 1, n, "500 changes coalesce into one pending signal")
		select {
		case <-ch2:
		default:
			t.Fatal("second subscriber not signalled")
		}
	})

	t.Run("concurrent reader sees the last state", func(t *testing.T) {
		r := NewRegistry()
		ch := r.Subscribe()
		var wg sync.WaitGroup
		for i := 0; i < 20; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				w, err := New(Spec{URL: "http://10.0.1." + strconv.Itoa(i+1) + ":8000", Type: Decode}, newStub().resolve)
				if err == nil {
					_ = r.Add(w)
				}
			}()
		}
		wg.Wait()
		<-ch
		assert.Len(t, r.Snapshot(), 20)
	})
}

func TestWorkerStatus(t *testing.T) {
	tests := []struct {
		name          string
		setup         func(w *Worker)
		wantStatus    Status
		wantHealthy   bool
		wantAvailable bool
	}{
		{"new", func(w *Worker) {}, StatusPending, false, false},
		{"ready", func(w *Worker) { w.SetStatus(StatusReady) }, StatusReady, true, true},
		{"not ready", func(w *Worker) { w.SetStatus(StatusNotReady) }, StatusNotReady, false, false},
		{"failed", func(w *Worker) { w.SetStatus(StatusFailed) }, StatusFailed, false, false},
		{"set healthy", func(w *Worker) { w.SetHealthy(true) }, StatusReady, true, true},
		{"set unhealthy", func(w *Worker) { w.SetHealthy(true); w.SetHealthy(false) }, StatusNotReady, false, false},
		{"unknown status ignored", func(w *Worker) { w.SetStatus(StatusReady); w.SetStatus("bogus") }, StatusReady, true, true},
		{"draining ready worker", func(w *Worker) { w.SetStatus(StatusReady); w.SetDraining() }, StatusReady, true, false},
		{"breaker open", func(w *Worker) { w.SetStatus(StatusReady); w.Allow = func() bool { return false } }, StatusReady, true, false},
		{"breaker closed", func(w *Worker) { w.SetStatus(StatusReady); w.Allow = func() bool { return true } }, StatusReady, true, true},
		{"breaker not consulted when unhealthy", func(w *Worker) {
			w.SetStatus(StatusNotReady)
			w.Allow = func() bool { panic("Allow must not be called for an unhealthy worker") }
		}, StatusNotReady, false, false},
		{"breaker not consulted when draining", func(w *Worker) {
			w.SetStatus(StatusReady)
			w.SetDraining()
			w.Allow = func() bool { panic("Allow must not be called for a draining worker") }
		}, StatusReady, true, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			w := mustWorker(t, "http://10.0.0.1:8000", Decode)
			tc.setup(w)
			assert.Equal(t, tc.wantStatus, w.Status())
			assert.Equal(t, tc.wantHealthy, w.Healthy())
			assert.Equal(t, tc.wantAvailable, w.Available())
		})
	}

	t.Run("draining flag", func(t *testing.T) {
		w := mustWorker(t, "http://10.0.0.1:8000", Decode)
		assert.False(t, w.Draining())
		w.SetDraining()
		assert.True(t, w.Draining())
	})
}

func TestWorkerRecord(t *testing.T) {
	w := mustWorker(t, "http://10.0.0.1:8000", Decode)
	w.Record(500, false) // no breaker: no-op, no panic
	var got []int
	var transport []bool
	w.Outcome = func(status int, te bool) { got = append(got, status); transport = append(transport, te) }
	w.Record(503, false)
	w.Record(0, true)
	assert.Equal(t, []int{503, 0}, got)
	assert.Equal(t, []bool{false, true}, transport)
}

func TestWorkerAcquire(t *testing.T) {
	w := mustWorker(t, "http://10.0.0.1:8000", Decode)
	assert.Equal(t, int64(0), w.Load())
	r1 := w.Acquire()
	r2 := w.Acquire()
	assert.Equal(t, int64(2), w.Load())
	r1()
	r1() // idempotent
	r1()
	assert.Equal(t, int64(1), w.Load())
	r2()
	r2()
	assert.Equal(t, int64(0), w.Load())

	t.Run("concurrent", func(t *testing.T) {
		var wg sync.WaitGroup
		var peak atomic.Int64
		for i := 0; i < 50; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				rel := w.Acquire()
				if l := w.Load(); l > peak.Load() {
					peak.Store(l)
				}
				var inner sync.WaitGroup
				for j := 0; j < 3; j++ {
					inner.Add(1)
					go func() { defer inner.Done(); rel() }()
				}
				inner.Wait()
			}()
		}
		wg.Wait()
		assert.Equal(t, int64(0), w.Load(), "every acquire released exactly once")
		assert.GreaterOrEqual(t, peak.Load(), int64(1))
	})
}
