package policy

import (
	"sync"

	"github.com/smg-project/smg-extproc/pkg/workers"
)

// EngineLoad is one worker's engine-reported load, summed over its DP ranks
// (or the one rank a "@rank" worker stands for).
type EngineLoad struct {
	// QueuedTokens is the waiting queue's token work
	// (num_waiting_uncached_tokens); 0 when not reported.
	QueuedTokens float64
	// WaitingRequests and RunningRequests are the queue and batch depths.
	WaitingRequests int64
	RunningRequests int64
	// Throughput is the generation throughput in tokens/s; 0 = unknown.
	Throughput float64
	// KVUsage is the KV-cache utilisation in [0, 1].
	KVUsage float64
	// Epoch identifies the poll that produced this report. A policy's
	// since-poll dispatch credit for the worker resets when it changes.
	Epoch uint64
}

// LoadSource serves the latest engine load per worker. ok is false when the
// worker has no fresh report (never polled, or its last poll failed).
// Implementations must be safe for concurrent use and cheap: it is called
// per candidate on every pick.
type LoadSource interface {
	EngineLoad(w *workers.Worker) (EngineLoad, bool)
}

// dispatch is a policy's since-poll credit for one worker.
type dispatch struct {
	epoch    uint64
	tokens   float64
	requests int64
}

// scorer is SMG's least_load expected-wait scorer, shared by least_load and
// power_of_two:
//
//	score = (queued_tokens + inflight_tokens) / throughput + λ·k/(1−k)
//
// queued_tokens is the reported queued token work or, when the engine only
// reports a queue depth, waiting × mean prefill tokens; inflight_tokens is
// what this policy dispatched since the worker's last poll (mean prefill
// tokens per request over HTTP, where token counts are unknown); throughput
// is the reported one or the fallback; k is KV usage clamped to [0, 0.999].
// A worker without a fresh report while others have one scores as the best
// reporting candidate plus its in-flight at the candidates' mean throughput;
// when no candidate reports, it is join-shortest-queue on in-flight counts.
// Ties are broken uniformly at random.
type scorer struct {
	loads      LoadSource
	rnd        Rand
	lambda     float64
	fallbackTP float64
	meanTokens float64
	maxWaiting int64

	// mu makes scoring and crediting the winner one step, as SMG does, so
	// concurrent picks water-fill instead of herding onto one stale minimum.
	mu       sync.Mutex
	credit   map[*workers.Worker]dispatch
	maxEpoch uint64
}

func newScorer(o Options, d Deps) *scorer {
	s := &scorer{
		loads:      d.Loads,
		rnd:        d.Rand,
		lambda:     o.LeastLoadKVPressureWeight,
		fallbackTP: o.LeastLoadDefaultThroughput,
		meanTokens: float64(o.LeastLoadMeanPrefillTokens),
		maxWaiting: int64(o.LeastLoadMaxWaitingReqs),
		credit:     map[*workers.Worker]dispatch{},
	}
	if s.lambda < 0 {
		s.lambda = 0.15
	}
	if s.fallbackTP <= 0 {
		s.fallbackTP = 2000
	}
	if s.meanTokens < 1 {
		s.meanTokens = 1
	}
	return s
}

func (s *scorer) fresh(w *workers.Worker) (EngineLoad, bool) {
	if s.loads == nil {
		return EngineLoad{}, false
	}
	return s.loads.EngineLoad(w)
}

// sinceDispatch is the credit valid against load l (caller holds mu).
func (s *scorer) sinceDispatch(w *workers.Worker, l EngineLoad) dispatch {
	d, ok := s.credit[w]
	if !ok || d.epoch != l.Epoch {
		return dispatch{epoch: l.Epoch}
	}
	return d
}

func (s *scorer) vetoed(w *workers.Worker) bool {
	if s.maxWaiting <= 0 {
		return false
	}
	l, ok := s.fresh(w)
	if !ok {
		return false // no queue evidence: a dark fleet keeps routing
	}
	return l.WaitingRequests+s.sinceDispatch(w, l).requests >= s.maxWaiting
}

func (s *scorer) score(w *workers.Worker, peerBaseline, nominalTP float64, fleetHasLoads bool) float64 {
	if l, ok := s.fresh(w); ok {
		queued := l.QueuedTokens
		if queued <= 0 {
			queued = float64(max(l.WaitingRequests, 0)) * s.meanTokens
		}
		tp := l.Throughput
		if tp <= 0 {
			tp = s.fallbackTP
		}
		k := min(max(l.KVUsage, 0), 0.999)
		return (queued+s.sinceDispatch(w, l).tokens)/tp + s.lambda*k/(1-k)
	}
	if fleetHasLoads {
		return peerBaseline + float64(w.Load())*s.meanTokens/nominalTP
	}
	return float64(w.Load())
}

