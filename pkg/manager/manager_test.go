package manager

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/smg-project/smg-extproc/pkg/workers"
)

const (
	waitFor = 2 * time.Second
	tick    = 5 * time.Millisecond
)

func intp(n int) *int { return &n }

// resolveLiteral resolves every host to a fixed address, so tests need no DNS.
func resolveLiteral(host string) ([]string, error) {
	if host == "unresolvable" {
		return nil, errors.New("no such host")
	}
	return []string{"10.0.0.1"}, nil
}

// hookRecorder counts hook calls and can hold Detect until released.
type hookRecorder struct {
	mu        sync.Mutex
	detected  []string
	attached  []*workers.Worker
	stopped   []*workers.Worker
	runtime   string
	detectErr error
	gate      chan struct{} // when non-nil, Detect waits for it
}

func (h *hookRecorder) hooks() Hooks {
	return Hooks{
		Detect: func(ctx context.Context, baseURL, apiKey string) (string, error) {
			h.mu.Lock()
			h.detected = append(h.detected, baseURL)
			gate := h.gate
			h.mu.Unlock()
			if gate != nil {
				select {
				case <-gate:
				case <-ctx.Done():
					return "", ctx.Err()
				}
			}
			return h.runtime, h.detectErr
		},
		Attach: func(w *workers.Worker) func() {
			h.mu.Lock()
			h.attached = append(h.attached, w)
			h.mu.Unlock()
			w.SetStatus(workers.StatusReady)
			return func() {
				h.mu.Lock()
				h.stopped = append(h.stopped, w)
				h.mu.Unlock()
			}
		},
	}
}

func (h *hookRecorder) counts() (detected, attached, stopped int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.detected), len(h.attached), len(h.stopped)
}

func (h *hookRecorder) wasStopped(w *workers.Worker) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, x := range h.stopped {
		if x == w {
			return true
		}
	}
	return false
}

func newManager(t *testing.T, h Hooks) (*Manager, *workers.Registry) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	reg := workers.NewRegistry()
	m := New(ctx, reg, zerolog.Nop(), h)
	m.Resolve = resolveLiteral
	m.DrainTimeout = 2 * time.Second
	t.Cleanup(func() {
		cancel()
		m.Wait()
	})
	return m, reg
}

func registered(reg *workers.Registry, url string) func() bool {
	return func() bool { _, ok := reg.FindURL(url); return ok }
}

func TestValidate(t *testing.T) {
	tests := []struct {
		name    string
		spec    workers.Spec
		wantErr string
	}{
		{"prefill ok", workers.Spec{URL: "http://p:1", Type: workers.Prefill}, ""},
		{"decode ok", workers.Spec{URL: "http://d:1", Type: workers.Decode}, ""},
		{"regular ok", workers.Spec{URL: "http://r:1", Type: workers.Regular}, ""},
		{"bootstrap port ok", workers.Spec{URL: "http://p:1", Type: workers.Prefill, BootstrapPort: intp(8998)}, ""},
		{"encode refused", workers.Spec{URL: "http://e:1", Type: "encode"}, "encode workers"},
		{"empty type refused", workers.Spec{URL: "http://x:1"}, "worker_type must be"},
		{"unknown type refused", workers.Spec{URL: "http://x:1", Type: "mixed"}, `got "mixed"`},
		{"empty url", workers.Spec{URL: " ", Type: workers.Decode}, "url is required"},
		{"grpc url", workers.Spec{URL: "grpc://d:1", Type: workers.Decode}, "grpc:// workers"},
		{"bootstrap port zero", workers.Spec{URL: "http://p:1", Type: workers.Prefill, BootstrapPort: intp(0)}, "bootstrap_port 0 out of range"},
		{"bootstrap port too large", workers.Spec{URL: "http://p:1", Type: workers.Prefill, BootstrapPort: intp(70000)}, "out of range"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := Validate(tc.spec)
			if tc.wantErr == "" {
				assert.NoError(t, err)
				return
			}
			require.Error(t, err)
			assert.ErrorIs(t, err, ErrBadRequest)
			assert.Contains(t, err.Error(), tc.wantErr)
		})
	}
}

