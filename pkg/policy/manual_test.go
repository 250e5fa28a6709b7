package policy

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/smg-project/smg-extproc/pkg/workers"
)

func TestManualSticky(t *testing.T) {
	ws := mkws("w1", "w2", "w3")
	p := build(t, "manual", DefaultOptions(), Deps{Rand: &seqRand{vals: []int{1, 1}}})
	k := Request{RoutingKey: "user-1"}
	assert.Equal(t, 1, p.Pick(ws, k))
	for i := 0; i < 5; i++ {
		assert.Equal(t, 1, p.Pick(ws, k))
	}
	// Adding a worker never moves an existing key.
	more := append(append([]*workers.Worker{}, ws...), mkw("w4"))
	assert.Equal(t, 1, p.Pick(more, k))

	// Failover: w2 unavailable (absent from the candidates) → remapped to w3
	// (draw 1) and remembered; w2 back → the key returns to w2.
	down := []*workers.Worker{ws[0], ws[2]}
	assert.Equal(t, 1, p.Pick(down, k), "w3 is index 1 of the filtered list")
	assert.Equal(t, 1, p.Pick(down, k))
	assert.Equal(t, 1, p.Pick(ws, k), "back to w2")

	// A third failover forgets the oldest pin (w2): w1 (the only candidate) is pinned.
	assert.Equal(t, 0, p.Pick([]*workers.Worker{ws[0]}, k))
	assert.Equal(t, 2, p.Pick(ws, k), "pins are w3, w1: w3 comes first")
}

func TestManualNoKey(t *testing.T) {
	ws := mkws("w1", "w2", "w3")
	p := build(t, "manual", DefaultOptions(), Deps{Rand: &seqRand{vals: []int{2, 0, 1}}})
	assert.Equal(t, []string{"w3", "w1", "w2"}, pickN(p, ws, 3))
	assert.Zero(t, p.(*Manual).Len(), "keyless picks are not remembered")
}

func TestManualAssignmentModes(t *testing.T) {
	tests := []struct {
		mode  string
		loads []int64
		keys  []string // earlier keys, assigned in order
		want  int      // assignment of key "new"
	}{
		{AssignMinLoad, []int64{4, 1, 3}, nil, 1},
		{AssignMinLoad, []int64{0, 0, 0}, nil, 0}, // ties: seqRand keeps the first
		{AssignMinGroup, []int64{0, 9, 9}, []string{"a", "b"}, 2},
	}
	for _, tt := range tests {
		t.Run(tt.mode, func(t *testing.T) {
			o := DefaultOptions()
			o.AssignmentMode = tt.mode
			ws := mkws("w1", "w2", "w3")
			for i, l := range tt.loads {
				setLoad(t, ws[i], l)
			}
			p := build(t, "manual", o, Deps{Rand: &seqRand{vals: []int{1, 1, 1, 1, 1, 1}}})
			for _, k := range tt.keys {
				p.Pick(ws, Request{RoutingKey: k})
			}
			assert.Equal(t, tt.want, p.Pick(ws, Request{RoutingKey: "new"}))
		})
	}
}

func TestManualMinGroupSpreadsKeys(t *testing.T) {
	o := DefaultOptions()
	o.AssignmentMode = AssignMinGroup
	ws := mkws("w1", "w2", "w3")
	p := build(t, "manual", o, Deps{Rand: SeededRand(5)})
	count := map[int]int{}
	for i := 0; i < 30; i++ {
		count[p.Pick(ws, Request{RoutingKey: fmt.Sprint(i)})]++
	}
	assert.Equal(t, map[int]int{0: 10, 1: 10, 2: 10}, count)
}

func TestManualIdleEviction(t *testing.T) {
	clock := newFakeClock()
	o := DefaultOptions()
	o.MaxIdle = time.Hour
	o.EvictionInterval = time.Minute
	ws := mkws("w1", "w2", "w3")
	p := build(t, "manual", o, Deps{Clock: clock, Rand: &seqRand{vals: []int{1, 2}}}).(*Manual)
	require.Equal(t, 1, p.Pick(ws, Request{RoutingKey: "old"}))
	clock.Advance(59 * time.Minute)
	require.Equal(t, 2, p.Pick(ws, Request{RoutingKey: "fresh"}))
	assert.Equal(t, 2, p.Len())
	clock.Advance(2 * time.Minute) // "old" idle 61 min, "fresh" 2 min
	p.Pick(ws, Request{RoutingKey: "fresh"})
	assert.Equal(t, 1, p.Len())
	assert.Equal(t, 2, p.Pick(ws, Request{RoutingKey: "fresh"}))
	// "old" is a new key now: drawn afresh (seqRand exhausted → 0).
	assert.Equal(t, 0, p.Pick(ws, Request{RoutingKey: "old"}))
}