// pick returns the argmin over cands[i] for i in sub (all candidates when sub
// is nil), or NoSelection when the waiting cap vetoes every one of them.
func (s *scorer) pick(cands []*workers.Worker, sub []int) int {
	n := len(sub)
	if sub == nil {
		n = len(cands)
	}
	at := func(k int) int {
		if sub == nil {
			return k
		}
		return sub[k]
	}
	s.mu.Lock()
	defer s.mu.Unlock()

	// Fleet facts over the non-vetoed candidates.
	var tpSum float64
	var tpN, eligible, reporting int
	for k := 0; k < n; k++ {
		w := cands[at(k)]
		if s.vetoed(w) {
			continue
		}
		eligible++
		if l, ok := s.fresh(w); ok {
			reporting++
			if l.Throughput > 0 {
				tpSum += l.Throughput
				tpN++
			}
		}
	}
	if eligible == 0 {
		return NoSelection
	}
	nominal := s.fallbackTP
	if tpN > 0 {
		nominal = tpSum / float64(tpN)
	}
	fleetHasLoads := reporting > 0
	var baseline float64
	if fleetHasLoads && reporting < eligible {
		baseline = -1
		for k := 0; k < n; k++ {
			w := cands[at(k)]
			if _, ok := s.fresh(w); !ok || s.vetoed(w) {
				continue
			}
			if sc := s.score(w, 0, nominal, true); baseline < 0 || sc < baseline {
				baseline = sc
			}
		}
	}

	best, tied := -1, 0
	var bestScore float64
	for k := 0; k < n; k++ {
		i := at(k)
		w := cands[i]
		if s.vetoed(w) {
			continue
		}
		sc := s.score(w, baseline, nominal, fleetHasLoads)
		switch {
		case best < 0 || sc < bestScore:
			best, bestScore, tied = i, sc, 1
		case sc == bestScore:
			// Reservoir sampling: uniform over all ties without collecting them.
			tied++
			if s.rnd.IntN(tied) == 0 {
				best = i
			}
		}
	}

	// Credit the winner until its next poll.
	w := cands[best]
	if l, ok := s.fresh(w); ok {
		d := s.sinceDispatch(w, l)
		d.tokens += s.meanTokens
		d.requests++
		s.credit[w] = d
		if l.Epoch > s.maxEpoch {
			s.maxEpoch = l.Epoch
			s.prune()
		}
	}
	return best
}

// prune drops credit older than the newest poll when the map has grown: such
// credit is never read again (a worker's next report carries a newer epoch),
// and removed workers would otherwise stay referenced.
func (s *scorer) prune() {
	if len(s.credit) < 64 {
		return
	}
	for w, d := range s.credit {
		if d.epoch < s.maxEpoch {
			delete(s.credit, w)
		}
	}
}

// LeastLoad picks the candidate with the lowest expected wait (see scorer).
type LeastLoad struct{ s *scorer }

func newLeastLoad(o Options, d Deps) *LeastLoad { return &LeastLoad{s: newScorer(o, d)} }

func (*LeastLoad) Name() string { return "least_load" }

func (p *LeastLoad) Pick(cands []*workers.Worker, _ Request) int {
	// The single-candidate shortcut must not bypass the waiting-request cap.
	if len(cands) == 1 && p.s.maxWaiting == 0 {
		return 0
	}
	return p.s.pick(cands, nil)
}

// PowerOfTwo samples two distinct candidates uniformly and keeps the one with
// the lower expected wait, scored exactly like least_load (SMG PR #2187).
type PowerOfTwo struct {
	s   *scorer
	rnd Rand
}

func newPowerOfTwo(o Options, d Deps) *PowerOfTwo {
	return &PowerOfTwo{s: newScorer(o, d), rnd: d.Rand}
}

func (*PowerOfTwo) Name() string { return "power_of_two" }

func (p *PowerOfTwo) Pick(cands []*workers.Worker, _ Request) int {
	n := len(cands)
	if n == 1 {
		return 0
	}
	i := p.rnd.IntN(n)
	j := (i + 1 + p.rnd.IntN(n-1)) % n
	pair := [2]int{i, j}
	return p.s.pick(cands, pair[:])
}
