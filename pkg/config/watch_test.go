package config

import (
	"context"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// watchRecorder collects Watch callbacks safely across goroutines.
type watchRecorder struct {
	mu      sync.Mutex
	changes []*File
	errs    []error
}

func (r *watchRecorder) onChange(f *File) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.changes = append(r.changes, f)
}

func (r *watchRecorder) onError(err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.errs = append(r.errs, err)
}

func (r *watchRecorder) last() (*File, int, []error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	var f *File
	if len(r.changes) > 0 {
		f = r.changes[len(r.changes)-1]
	}
	return f, len(r.changes), append([]error(nil), r.errs...)
}

func startWatch(t *testing.T, path string) *watchRecorder {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	r := &watchRecorder{}
	require.NoError(t, Watch(ctx, path, r.onChange, r.onError))
	return r
}

const (
	watchWait = 3 * time.Second
	watchTick = 10 * time.Millisecond
)

func TestWatch(t *testing.T) {
	tests := []struct {
		name   string
		update func(t *testing.T, path string)
		check  func(t *testing.T, r *watchRecorder)
	}{
		{
			name: "write in place",
			update: func(t *testing.T, path string) {
				require.NoError(t, os.WriteFile(path, []byte("decode: [http://d2:8000]\n"), 0o644))
			},
			check: func(t *testing.T, r *watchRecorder) {
				require.Eventually(t, func() bool {
					f, _, _ := r.last()
					return f != nil && len(f.Workers) == 1 && f.Workers[0].URL == "http://d2:8000"
				}, watchWait, watchTick)
			},
		},
		{
			name: "atomic rename over the file",
			update: func(t *testing.T, path string) {
				tmp := filepath.Join(filepath.Dir(path), ".smg.yaml.tmp")
				require.NoError(t, os.WriteFile(tmp, []byte("decode: [http://d3:8000]\n"), 0o644))
				require.NoError(t, os.Rename(tmp, path))
			},
			check: func(t *testing.T, r *watchRecorder) {
				require.Eventually(t, func() bool {
					f, _, _ := r.last()
					return f != nil && len(f.Workers) == 1 && f.Workers[0].URL == "http://d3:8000"
				}, watchWait, watchTick)
			},
		},
		{
			name: "invalid file reports an error",
			update: func(t *testing.T, path string) {
				require.NoError(t, os.WriteFile(path, []byte("bogus_key: 1\n"), 0o644))
			},
			check: func(t *testing.T, r *watchRecorder) {
				require.Eventually(t, func() bool {
					_, _, errs := r.last()
					return len(errs) > 0
				}, watchWait, watchTick)
				_, n, errs := r.last()
				assert.Equal(t, 0, n, "an invalid file is not applied")
				assert.ErrorContains(t, errs[0], "unknown setting")
			},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			path := writeFile(t, dir, "smg.yaml", "decode: [http://d1:8000]\n")
			r := startWatch(t, path)
			tc.update(t, path)
			tc.check(t, r)
		})
	}
}

func TestWatchIgnoresOtherFiles(t *testing.T) {
	dir := t.TempDir()
	path := writeFile(t, dir, "smg.yaml", "decode: [http://d1:8000]\n")
	r := startWatch(t, path)

	writeFile(t, dir, "other.yaml", "bogus: 1\n")
	// Then a real change, so the test knows the watcher is running.
	require.NoError(t, os.WriteFile(path, []byte("decode: [http://d9:8000]\n"), 0o644))
	require.Eventually(t, func() bool {
		f, _, _ := r.last()
		return f != nil && f.Workers[0].URL == "http://d9:8000"
	}, watchWait, watchTick)
	_, _, errs := r.last()
	assert.Empty(t, errs, "a neighbouring file is not loaded")
}

func TestWatchRecoversAfterInvalidFile(t *testing.T) {
	dir := t.TempDir()
	path := writeFile(t, dir, "smg.yaml", "decode: [http://d1:8000]\n")
	r := startWatch(t, path)

	require.NoError(t, os.WriteFile(path, []byte("policy: [\n"), 0o644))
	require.Eventually(t, func() bool { _, _, errs := r.last(); return len(errs) > 0 }, watchWait, watchTick)

	require.NoError(t, os.WriteFile(path, []byte("decode: [http://d5:8000]\n"), 0o644))
	require.Eventually(t, func() bool {
		f, _, _ := r.last()
		return f != nil && f.Workers[0].URL == "http://d5:8000"
	}, watchWait, watchTick)
}

func TestWatchMissingDir(t *testing.T) {
	err := Watch(context.Background(), filepath.Join(t.TempDir(), "absent", "smg.yaml"), func(*File) {}, func(error) {})
	require.ErrorContains(t, err, "watch config dir")
}

func TestWatchStopsWithContext(t *testing.T) {
	dir := t.TempDir()
	path := writeFile(t, dir, "smg.yaml", "decode: [http://d1:8000]\n")
	ctx, cancel := context.WithCancel(context.Background())
	r := &watchRecorder{}
	require.NoError(t, Watch(ctx, path, r.onChange, r.onError))
	cancel()
	time.Sleep(50 * time.Millisecond) // let the goroutine see ctx.Done
	require.NoError(t, os.WriteFile(path, []byte("decode: [http://d2:8000]\n"), 0o644))
	time.Sleep(300 * time.Millisecond) // longer than the 150 ms coalescing delay
	_, n, errs := r.last()
	assert.Equal(t, 0, n)
	assert.Empty(t, errs)
}
