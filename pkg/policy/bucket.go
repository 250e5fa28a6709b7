package policy

import (
	"context"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/smg-project/smg-extproc/pkg/workers"
)

// bucketInitialMax is SMG's initial maximum request length l_max.
const bucketInitialMax = 4096

// bucketForget is how long a worker may be absent from every candidate list
// before its bucket is dropped (workers that left the registry).
const bucketForget = time.Minute

// Bucket is SMG's bucket policy (prefill only). Each worker owns a range of
// request lengths (characters of the text); ranges start as equal slices of
// [0, 4096) with the last open-ended, and are re-fitted every
// bucket_adjust_interval from the lengths seen in the last interval so that
// each worker's range carries about the same character load. A pick takes
// the least loaded candidate when the per-worker character loads of the last
// interval are imbalanced (max−min > balance_abs_threshold AND max >
// balance_rel_threshold × min), else the candidate owning the request's
// length, else a random candidate.
//
// Membership follows the candidates: a worker joins when first seen (ranges
// are laid out afresh over the new membership, in candidate order) and is
// dropped after being absent from every pick for a minute. The imbalance
// test and the least-loaded choice consider the current candidates only.
type Bucket struct {
	clock     Clock
	rnd       Rand
	absThresh int64
	relThresh float64
	period    time.Duration

	mu         sync.Mutex
	members    []*bucketMember
	byWorker   map[*workers.Worker]*bucketMember
	lastSet    uint64
	window     []bucketReq // requests of the last period, oldest first, from head
	head       int
	windowLoad int64
	bucketLoad int64 // per-bucket load the current boundaries were fitted to
	lastAdjust time.Time
	started    atomic.Bool
}

type bucketMember struct {
	w        *workers.Worker
	lo, hi   int64 // inclusive length range
	load     int64 // characters routed to it within the window
	lastSeen time.Time
	current  bool // in the candidate set last seen
}

type bucketReq struct {
	at    time.Time
	chars int64
	m     *bucketMember
}

func newBucket(o Options, d Deps) *Bucket {
	return &Bucket{
		clock:      d.Clock,
		rnd:        d.Rand,
		absThresh:  o.BalanceAbsThreshold,
		relThresh:  o.BalanceRelThreshold,
		period:     o.BucketAdjustInterval,
		byWorker:   map[*workers.Worker]*bucketMember{},
		lastAdjust: d.Clock.Now(),
	}
}

func (*Bucket) Name() string { return "bucket" }

func (p *Bucket) Pick(cands []*workers.Worker, req Request) int {
	now := p.clock.Now()
	chars := int64(utf8.RuneCountInString(req.Text))
	key := setKey(cands)
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.started.Load() && p.period > 0 && now.Sub(p.lastAdjust) >= p.period {
		p.adjustLocked(now)
	}
	if key != p.lastSet {
		p.syncMembers(cands, now)
		p.lastSet = key
	}

	chosen := -1
	minL, maxL := int64(math.MaxInt64), int64(0)
	for _, w := range cands {
		if m := p.byWorker[w]; m != nil {
			minL, maxL = min(minL, m.load), max(maxL, m.load)
		}
	}
	if maxL-minL > p.absThresh && float64(maxL) > p.relThresh*float64(minL) {
		var bl int64
		for i, w := range cands {
			if m := p.byWorker[w]; m != nil && (chosen < 0 || m.load < bl) {
				chosen, bl = i, m.load
			}
		}
	} else if m := p.owner(chars); m != nil {
		for i, w := range cands {
			if w == m.w {
				chosen = i
				break
			}
		}
	}
	if chosen < 0 {
		chosen = p.rnd.IntN(len(cands))
	}
	p.record(now, chars, p.byWorker[cands[chosen]])
	return chosen
}

// syncMembers adds candidates not yet members (re-laying the ranges) and
// refreshes lastSeen; called only when the candidate set changes.
func (p *Bucket) syncMembers(cands []*workers.Worker, now time.Time) {
	for _, m := range p.members {
		if m.current {
			m.lastSeen = now // it was a candidate until now
		}
		m.current = false
	}
	added := false
	for _, w := range cands {
		m := p.byWorker[w]
		if m == nil {
			m = &bucketMember{w: w}
			p.byWorker[w] = m
			p.members = append(p.members, m)
			added = true
		}
		m.lastSeen = now
		m.current = true
	}
	if added {
		p.layout()
	}
}

