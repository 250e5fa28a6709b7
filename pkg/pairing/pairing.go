// Package pairing chooses a prefill/decode pair for one request: the prefill
// policy picks among prefills that have an available compatible partner, then
// the decode policy among that prefill's available partners. Compatibility
// (SMG's pairing descriptors, --pd-pairing-mode) is decided per membership
// snapshot in an Index, never per request.
package pairing

import (
	"sync"
	"sync/atomic"

	"github.com/smg-project/smg-extproc/pkg/apierr"
	"github.com/smg-project/smg-extproc/pkg/policy"
	"github.com/smg-project/smg-extproc/pkg/workers"
)

// Selector holds one policy instance per leg and the current pair index.
// Use NewSelector; a Selector must not be copied.
type Selector struct {
	Prefill policy.Policy
	Decode  policy.Policy
	// Mode is the pairing mode indexes are built under; set it before the
	// first Rebuild.
	Mode Mode
	// Available reports whether a worker may be selected right now (health,
	// later also its circuit breaker). nil means Worker.Healthy.
	Available func(*workers.Worker) bool

	idx atomic.Pointer[Index]
	// mu serialises rebuilds so an older snapshot never replaces a newer one.
	mu sync.Mutex
	// scratch holds *scratch buffers for filtered candidate lists, so a
	// request with some workers down allocates nothing in steady state.
	scratch sync.Pool
}

// NewSelector returns a Selector with an empty index.
func NewSelector(prefill, decode policy.Policy, mode Mode) *Selector {
	return &Selector{Prefill: prefill, Decode: decode, Mode: mode}
}

// Pair is a selection result.
type Pair struct {
	Prefill *workers.Worker
	Decode  *workers.Worker
}

// scratch is one request's filtered candidate lists. Policies must not retain
// the slice they are given (they return an index), so it is reused.
type scratch struct {
	prefill []*workers.Worker
	pos     []int // pos[k] is prefill[k]'s position in Index.prefill
	decode  []*workers.Worker
}

// Rebuild indexes ws (a registry snapshot) under s.Mode and swaps it in. Call
// it whenever membership changes. It returns the index's refusal, if any, so
// the caller can log it at warn.
func (s *Selector) Rebuild(ws []*workers.Worker) *Refusal {
	s.mu.Lock()
	defer s.mu.Unlock()
	ix := BuildIndex(ws, s.Mode)
	s.idx.Store(ix)
	return ix.refusal
}

