package policy

import (
	"slices"
	"strconv"
	"sync"

	"github.com/cespare/xxhash/v2"

	"github.com/smg-project/smg-extproc/pkg/workers"
)

// vnodesPerWorker is SMG's virtual-node count per worker on the hash ring.
const vnodesPerWorker = 150

// maxRings bounds the candidate sets one policy keeps a ring for.
const maxRings = 64

// ring is a consistent-hash ring over one candidate set: each worker sits at
// 150 points hash(URL + "#" + vnode). SMG hashes with blake3; this uses
// xxhash64, so positions differ from SMG's (keys are stable within this
// gateway, not across implementations). A ring over the available
// candidates is equivalent to SMG's walk past unhealthy workers on the full
// ring: vnode positions depend only on the URL, so dropping a worker only
// moves its own keys, to the next point clockwise.
type ring struct {
	members []*workers.Worker // copy of the set's workers, to verify the key
	points  []ringPoint
}

type ringPoint struct {
	hash uint64
	idx  int32
}

func buildRing(cands []*workers.Worker) *ring {
	r := &ring{
		members: append([]*workers.Worker(nil), cands...),
		points:  make([]ringPoint, 0, len(cands)*vnodesPerWorker),
	}
	var buf []byte
	for i, w := range cands {
		for v := 0; v < vnodesPerWorker; v++ {
			buf = append(buf[:0], w.URL...)
			buf = append(buf, '#')
			buf = strconv.AppendInt(buf, int64(v), 10)
			r.points = append(r.points, ringPoint{hash: xxhash.Sum64(buf), idx: int32(i)})
		}
	}
	slices.SortFunc(r.points, func(a, b ringPoint) int {
		switch {
		case a.hash < b.hash:
			return -1
		case a.hash > b.hash:
			return 1
		}
		return int(a.idx - b.idx)
	})
	return r
}

// lookup returns the candidate index owning hash h: the first point at or
// clockwise after h.
func (r *ring) lookup(h uint64) int {
	i, _ := slices.BinarySearchFunc(r.points, h, func(p ringPoint, h uint64) int {
		switch {
		case p.hash < h:
			return -1
		case p.hash > h:
			return 1
		}
		return 0
	})
	if i == len(r.points) {
		i = 0
	}
	return int(r.points[i].idx)
}

func (r *ring) matches(cands []*workers.Worker) bool {
	return slices.Equal(r.members, cands)
}

// ringCache keeps one ring per candidate set (bounded, oldest-built evicted).
type ringCache struct {
	mu    sync.RWMutex
	rings map[uint64]*ring
	order []uint64 // insertion order, for eviction
}

func (c *ringCache) get(cands []*workers.Worker) *ring {
	key := setKey(cands)
	c.mu.RLock()
	r := c.rings[key]
	c.mu.RUnlock()
	if r != nil && r.matches(cands) {
		return r
	}
	r = buildRing(cands)
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.rings == nil {
		c.rings = map[uint64]*ring{}
	}
	if _, ok := c.rings[key]; !ok {
		if len(c.order) >= maxRings {
			delete(c.rings, c.order[0])
			c.order = append(c.order[:0], c.order[1:]...)
		}
		c.order = append(c.order, key)
	}
	c.rings[key] = r
	return r
}
