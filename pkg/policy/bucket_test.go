package policy

import (
	"math"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/smg-project/smg-extproc/pkg/workers"
)

func newBucketP(t *testing.T, abs int64, rel float64, clock Clock) *Bucket {
	t.Helper()
	o := DefaultOptions()
	o.BalanceAbsThreshold, o.BalanceRelThreshold = abs, rel
	o.BucketAdjustInterval = 10 * time.Second
	return build(t, "bucket", o, Deps{Clock: clock, Rand: &seqRand{}}).(*Bucket)
}

func his(b *Bucket) [][2]int64 {
	var out [][2]int64
	for _, r := range b.Boundaries() {
		out = append(out, [2]int64{r.Lo, r.Hi})
	}
	return out
}

func TestBucketInitialBoundaries(t *testing.T) {
	b := newBucketP(t, 300, 1.0001, newFakeClock())
	ws := mkws("w1", "w2", "w3")
	b.Pick(ws, Request{})
	assert.Equal(t, [][2]int64{{0, 1364}, {1365, 2729}, {2730, math.MaxInt64}}, his(b))
}

func TestBucketAdjust(t *testing.T) {
	clock := newFakeClock()
	b := newBucketP(t, 300, 1.0001, clock)
	ws := mkws("w1", "w2", "w3")
	for _, n := range []int{5, 10, 15, 20, 24, 26} { // total 100
		b.Pick(ws, Request{Text: strings.Repeat("a", n)})
	}
	clock.Advance(10 * time.Second)
	b.Pick(ws, Request{Text: "a"}) // the lazy refit runs before routing
	assert.Equal(t, [][2]int64{{0, 20}, {21, 26}, {27, math.MaxInt64}}, his(b))
	// Requests now go by their length.
	for _, tt := range []struct {
		n    int
		want int
	}{{20, 0}, {21, 1}, {26, 1}, {27, 2}, {5000, 2}} {
		assert.Equal(t, tt.want, b.Pick(ws, Request{Text: strings.Repeat("x", tt.n)}), "length %d", tt.n)
	}
}

// SMG's test_load_balancing_conditions, phase by phase.
func TestBucketLoadBalancing(t *testing.T) {
	t.Run("imbalance takes the least loaded, then buckets refit", func(t *testing.T) {
		clock := newFakeClock()
		b := newBucketP(t, 32, 1.0001, clock)
		ws := mkws("w1", "w2", "w3")
		pick := func(n int) int { return b.Pick(ws, Request{Text: strings.Repeat("a", n)}) }
		assert.Equal(t, 0, pick(33))
		assert.Equal(t, 1, pick(34)) // 33 vs 0: imbalanced
		assert.Equal(t, 2, pick(34))
		clock.Advance(11 * time.Second)
		b.mu.Lock()
		b.adjustLocked(clock.Now())
		b.mu.Unlock()
		assert.Equal(t, [][2]int64{{0, 33}, {34, 67}, {68, math.MaxInt64}}, his(b))
		// Three len-33 requests: the first by bucket (loads 33/34/34 are
		// balanced); its record expires the old window, so the next two
		// see w1 at 33 and the others at 0 and spread.
		i1, i2, i3 := pick(33), pick(33), pick(33)
		assert.Equal(t, 0, i1)
		assert.NotEqual(t, i2, i3)
		assert.NotEqual(t, 0, i2)
		assert.NotEqual(t, 0, i3)
	})
	t.Run("no imbalance below the absolute threshold", func(t *testing.T) {
		b := newBucketP(t, 30, 2.0, newFakeClock())
		ws := mkws("w1", "w2", "w3")
		b.Pick(ws, Request{Text: strings.Repeat("a", 20)})
		b.Pick(ws, Request{Text: strings.Repeat("a", 8)})
		assert.Equal(t, 0, b.Pick(ws, Request{Text: "request"}))
	})
	t.Run("no imbalance below the relative threshold", func(t *testing.T) {
		b := newBucketP(t, 5, 3.0, newFakeClock())
		ws := mkws("w1", "w2", "w3")
		assert.Equal(t, 0, b.Pick(ws, Request{Text: strings.Repeat("a", 15)}))
		assert.Equal(t, 1, b.Pick(ws, Request{Text: "short"})) // 15 vs 0: imbalanced
		assert.Equal(t, 2, b.Pick(ws, Request{Text: strings.Repeat("a", 10)}))
		assert.Equal(t, 0, b.Pick(ws, Request{Text: "request"})) // 15 ≤ 3×5
	})
}

func TestBucketMembership(t *testing.T) {
	clock := newFakeClock()
	b := newBucketP(t, 1000, 2, clock)
	ws := mkws("w1", "w2")
	b.Pick(ws, Request{})
	require.Len(t, b.Boundaries(), 2)

	// A newcomer joins and the ranges are laid out again.
	more := append(append([]*workers.Worker{}, ws...), mkw("w3"))
	b.Pick(more, Request{})
	assert.Equal(t, [][2]int64{{0, 1364}, {1365, 2729}, {2730, math.MaxInt64}}, his(b))

	// A member that is down briefly keeps its range; one gone for over a
	// minute is dropped at the next refit.
	b.Pick(ws, Request{Text: strings.Repeat("a", 3000)}) // owner w3 absent: random (seqRand → 0)
	clock.Advance(30 * time.Second)
	b.Pick(ws, Request{})
	assert.Len(t, b.Boundaries(), 3)
	clock.Advance(45 * time.Second)
	b.Pick(ws, Request{})
	assert.Len(t, b.Boundaries(), 2)
	// A stable set keeps its members however long it lasts.
	for i := 0; i < 5; i++ {
		clock.Advance(time.Minute)
		b.Pick(ws, Request{})
	}
	assert.Len(t, b.Boundaries(), 2)
}

func TestBucketWindowExpires(t *testing.T) {
	clock := newFakeClock()
	b := newBucketP(t, 1000, 2, clock)
	ws := mkws("w1", "w2")
	for i := 0; i < 100; i++ {
		b.Pick(ws, Request{Text: "abc"})
		clock.Advance(time.Second)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	assert.LessOrEqual(t, len(b.window)-b.head, 11)
	assert.LessOrEqual(t, len(b.window), 24)
	var sum int64
	for _, m := range b.members {
		sum += m.load
	}
	assert.Equal(t, b.windowLoad, sum)
}
