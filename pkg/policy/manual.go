package policy

import (
	"context"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/smg-project/smg-extproc/pkg/workers"
)

// maxManualCandidates is how many workers manual remembers per key.
const maxManualCandidates = 2

// Manual is SMG's sticky-key policy. A routing key is pinned to the worker
// the assignment mode chose for it and stays there: adding workers never
// moves a key, and it is remapped only when none of its remembered workers
// (up to two, oldest first, for failover) is among the available candidates.
// Then a new worker is assigned and remembered beside the old one, so the
// key returns to its original worker once that recovers, as in SMG. Keys
// idle longer than max_idle are evicted every eviction interval. A request
// without a key gets a worker by the assignment mode and is not remembered.
//
// Assignment modes: random; min_load (fewest in-flight, random among ties);
// min_group (fewest keys currently pinned to the worker by this instance,
// random among ties; SMG counts the keys with requests in flight, which the
// worker record does not track).
//
// Each leg has its own instance, so prefill and decode pins are separate
// namespaces, as SMG's leg-prefixed keys are.
type Manual struct {
	clock    Clock
	rnd      Rand
	mode     string
	maxIdle  time.Duration
	interval time.Duration

	mu       sync.Mutex
	keys     map[string]*manualEntry
	groups   map[string]int // worker URL → keys whose newest pin it is
	lastEvic time.Time
	started  atomic.Bool
}

type manualEntry struct {
	urls [maxManualCandidates]string
	n    int
	last time.Time
}

func newManual(o Options, d Deps) *Manual {
	mode := o.AssignmentMode
	if mode == "" {
		mode = AssignRandom
	}
	return &Manual{
		clock:    d.Clock,
		rnd:      d.Rand,
		mode:     mode,
		maxIdle:  o.MaxIdle,
		interval: o.EvictionInterval,
		keys:     map[string]*manualEntry{},
		groups:   map[string]int{},
		lastEvic: d.Clock.Now(),
	}
}

func (*Manual) Name() string { return "manual" }

func (p *Manual) Pick(cands []*workers.Worker, req Request) int {
	key := req.routingKey()
	if key == "" {
		if p.mode == AssignMinGroup {
			p.mu.Lock()
			defer p.mu.Unlock()
		}
		return p.assign(cands)
	}
	now := p.clock.Now()
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.started.Load() && p.interval > 0 && now.Sub(p.lastEvic) >= p.interval {
		p.evictLocked(now)
	}
	e := p.keys[key]
	if e != nil {
		e.last = now
		for _, u := range e.urls[:e.n] {
			for i, w := range cands {
				if w.URL == u {
					return i
				}
			}
		}
		i := p.assign(cands)
		p.push(e, cands[i].URL)
		return i
	}
	i := p.assign(cands)
	e = &manualEntry{last: now}
	p.keys[strings.Clone(key)] = e
	p.push(e, cands[i].URL)
	return i
}

// push remembers url as the newest pin, dropping the oldest beyond the cap.
func (p *Manual) push(e *manualEntry, url string) {
	if e.n > 0 {
		p.ungroup(e.urls[e.n-1])
	}
	if e.n == maxManualCandidates {
		copy(e.urls[:], e.urls[1:])
		e.n--
	}
	e.urls[e.n] = url
	e.n++
	p.groups[url]++
}

func (p *Manual) ungroup(url string) {
	if p.groups[url] <= 1 {
		delete(p.groups, url)
	} else {
		p.groups[url]--
	}
}

// assign picks a worker for a new or remapped key (min_group needs mu held).
func (p *Manual) assign(cands []*workers.Worker) int {
	n := len(cands)
	if n == 1 {
		return 0
	}
	switch p.mode {
	case AssignMinLoad:
		return p.minBy(cands, func(w *workers.Worker) int64 { return w.Load() })
	case AssignMinGroup:
		return p.minBy(cands, func(w *workers.Worker) int64 { return int64(p.groups[w.URL]) })
	default:
		return p.rnd.IntN(n)
	}
}

// minBy returns a uniformly random candidate among those minimising f.
func (p *Manual) minBy(cands []*workers.Worker, f func(*workers.Worker) int64) int {
	best, tied := 0, 1
	bv := f(cands[0])
	for i := 1; i < len(cands); i++ {
		v := f(cands[i])
		switch {
		case v < bv:
			best, bv, tied = i, v, 1
		case v == bv:
			tied++
			if p.rnd.IntN(tied) == 0 {
				best = i
			}
		}
	}
	return best
}

func (p *Manual) evictLocked(now time.Time) {
	p.lastEvic = now
	if p.maxIdle <= 0 {
		return
	}
	for k, e := range p.keys {
		if now.Sub(e.last) >= p.maxIdle {
			if e.n > 0 {
				p.ungroup(e.urls[e.n-1])
			}
			delete(p.keys, k)
		}
	}
}

// Start runs idle-key eviction every eviction interval until ctx is done.
func (p *Manual) Start(ctx context.Context) {
	if p.interval <= 0 || !p.started.CompareAndSwap(false, true) {
		return
	}
	go every(ctx, p.interval, func() {
		now := p.clock.Now()
		p.mu.Lock()
		p.evictLocked(now)
		p.mu.Unlock()
	})
}

// Len is the number of remembered keys.
func (p *Manual) Len() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.keys)
}

// every calls f every d until ctx is done.
func every(ctx context.Context, d time.Duration, f func()) {
	t := time.NewTicker(d)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			f()
		}
	}
}
