package policy

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/smg-project/smg-extproc/pkg/workers"
)

func load(queued, kv, tp float64) EngineLoad {
	return EngineLoad{QueuedTokens: queued, KVUsage: kv, Throughput: tp, Epoch: 1}
}

func waiting(n int64, kv, tp float64) EngineLoad {
	return EngineLoad{WaitingRequests: n, KVUsage: kv, Throughput: tp, Epoch: 1}
}

func TestLeastLoad(t *testing.T) {
	type wl struct {
		inflight int64
		load     *EngineLoad
	}
	ptr := func(l EngineLoad) *EngineLoad { return &l }
	tests := []struct {
		name  string
		tune  func(*Options)
		ws    []wl
		picks []int // expected successive picks
	}{
		{"queue length decides", nil,
			[]wl{{0, ptr(load(8000, 0.2, 100))}, {0, ptr(load(1000, 0.2, 100))}}, []int{1}},
		{"waiting requests estimate a queue without token counts", nil,
			[]wl{{0, ptr(waiting(8, 0.2, 100))}, {0, ptr(waiting(0, 0.2, 100))}}, []int{1}},
		{"kv pressure decides when queues are empty", nil,
			[]wl{{0, ptr(load(0, 0.8, 100))}, {0, ptr(load(0, 0.1, 100))}}, []int{1}},
		// a: 10.0 s + barrier; b: 20.0 s. After one pick a carries 1024
		// credited tokens: 20.24 s > 20.0 s, so the next pick is b.
		{"since-poll credit water-fills", nil,
			[]wl{{0, ptr(load(1000, 0.2, 100))}, {0, ptr(load(2000, 0.2, 100))}}, []int{0, 1}},
		// a reports an idle queue and hot KV (0.15·0.9/0.1 = 1.35 s); b has
		// no report but 5 in flight: 1.35 + 5·1024/2000 = 3.9 s.
		{"unreported worker scored as drain time", nil,
			[]wl{{0, ptr(load(0, 0.9, 0))}, {5, nil}}, []int{0}},
		{"dark fleet joins the shortest queue", nil,
			[]wl{{5, nil}, {3, nil}}, []int{1}},
		{"waiting cap vetoes the best score", func(o *Options) { o.LeastLoadMaxWaitingReqs = 48; o.LeastLoadKVPressureWeight = 0 },
			[]wl{{0, ptr(waiting(64, 0, 100))}, {0, ptr(load(1_000_000, 0, 100))}}, []int{1}},
		{"waiting cap on every candidate fails selection", func(o *Options) { o.LeastLoadMaxWaitingReqs = 48 },
			[]wl{{0, ptr(waiting(48, 0, 100))}, {0, ptr(waiting(48, 0, 100))}}, []int{NoSelection}},
		{"waiting cap counts since-poll dispatches", func(o *Options) { o.LeastLoadMaxWaitingReqs = 2; o.LeastLoadKVPressureWeight = 0 },
			[]wl{{0, ptr(waiting(1, 0, 100))}, {0, ptr(load(400_000, 0, 100))}}, []int{0, 1}},
		{"waiting cap ignores unreported workers", func(o *Options) { o.LeastLoadMaxWaitingReqs = 1 },
			[]wl{{5, nil}, {0, nil}}, []int{1}},
		{"waiting cap applies to a single candidate", func(o *Options) { o.LeastLoadMaxWaitingReqs = 48 },
			[]wl{{0, ptr(waiting(64, 0, 100))}}, []int{NoSelection}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o := DefaultOptions()
			if tt.tune != nil {
				tt.tune(&o)
			}
			src := &staticLoads{}
			ws := make([]*workers.Worker, len(tt.ws))
			for i, x := range tt.ws {
				ws[i] = mkw(string(rune('a' + i)))
				setLoad(t, ws[i], x.inflight)
				if x.load != nil {
					src.set(ws[i], *x.load)
				}
			}
			p := build(t, "least_load", o, Deps{Loads: src, Rand: SeededRand(1)})
			for k, want := range tt.picks {
				assert.Equal(t, want, p.Pick(ws, Request{}), "pick %d", k)
			}
		})
	}
}

