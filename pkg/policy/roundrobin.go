package policy

import (
	"sync"
	"sync/atomic"

	"github.com/smg-project/smg-extproc/pkg/workers"
)

// maxTrackedSets bounds the candidate sets one round_robin instance keeps a
// rotation for; past it a new set evicts the least recently used one.
const maxTrackedSets = 4096

// RoundRobin rotates over the candidates, keeping one rotation per candidate
// set (the set's workers, in order), as current SMG does. One decode-leg
// instance serves every prefill's partner set, and a single shared counter
// would follow the prefill leg's interleaving: with P1{D1,D2} and P2{D3,D4}
// alternating, P1's sets would only ever see even counter values and stick to
// D1 (checklist 64). A set seen for the first time starts from a shared,
// advancing position so a fleet whose shape keeps changing does not lean on
// its first worker.
type RoundRobin struct {
	mu        sync.RWMutex
	sets      map[uint64]*rotation
	nextStart atomic.Uint64
	tick      atomic.Uint64
}

type rotation struct {
	next     atomic.Uint64
	lastUsed atomic.Uint64
}

// NewRoundRobin returns an empty round_robin policy.
func NewRoundRobin() *RoundRobin { return &RoundRobin{sets: map[uint64]*rotation{}} }

func (*RoundRobin) Name() string { return "round_robin" }

func (r *RoundRobin) Pick(cands []*workers.Worker, _ Request) int {
	n := len(cands)
	if n == 1 {
		return 0
	}
	return int(r.advance(setKey(cands)) % uint64(n))
}

// advance returns the set's next position: a read lock and two atomics in the
// steady state.
func (r *RoundRobin) advance(key uint64) uint64 {
	now := r.tick.Add(1)
	r.mu.RLock()
	rot := r.sets[key]
	r.mu.RUnlock()
	if rot == nil {
		rot = r.insert(key, now)
	}
	rot.lastUsed.Store(now)
	return rot.next.Add(1) - 1
}

func (r *RoundRobin) insert(key, now uint64) *rotation {
	r.mu.Lock()
	defer r.mu.Unlock()
	if rot := r.sets[key]; rot != nil {
		return rot
	}
	if r.sets == nil {
		r.sets = map[uint64]*rotation{}
	}
	if len(r.sets) >= maxTrackedSets {
		var oldest uint64
		first := true
		var min uint64
		for k, v := range r.sets {
			if lu := v.lastUsed.Load(); first || lu < min {
				oldest, min, first = k, lu, false
			}
		}
		delete(r.sets, oldest)
	}
	rot := &rotation{}
	rot.next.Store(r.nextStart.Add(1) - 1)
	rot.lastUsed.Store(now)
	r.sets[key] = rot
	return rot
}

func (r *RoundRobin) tracked() int {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return len(r.sets)
}