func TestErrorMapping(t *testing.T) {
	tests := []struct {
		name    string
		err     error
		status  int
		code    string
		message string
	}{
		{"plain error", errors.New("x"), http.StatusInternalServerError, "INTERNAL_ERROR", "x"},
		{"wrapped bad request", wrap(ErrBadRequest, "url is required"), http.StatusBadRequest, "BAD_REQUEST", "url is required"},
		{"exists", wrap(ErrExists, "Worker already exists"), http.StatusConflict, "WORKER_ALREADY_EXISTS", "Worker already exists"},
		{"not found", wrap(ErrNotFound, "Worker not found: x"), http.StatusNotFound, "WORKER_NOT_FOUND", "Worker not found: x"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, tc.status, StatusFor(tc.err))
			assert.Equal(t, tc.code, CodeFor(tc.err))
			assert.Equal(t, tc.message, Message(tc.err))
		})
	}
}

func wrap(kind error, msg string) error { return fmt.Errorf("%w: %s", kind, msg) }

func TestSubmit(t *testing.T) {
	t.Run("async registration with detection and attach", func(t *testing.T) {
		h := &hookRecorder{runtime: "vllm", gate: make(chan struct{})}
		m, reg := newManager(t, h.hooks())

		id, err := m.Submit(workers.Spec{URL: "http://decode-a:8000", Type: workers.Decode})
		require.NoError(t, err)
		assert.Len(t, id, 36)

		// Pending is visible while detection is held.
		job, ok := m.Pending(id)
		require.True(t, ok)
		assert.Equal(t, "AddWorker", job.Type)
		assert.Equal(t, "http://decode-a:8000", job.URL)
		assert.Equal(t, "pending", job.Status)
		assert.False(t, job.Timestamp.IsZero())
		_, inReg := reg.Get(id)
		assert.False(t, inReg, "not registered before the job finishes")

		// A second submission of the same URL is refused while pending.
		_, err = m.Submit(workers.Spec{URL: "http://decode-a:8000", Type: workers.Decode})
		require.ErrorIs(t, err, ErrExists)
		assert.Contains(t, err.Error(), "registration pending")

		close(h.gate)
		require.Eventually(t, registered(reg, "http://decode-a:8000"), waitFor, tick)
		m.Wait()

		w, ok := reg.Get(id)
		require.True(t, ok, "registered under the id Submit returned")
		assert.Equal(t, "vllm", w.Runtime, "detected runtime applied")
		d, a, _ := h.counts()
		assert.Equal(t, 1, d)
		assert.Equal(t, 1, a)
		assert.True(t, w.Healthy())
		_, ok = m.Pending(id)
		assert.False(t, ok, "no pending job after completion")

		_, err = m.Submit(workers.Spec{URL: "http://decode-a:8000", Type: workers.Decode})
		require.ErrorIs(t, err, ErrExists)
		assert.Contains(t, err.Error(), id)
	})

	t.Run("explicit runtime skips detection", func(t *testing.T) {
		h := &hookRecorder{runtime: "vllm"}
		m, reg := newManager(t, h.hooks())
		id, err := m.Submit(workers.Spec{URL: "http://p:8000", Type: workers.Prefill, Runtime: "sglang"})
		require.NoError(t, err)
		m.Wait()
		w, ok := reg.Get(id)
		require.True(t, ok)
		assert.Equal(t, "sglang", w.Runtime)
		d, a, _ := h.counts()
		assert.Equal(t, 0, d, "Detect not called when the runtime is given")
		assert.Equal(t, 1, a)
	})

	t.Run("detection failure assumes sglang", func(t *testing.T) {
		h := &hookRecorder{detectErr: errors.New("unreachable")}
		m, reg := newManager(t, h.hooks())
		id, err := m.Submit(workers.Spec{URL: "http://p:8000", Type: workers.Prefill})
		require.NoError(t, err)
		m.Wait()
		w, ok := reg.Get(id)
		require.True(t, ok)
		assert.Equal(t, "sglang", w.Runtime)
	})

	t.Run("no hooks: worker is ready at once", func(t *testing.T) {
		m, reg := newManager(t, Hooks{})
		sub := reg.Subscribe()
		id, err := m.Submit(workers.Spec{URL: "http://d:8000", Type: workers.Decode})
		require.NoError(t, err)
		m.Wait()
		w, ok := reg.Get(id)
		require.True(t, ok)
		assert.True(t, w.Healthy())
		select {
		case <-sub:
		default:
			t.Fatal("registration not signalled")
		}
	})

	t.Run("refusals", func(t *testing.T) {
		tests := []struct {
			name    string
			spec    workers.Spec
			kind    error
			wantErr string
		}{
			{"bad type", workers.Spec{URL: "http://d:1", Type: "encode"}, ErrBadRequest, "encode"},
			{"bad url", workers.Spec{URL: "http://d:1/path", Type: workers.Decode}, ErrBadRequest, "scheme://host:port"},
			{"ipc", workers.Spec{URL: "ipc:///tmp/d", Type: workers.Decode}, ErrBadRequest, "PD legs"},
			{"unresolvable", workers.Spec{URL: "http://unresolvable:1", Type: workers.Decode}, ErrBadRequest, "no such host"},
		}
		for _, tc := range tests {
			t.Run(tc.name, func(t *testing.T) {
				h := &hookRecorder{}
				m, reg := newManager(t, h.hooks())
				_, err := m.Submit(tc.spec)
				require.ErrorIs(t, err, tc.kind)
				assert.Contains(t, err.Error(), tc.wantErr)
				m.Wait()
				assert.Empty(t, reg.Snapshot())
				d, a, _ := h.counts()
				assert.Zero(t, d+a, "no hooks run for a refused spec")
			})
		}
	})
}

