package policy

import (
	"strconv"

	"github.com/cespare/xxhash/v2"

	"github.com/smg-project/smg-extproc/pkg/workers"
)

// ConsistentHashing routes, in order of precedence:
//  1. x-smg-target-worker: <index> to that candidate, or NoSelection when
//     the index is unparsable, out of range or unavailable;
//  2. x-smg-routing-key on the hash ring (150 vnodes per worker);
//  3. an implicit key from authorization, then x-forwarded-for, then cookie,
//     on the same ring;
//  4. uniformly at random.
//
// The index counts within the candidates the policy is given (the available
// ones, in registry order), as in SMG's PD router.
type ConsistentHashing struct {
	rnd   Rand
	rings ringCache
}

func newConsistentHashing(d Deps) *ConsistentHashing { return &ConsistentHashing{rnd: d.Rand} }

func (*ConsistentHashing) Name() string { return "consistent_hashing" }

func (p *ConsistentHashing) Pick(cands []*workers.Worker, req Request) int {
	if req.TargetWorker != "" {
		i, err := strconv.ParseUint(req.TargetWorker, 10, 31)
		if err != nil || int(i) >= len(cands) || !cands[i].Available() {
			return NoSelection
		}
		return int(i)
	}
	key := req.routingKey()
	if key == "" {
		switch {
		case req.Authorization != "":
			key = req.Authorization
		case req.ForwardedFor != "":
			key = req.ForwardedFor
		default:
			key = req.Cookie
		}
	}
	if key == "" {
		if len(cands) == 1 {
			return 0
		}
		return p.rnd.IntN(len(cands))
	}
	if len(cands) == 1 {
		return 0
	}
	return p.rings.get(cands).lookup(xxhash.Sum64String(key))
}

// charsPerToken is how many characters of text stand for one token when a
// request carries text rather than token ids.
const charsPerToken = 4

// PrefixHash hashes the request's prefix (the routing key when present, else
// the first prefix_token_count×4 characters of the text) with xxhash onto the
// consistent ring. If the ring's worker is overloaded (in-flight above both
// load_factor × average and average + abs threshold, the average counting
// the incoming request), it takes the least loaded candidate that is not
// overloaded, or the ring's worker when all are. With nothing to hash it
// takes the least loaded candidate.
type PrefixHash struct {
	prefixChars int
	loadFactor  float64
	absThresh   float64
	rings       ringCache
}

func newPrefixHash(o Options, _ Deps) *PrefixHash {
	return &PrefixHash{
		prefixChars: o.PrefixTokenCount * charsPerToken,
		loadFactor:  o.LoadFactor,
		absThresh:   float64(o.PrefixHashBalanceAbsThreshold),
	}
}

func (*PrefixHash) Name() string { return "prefix_hash" }

func (p *PrefixHash) Pick(cands []*workers.Worker, req Request) int {
	var h uint64
	switch key := req.routingKey(); {
	case key != "":
		h = xxhash.Sum64String(key)
	case req.Text != "":
		h = xxhash.Sum64String(runePrefix(req.Text, p.prefixChars))
	default:
		return minLoadIndex(cands)
	}
	if len(cands) == 1 {
		return 0
	}
	idx := p.rings.get(cands).lookup(h)

	var total int64
	for _, w := range cands {
		total += w.Load()
	}
	if total == 0 {
		return idx
	}
	avg := float64(total+1) / float64(len(cands))
	limit := max(avg*p.loadFactor, avg+p.absThresh)
	ok := func(l int64) bool { return float64(l) <= limit }
	if ok(cands[idx].Load()) {
		return idx
	}
	best := -1
	var bl int64
	for i, w := range cands {
		if l := w.Load(); ok(l) && (best < 0 || l < bl) {
			best, bl = i, l
		}
	}
	if best < 0 {
		return idx
	}
	return best
}

// runePrefix is s cut after n characters (runes).
func runePrefix(s string, n int) string {
	if n <= 0 {
		return ""
	}
	if len(s) <= n {
		return s // at most len(s) runes
	}
	c := 0
	for i := range s {
		if c == n {
			return s[:i]
		}
		c++
	}
	return s
}