func TestLeastLoadCreditResetsOnNewPoll(t *testing.T) {
	ws := mkws("a", "b")
	src := &staticLoads{}
	src.set(ws[0], load(1000, 0.2, 100))
	src.set(ws[1], load(2000, 0.2, 100))
	p := build(t, "least_load", DefaultOptions(), Deps{Loads: src})
	assert.Equal(t, 0, p.Pick(ws, Request{}))
	assert.Equal(t, 1, p.Pick(ws, Request{}))
	// A fresh poll (new epoch) resets the credit: a wins again.
	l := load(1000, 0.2, 100)
	l.Epoch = 2
	src.set(ws[0], l)
	l = load(2000, 0.2, 100)
	l.Epoch = 2
	src.set(ws[1], l)
	assert.Equal(t, 0, p.Pick(ws, Request{}))
}

func TestLeastLoadTiesSpread(t *testing.T) {
	// Identical workers score equal: reservoir tie-breaking spreads them.
	seen := map[int]bool{}
	for seed := uint64(0); seed < 64 && len(seen) < 3; seed++ {
		ws := mkws("a", "b", "c")
		p := build(t, "least_load", DefaultOptions(), Deps{Rand: SeededRand(seed)})
		seen[p.Pick(ws, Request{})] = true
	}
	assert.Len(t, seen, 3)
}

func TestPowerOfTwo(t *testing.T) {
	t.Run("samples two distinct and keeps the better", func(t *testing.T) {
		ws := mkws("w0", "w1", "w2")
		setLoad(t, ws[0], 10)
		setLoad(t, ws[1], 5)
		// Draws (i, offset): (0,0)→{0,1}→1; (2,0)→{2,0}→2; (1,1)→{1,0}→1; (1,0)→{1,2}→2.
		p := build(t, "power_of_two", DefaultOptions(), Deps{Rand: &seqRand{vals: []int{0, 0, 2, 0, 1, 1, 1, 0}}})
		assert.Equal(t, []string{"w1", "w2", "w1", "w2"}, pickN(p, ws, 4))
	})
	t.Run("highest loaded never wins a pair", func(t *testing.T) {
		ws := mkws("w0", "w1", "w2")
		setLoad(t, ws[0], 10)
		setLoad(t, ws[1], 5)
		p := build(t, "power_of_two", DefaultOptions(), Deps{Rand: SeededRand(7)})
		counts := map[string]int{}
		for _, id := range pickN(p, ws, 300) {
			counts[id]++
		}
		assert.Zero(t, counts["w0"])
		assert.Greater(t, counts["w2"], counts["w1"])
	})
	t.Run("engine loads steer the pair", func(t *testing.T) {
		ws := mkws("a", "b")
		src := &staticLoads{}
		src.set(ws[0], load(8000, 0.2, 100))
		src.set(ws[1], load(1000, 0.2, 100))
		p := build(t, "power_of_two", DefaultOptions(), Deps{Loads: src, Rand: SeededRand(3)})
		assert.Equal(t, 1, p.Pick(ws, Request{}))
	})
	t.Run("single candidate", func(t *testing.T) {
		p := build(t, "power_of_two", DefaultOptions(), Deps{})
		require.Equal(t, 0, p.Pick(mkws("a"), Request{}))
	})
}

func TestScorerPrunesStaleCredit(t *testing.T) {
	src := &staticLoads{}
	p := newLeastLoad(DefaultOptions(), Deps{Loads: src, Rand: SeededRand(1)}.withDefaults())
	for epoch := uint64(1); epoch <= 3; epoch++ {
		ws := make([]*workers.Worker, 100)
		for i := range ws {
			ws[i] = mkw("w")
			src.set(ws[i], EngineLoad{Epoch: epoch})
		}
		for range ws {
			p.Pick(ws, Request{})
		}
	}
	p.s.mu.Lock()
	defer p.s.mu.Unlock()
	assert.LessOrEqual(t, len(p.s.credit), 100)
}