func TestAddNow(t *testing.T) {
	h := &hookRecorder{runtime: "vllm"}
	m, reg := newManager(t, h.hooks())
	w, err := m.AddNow(workers.Spec{URL: "http://d:8000", Type: workers.Decode})
	require.NoError(t, err)
	got, ok := reg.Get(w.ID)
	require.True(t, ok, "registered synchronously")
	assert.Same(t, w, got)
	assert.Equal(t, "vllm", w.Runtime)

	_, err = m.AddNow(workers.Spec{URL: "http://d:8000", Type: workers.Decode})
	require.ErrorIs(t, err, ErrExists)
	_, err = m.AddNow(workers.Spec{URL: "ftp://d:8000", Type: workers.Decode})
	require.ErrorIs(t, err, ErrBadRequest)
}

func TestRemove(t *testing.T) {
	t.Run("waits for in-flight requests", func(t *testing.T) {
		h := &hookRecorder{}
		m, reg := newManager(t, h.hooks())
		w, err := m.AddNow(workers.Spec{URL: "http://d:8000", Type: workers.Decode})
		require.NoError(t, err)
		release := w.Acquire()
		sub := reg.Subscribe()

		require.NoError(t, m.Remove(w.ID))
		assert.True(t, w.Draining(), "draining at once")
		assert.False(t, w.Available())
		select {
		case <-sub:
		default:
			t.Fatal("draining not republished")
		}

		// Still registered while a request is in flight.
		time.Sleep(150 * time.Millisecond)
		_, ok := reg.Get(w.ID)
		assert.True(t, ok, "kept while load > 0")
		assert.False(t, h.wasStopped(w))

		release()
		require.Eventually(t, func() bool { _, ok := reg.Get(w.ID); return !ok }, waitFor, tick)
		m.Wait()
		assert.True(t, h.wasStopped(w), "attach stop called on removal")
	})

	t.Run("drain timeout removes anyway", func(t *testing.T) {
		h := &hookRecorder{}
		m, reg := newManager(t, h.hooks())
		m.DrainTimeout = 100 * time.Millisecond
		w, err := m.AddNow(workers.Spec{URL: "http://d:8000", Type: workers.Decode})
		require.NoError(t, err)
		defer w.Acquire()() // never released during the test

		start := time.Now()
		require.NoError(t, m.Remove(w.ID))
		require.Eventually(t, func() bool { _, ok := reg.Get(w.ID); return !ok }, waitFor, tick)
		assert.GreaterOrEqual(t, time.Since(start), 100*time.Millisecond)
		m.Wait()
		assert.True(t, h.wasStopped(w))
	})

	t.Run("idle worker removed promptly", func(t *testing.T) {
		m, reg := newManager(t, Hooks{})
		w, err := m.AddNow(workers.Spec{URL: "http://d:8000", Type: workers.Decode})
		require.NoError(t, err)
		require.NoError(t, m.Remove(w.ID))
		m.Wait()
		_, ok := reg.Get(w.ID)
		assert.False(t, ok)
	})

	t.Run("unknown id", func(t *testing.T) {
		m, _ := newManager(t, Hooks{})
		err := m.Remove(workers.NewID())
		require.ErrorIs(t, err, ErrNotFound)
		assert.Equal(t, http.StatusNotFound, StatusFor(err))
	})

	t.Run("RemoveNow is synchronous", func(t *testing.T) {
		h := &hookRecorder{}
		m, reg := newManager(t, h.hooks())
		w, err := m.AddNow(workers.Spec{URL: "http://d:8000", Type: workers.Decode})
		require.NoError(t, err)
		m.RemoveNow(w)
		_, ok := reg.Get(w.ID)
		assert.False(t, ok)
		assert.True(t, h.wasStopped(w))
	})
}