// Sync rebuilds the index only when snapshot() returns a different slice than
// the one indexed; registry snapshots are immutable and replaced on every
// change, so identity is the change test. Cheap enough to call per request as
// a safety net; rebuilt reports whether this call built a new index.
func (s *Selector) Sync(snapshot func() []*workers.Worker) (ref *Refusal, rebuilt bool) {
	if ix := s.idx.Load(); ix != nil && sameSlice(ix.snap, snapshot()) {
		return nil, false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	// Read again under the lock: a concurrent Sync may have indexed it already,
	// and reading here keeps stored snapshots monotonic.
	ws := snapshot()
	if ix := s.idx.Load(); ix != nil && sameSlice(ix.snap, ws) {
		return nil, false
	}
	ix := BuildIndex(ws, s.Mode)
	s.idx.Store(ix)
	return ix.refusal, true
}

func sameSlice(a, b []*workers.Worker) bool {
	return len(a) == len(b) && (len(a) == 0 || &a[0] == &b[0])
}

// Index is the current pair index (nil before the first Rebuild).
func (s *Selector) Index() *Index { return s.idx.Load() }

// Refusal is the current index's refusal, nil when some pair is compatible.
func (s *Selector) Refusal() *Refusal {
	if ix := s.idx.Load(); ix != nil {
		return ix.refusal
	}
	return nil
}

func (s *Selector) available() func(*workers.Worker) bool {
	if s.Available != nil {
		return s.Available
	}
	return (*workers.Worker).Healthy
}

func (s *Selector) getScratch() *scratch {
	if sc, ok := s.scratch.Get().(*scratch); ok {
		return sc
	}
	return new(scratch)
}

func (s *Selector) putScratch(sc *scratch) {
	// Drop worker pointers so a removed worker is not kept alive by the pool.
	clear(sc.prefill)
	clear(sc.decode)
	sc.prefill, sc.pos, sc.decode = sc.prefill[:0], sc.pos[:0], sc.decode[:0]
	s.scratch.Put(sc)
}

const (
	msgNoPrefill   = "No available servers: No prefill workers available. Please check if prefill servers are configured and healthy."
	msgNoDecode    = "No available servers: No decode workers available. Please check if decode servers are configured and healthy."
	msgPrefillDown = "No available prefill workers (all circuits open or unhealthy)"
	msgDecodeDown  = "No available decode workers (all circuits open or unhealthy)"
)

// SelectPair picks a compatible pair from the current index.
func (s *Selector) SelectPair(req policy.Request) (Pair, *apierr.Error) {
	ix := s.idx.Load()
	switch {
	case ix == nil || len(ix.prefillPool) == 0:
		return Pair{}, apierr.New(503, apierr.CodeNoAvailableWorkers, msgNoPrefill)
	case len(ix.decodePool) == 0:
		return Pair{}, apierr.New(503, apierr.CodeNoAvailableWorkers, msgNoDecode)
	case ix.refusal != nil:
		return Pair{}, apierr.New(503, apierr.CodeNoCompatiblePair, ix.refusal.message)
	}
	avail := s.available()

	// Eligible prefills: available and with at least one available partner,
	// so the policy's pick can always be paired. When every indexed prefill
	// qualifies (the common case) the index's own slice is handed over.
	anyUp, eligible := false, 0
	firstOut := -1
	var ok uint64 // eligibility of the first 64 prefills, so they are judged once
	for i, p := range ix.prefill {
		if !avail(p) {
			if firstOut < 0 {
				firstOut = i
			}
			continue
		}
		anyUp = true
		if anyAvailable(ix.partners[i], avail) {
			eligible++
			if i < 64 {
				ok |= 1 << i
			}
		} else if firstOut < 0 {
			firstOut = i
		}
	}
	if eligible == 0 {
		if !anyUp {
			return Pair{}, apierr.New(503, apierr.CodeNoAvailableWorkers, msgPrefillDown)
		}
		// Prefills are up but every compatible decode is down.
		return Pair{}, apierr.New(503, apierr.CodeNoAvailableWorkers, msgDecodeDown)
	}

	var sc *scratch // taken only when some worker must be filtered out
	var pi int
	if firstOut < 0 {
		if pi = s.Prefill.Pick(ix.prefill, req); pi < 0 {
			return Pair{}, declined(s.Prefill, "prefill")
		}
	} else {
		sc = s.getScratch()
		for i, p := range ix.prefill {
			// Past 64 prefills eligibility is judged again; a flip since the
			// count only makes the list a worker shorter or longer.
			if i < 64 && ok&(1<<i) != 0 || i >= 64 && avail(p) && anyAvailable(ix.partners[i], avail) {
				sc.prefill = append(sc.prefill, p)
				sc.pos = append(sc.pos, i)
			}
		}
		if len(sc.prefill) == 0 {
			s.putScratch(sc)
			return Pair{}, apierr.New(503, apierr.CodeNoAvailableWorkers, msgPrefillDown)
		}
		k := s.Prefill.Pick(sc.prefill, req)
		if k < 0 { // the policy declined (e.g. x-smg-target-worker unavailable)
			s.putScratch(sc)
			return Pair{}, declined(s.Prefill, "prefill")
		}
		pi = sc.pos[k]
	}

	cands := ix.partners[pi]
	if j := firstUnavailable(cands, avail); j >= 0 {
		if sc == nil {
			sc = s.getScratch()
		}
		sc.decode = append(sc.decode, cands[:j]...)
		for _, d := range cands[j+1:] {
			if avail(d) {
				sc.decode = append(sc.decode, d)
			}
		}
		cands = sc.decode
	}
	var pair Pair
	var aerr *apierr.Error
	if len(cands) == 0 {
		// Its last partner went down between the two reads.
		aerr = apierr.New(503, apierr.CodeNoAvailableWorkers, msgDecodeDown)
	} else if k := s.Decode.Pick(cands, req); k < 0 {
		aerr = declined(s.Decode, "decode")
	} else {
		pair = Pair{Prefill: ix.prefill[pi], Decode: cands[k]}
	}
	if sc != nil {
		s.putScratch(sc)
	}
	return pair, aerr
}

// declined is SMG's answer when a policy returns no selection.
func declined(p policy.Policy, leg string) *apierr.Error {
	return apierr.Newf(503, apierr.CodeNoAvailableWorkers, "Policy %s failed to select a %s worker", p.Name(), leg)
}

func firstUnavailable(ws []*workers.Worker, avail func(*workers.Worker) bool) int {
	for i, w := range ws {
		if !avail(w) {
			return i
		}
	}
	return -1
}

func anyAvailable(ws []*workers.Worker, avail func(*workers.Worker) bool) bool {
	for _, w := range ws {
		if avail(w) {
			return true
		}
	}
	return false
}

// SelectPrefill picks any available prefill (count_tokens), paired or not.
func (s *Selector) SelectPrefill(req policy.Request) (*workers.Worker, *apierr.Error) {
	ix := s.idx.Load()
	if ix == nil {
		return nil, apierr.New(503, apierr.CodeNoPrefillServers, "No available prefill servers to count tokens")
	}
	avail := s.available()
	all := true
	for _, p := range ix.prefillPool {
		if !avail(p) {
			all = false
			break
		}
	}
	if all && len(ix.prefillPool) > 0 {
		if k := s.Prefill.Pick(ix.prefillPool, req); k >= 0 {
			return ix.prefillPool[k], nil
		}
		return nil, apierr.New(503, apierr.CodeNoPrefillServers, "No available prefill servers to count tokens")
	}
	sc := s.getScratch()
	defer s.putScratch(sc)
	for _, p := range ix.prefillPool {
		if avail(p) {
			sc.prefill = append(sc.prefill, p)
		}
	}
	if len(sc.prefill) == 0 {
		return nil, apierr.New(503, apierr.CodeNoPrefillServers, "No available prefill servers to count tokens")
	}
	k := s.Prefill.Pick(sc.prefill, req)
	if k < 0 {
		return nil, apierr.New(503, apierr.CodeNoPrefillServers, "No available prefill servers to count tokens")
	}
	return sc.prefill[k], nil
}