// layout spreads [0, l_max) evenly over the members, the last open-ended.
func (p *Bucket) layout() {
	n := int64(len(p.members))
	if n == 0 {
		return
	}
	gap := max(int64(bucketInitialMax)/n, 1)
	for i, m := range p.members {
		m.lo = int64(i) * gap
		m.hi = (int64(i)+1)*gap - 1
	}
	p.members[n-1].hi = math.MaxInt64
	p.bucketLoad = 0
}

func (p *Bucket) owner(chars int64) *bucketMember {
	i, ok := slices.BinarySearchFunc(p.members, chars, func(m *bucketMember, c int64) int {
		switch {
		case c < m.lo:
			return 1
		case c > m.hi:
			return -1
		}
		return 0
	})
	if !ok {
		return nil
	}
	return p.members[i]
}

// record adds a routed request to the window and expires old ones.
func (p *Bucket) record(now time.Time, chars int64, m *bucketMember) {
	if m != nil {
		m.load += chars
	}
	for p.head < len(p.window) {
		r := &p.window[p.head]
		if now.Sub(r.at) <= p.period {
			break
		}
		if r.m != nil {
			r.m.load = max(r.m.load-r.chars, 0)
		}
		p.windowLoad -= r.chars
		*r = bucketReq{}
		p.head++
	}
	// Compact once the expired head is the larger part, keeping appends
	// amortised O(1).
	if p.head > 0 && p.head >= len(p.window)/2 {
		n := copy(p.window, p.window[p.head:])
		clear(p.window[n:])
		p.window = p.window[:n]
		p.head = 0
	}
	p.window = append(p.window, bucketReq{at: now, chars: chars, m: m})
	p.windowLoad += chars
}

// adjustLocked drops long-absent members and re-fits the boundaries to the
// window's request lengths, as SMG's adjust_boundary does.
func (p *Bucket) adjustLocked(now time.Time) {
	p.lastAdjust = now
	kept := p.members[:0]
	removed := false
	for _, m := range p.members {
		if !m.current && now.Sub(m.lastSeen) > bucketForget {
			delete(p.byWorker, m.w)
			for i := p.head; i < len(p.window); i++ {
				if p.window[i].m == m {
					p.window[i].m = nil
				}
			}
			removed = true
			continue
		}
		kept = append(kept, m)
	}
	clear(p.members[len(kept):])
	p.members = kept
	if removed {
		p.lastSet = 0
		p.layout()
	}
	n := int64(len(p.members))
	live := p.window[p.head:]
	if len(live) == 0 || n == 0 {
		return
	}
	per := p.windowLoad / n
	old := p.bucketLoad
	if per <= 2*old && old <= 2*per && old != 0 {
		return // still within a factor of two of the fitted load
	}
	p.bucketLoad = per
	hist := make([]int64, len(live))
	for i, r := range live {
		hist[i] = r.chars
	}
	slices.Sort(hist)

	var upper int64
	next := 0
	for k, m := range p.members {
		last := k == len(p.members)-1
		if next >= len(hist) && last {
			m.lo, m.hi = upper, math.MaxInt64
			break
		}
		var acc int64
		closed := false
		for next < len(hist) {
			l := hist[next]
			acc += l
			if acc >= per {
				if last {
					m.lo, m.hi = upper, math.MaxInt64
					closed = true
					break
				}
				if l <= upper {
					m.lo, m.hi = upper, upper+per
					upper += per + 1
				} else {
					m.lo, m.hi = upper, l
					upper = l + 1
				}
				next++
				closed = true
				break
			}
			next++
		}
		if closed {
			continue
		}
		if last {
			m.lo, m.hi = upper, math.MaxInt64
			break
		}
		m.lo, m.hi = upper, upper+per
		upper += per + 1
	}
}

// Start re-fits the boundaries every bucket_adjust_interval until ctx is done.
func (p *Bucket) Start(ctx context.Context) {
	if p.period <= 0 || !p.started.CompareAndSwap(false, true) {
		return
	}
	go every(ctx, p.period, func() {
		now := p.clock.Now()
		p.mu.Lock()
		p.adjustLocked(now)
		p.mu.Unlock()
	})
}

// Boundaries returns each member's URL and inclusive length range.
func (p *Bucket) Boundaries() []BucketRange {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]BucketRange, len(p.members))
	for i, m := range p.members {
		out[i] = BucketRange{URL: m.w.URL, Lo: m.lo, Hi: m.hi}
	}
	return out
}

// BucketRange is one worker's request-length range (Hi MaxInt64 = open).
type BucketRange struct {
	URL    string
	Lo, Hi int64
}