func TestReplace(t *testing.T) {
	tests := []struct {
		name    string
		spec    func(old *workers.Worker) workers.Spec
		kind    error
		wantErr string
		check   func(t *testing.T, old, nw *workers.Worker)
	}{
		{
			name: "keeps id and position, applies new fields",
			spec: func(old *workers.Worker) workers.Spec {
				return workers.Spec{URL: old.URL, Type: workers.Decode, Labels: map[string]string{"zone": "b"}, DPSize: intp(2)}
			},
			check: func(t *testing.T, old, nw *workers.Worker) {
				assert.Equal(t, old.ID, nw.ID)
				assert.NotSame(t, old, nw)
				assert.Equal(t, map[string]string{"zone": "b"}, nw.Labels)
				assert.Equal(t, intp(2), nw.DPSize)
				assert.Equal(t, "vllm", nw.Runtime, "runtime kept when the spec has none")
				assert.Equal(t, old.Status(), nw.Status())
			},
		},
		{
			name: "explicit runtime replaces the old one",
			spec: func(old *workers.Worker) workers.Spec {
				return workers.Spec{URL: old.URL, Type: workers.Decode, Runtime: "sglang"}
			},
			check: func(t *testing.T, old, nw *workers.Worker) { assert.Equal(t, "sglang", nw.Runtime) },
		},
		{
			name: "URL change rejected",
			spec: func(old *workers.Worker) workers.Spec {
				return workers.Spec{URL: "http://other:8000", Type: workers.Decode}
			},
			kind:    ErrBadRequest,
			wantErr: "does not match",
		},
		{
			name:    "invalid spec rejected",
			spec:    func(old *workers.Worker) workers.Spec { return workers.Spec{URL: old.URL, Type: "encode"} },
			kind:    ErrBadRequest,
			wantErr: "encode",
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h := &hookRecorder{runtime: "vllm"}
			m, reg := newManager(t, h.hooks())
			first, err := m.AddNow(workers.Spec{URL: "http://first:8000", Type: workers.Decode})
			require.NoError(t, err)
			old, err := m.AddNow(workers.Spec{URL: "http://d:8000", Type: workers.Decode, Labels: map[string]string{"zone": "a"}})
			require.NoError(t, err)

			err = m.Replace(old.ID, tc.spec(old))
			if tc.kind != nil {
				require.ErrorIs(t, err, tc.kind)
				assert.Contains(t, err.Error(), tc.wantErr)
				cur, ok := reg.Get(old.ID)
				require.True(t, ok)
				assert.Same(t, old, cur, "nothing changed")
				assert.False(t, h.wasStopped(old))
				return
			}
			require.NoError(t, err)
			nw, ok := reg.Get(old.ID)
			require.True(t, ok)
			snap := reg.Snapshot()
			require.Len(t, snap, 2)
			assert.Same(t, first, snap[0])
			assert.Same(t, nw, snap[1], "position kept")
			assert.True(t, h.wasStopped(old), "old machinery stopped")
			_, a, _ := h.counts()
			assert.Equal(t, 3, a, "new record attached")
			tc.check(t, old, nw)
		})
	}

	t.Run("unknown id", func(t *testing.T) {
		m, _ := newManager(t, Hooks{})
		err := m.Replace(workers.NewID(), workers.Spec{URL: "http://d:8000", Type: workers.Decode})
		require.ErrorIs(t, err, ErrNotFound)
	})
}

func urls(reg *workers.Registry) []string {
	var out []string
	for _, w := range reg.Snapshot() {
		out = append(out, w.URL)
	}
	sort.Strings(out)
	return out
}

func TestSync(t *testing.T) {
	var attached atomic.Int32
	h := &hookRecorder{}
	hooks := h.hooks()
	inner := hooks.Attach
	hooks.Attach = func(w *workers.Worker) func() { attached.Add(1); return inner(w) }
	m, reg := newManager(t, hooks)

	// Registered through the API: never touched by Sync.
	apiID, err := m.Submit(workers.Spec{URL: "http://api:8000", Type: workers.Decode})
	require.NoError(t, err)
	m.Wait()
	api, ok := reg.Get(apiID)
	require.True(t, ok)

	a := workers.Spec{URL: "http://a:8000", Type: workers.Prefill, BootstrapPort: intp(8998)}
	b := workers.Spec{URL: "http://b:8000", Type: workers.Decode}
	c := workers.Spec{URL: "http://c:8000", Type: workers.Decode}

	steps := []struct {
		name  string
		specs []workers.Spec
		want  []string
		check func(t *testing.T)
	}{
		{
			name:  "adds config workers",
			specs: []workers.Spec{a, b},
			want:  []string{"http://a:8000", "http://api:8000", "http://b:8000"},
		},
		{
			name:  "unchanged config is a no-op",
			specs: []workers.Spec{b, a},
			want:  []string{"http://a:8000", "http://api:8000", "http://b:8000"},
			check: func(t *testing.T) {
				_, at, _ := h.counts()
				assert.Equal(t, 3, at, "nothing re-attached")
			},
		},
		{
			name: "replaces changed, removes dropped, adds new",
			specs: []workers.Spec{
				{URL: "http://a:8000", Type: workers.Prefill, BootstrapPort: intp(9000)},
				c,
			},
			want: []string{"http://a:8000", "http://api:8000", "http://c:8000"},
			check: func(t *testing.T) {
				w, ok := reg.FindURL("http://a:8000")
				require.True(t, ok)
				assert.Equal(t, intp(9000), w.BootstrapPort)
			},
		},
		{
			name:  "empty config removes every config worker",
			specs: nil,
			want:  []string{"http://api:8000"},
		},
	}
	var aID string
	for i, st := range steps {
		ok := t.Run(st.name, func(t *testing.T) {
			m.Sync(st.specs)
			m.Wait()
			assert.Equal(t, st.want, urls(reg))
			if st.check != nil {
				st.check(t)
			}
			cur, ok := reg.Get(apiID)
			require.True(t, ok, "API worker kept")
			assert.Same(t, api, cur, "API worker never replaced")
			assert.False(t, api.Draining())
			if i == 0 {
				w, _ := reg.FindURL("http://a:8000")
				aID = w.ID
			}
			if i == 2 {
				w, _ := reg.FindURL("http://a:8000")
				assert.Equal(t, aID, w.ID, "a replaced worker keeps its id")
			}
		})
		require.True(t, ok)
	}
	assert.False(t, h.wasStopped(api))
}

func TestSyncAdoptsExistingURL(t *testing.T) {
	m, reg := newManager(t, Hooks{})
	id, err := m.Submit(workers.Spec{URL: "http://x:8000", Type: workers.Decode})
	require.NoError(t, err)
	m.Wait()
	w, _ := reg.Get(id)

	// Listed by the config with the same URL: left as it is (not replaced)...
	m.Sync([]workers.Spec{{URL: "http://x:8000", Type: workers.Decode, Labels: map[string]string{"k": "v"}}})
	m.Wait()
	cur, ok := reg.Get(id)
	require.True(t, ok)
	assert.Same(t, w, cur)

	// ...but from then on the config owns it.
	m.Sync(nil)
	m.Wait()
	_, ok = reg.Get(id)
	assert.False(t, ok, "the config owns a worker it listed")
}

func TestSyncSkipsInvalidSpecs(t *testing.T) {
	m, reg := newManager(t, Hooks{})
	m.Sync([]workers.Spec{
		{URL: "http://ok:8000", Type: workers.Decode},
		{URL: "grpc://bad:8000", Type: workers.Decode},
		{URL: "http://bad:8000/path", Type: workers.Decode},
	})
	m.Wait()
	assert.Equal(t, []string{"http://ok:8000"}, urls(reg))
}
