package policy

import (
	"container/heap"
	"context"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/smg-project/smg-extproc/pkg/workers"
)

// CacheAware is SMG's cache_aware policy over HTTP (the original algorithm):
//
//   - If the candidates' in-flight loads are imbalanced — max−min >
//     balance_abs_threshold AND max > balance_rel_threshold × min — take the
//     least loaded candidate.
//   - Otherwise match the request text against this instance's approximate
//     radix tree (characters; tenants are worker URLs). If matched/total
//     characters > cache_threshold, take the candidate holding the longest
//     matched prefix (the least loaded of them, then the most recently used).
//   - Else take the least loaded candidate, ties broken by fewer requests
//     routed by this instance, then by order.
//
// The text is then inserted under the chosen worker. Eviction removes least
// recently used leaves until the tree holds at most max_tree_size characters;
// it runs every eviction interval on Start's goroutine, or inline on Pick
// when the policy was never started.
type CacheAware struct {
	clock     Clock
	threshold float64
	absThresh int64
	relThresh float64
	maxSize   int
	interval  time.Duration

	mu        sync.Mutex
	root      caNode
	size      int // characters (bytes) held by the tree
	tenantIDs map[string]int32
	processed []uint64 // per tenant id: picks routed to it
	lastEvict time.Time
	started   atomic.Bool
}

type caNode struct {
	edge     string
	parent   *caNode
	children []*caNode
	tenants  []tenantStamp
}

type tenantStamp struct {
	id   int32
	last int64 // clock nanoseconds
}

func newCacheAware(o Options, d Deps) *CacheAware {
	return &CacheAware{
		clock:     d.Clock,
		threshold: o.CacheThreshold,
		absThresh: o.BalanceAbsThreshold,
		relThresh: o.BalanceRelThreshold,
		maxSize:   o.MaxTreeSize,
		interval:  o.EvictionInterval,
		tenantIDs: map[string]int32{},
		lastEvict: d.Clock.Now(),
	}
}

func (*CacheAware) Name() string { return "cache_aware" }

// maxStackCands is how many candidates a pick tracks without allocating.
const maxStackCands = 32

func (p *CacheAware) Pick(cands []*workers.Worker, req Request) int {
	now := p.clock.Now()
	nowNs := now.UnixNano()
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.started.Load() && p.interval > 0 && now.Sub(p.lastEvict) >= p.interval {
		p.evictLocked(now)
	}

	var idBuf [maxStackCands]int32
	ids := idBuf[:0]
	for _, w := range cands {
		ids = append(ids, p.tenant(w.URL))
	}

	chosen := -1
	minL, maxL := cands[0].Load(), cands[0].Load()
	for _, w := range cands[1:] {
		l := w.Load()
		minL, maxL = min(minL, l), max(maxL, l)
	}
	if maxL-minL > p.absThresh && float64(maxL) > p.relThresh*float64(minL) {
		chosen = minLoadIndex(cands)
	} else if req.Text != "" {
		if i, matched := p.match(req.Text, cands, ids); i >= 0 {
			rate := float64(utf8.RuneCountInString(req.Text[:matched])) / float64(utf8.RuneCountInString(req.Text))
			if rate > p.threshold {
				chosen = i
			}
		}
	}
	if chosen < 0 {
		chosen = p.leastLoaded(cands, ids)
	}
	p.processed[ids[chosen]]++
	p.insert(req.Text, ids[chosen], nowNs)
	return chosen
}

// tenant returns url's tenant id, registering it on first sight.
func (p *CacheAware) tenant(url string) int32 {
	if id, ok := p.tenantIDs[url]; ok {
		return id
	}
	id := int32(len(p.processed))
	p.tenantIDs[strings.Clone(url)] = id
	p.processed = append(p.processed, 0)
	return id
}

func (p *CacheAware) leastLoaded(cands []*workers.Worker, ids []int32) int {
	best := 0
	bl, bp := cands[0].Load(), p.processed[ids[0]]
	for i := 1; i < len(cands); i++ {
		l, pr := cands[i].Load(), p.processed[ids[i]]
		if l < bl || l == bl && pr < bp {
			best, bl, bp = i, l, pr
		}
	}
	return best
}

// match finds the deepest tree node on text's path held by a candidate and
// returns that candidate and the number of bytes of text it holds; -1 when
// no candidate holds any prefix.
func (p *CacheAware) match(text string, cands []*workers.Worker, ids []int32) (int, int) {
	node, pos, partial := &p.root, 0, 0
	for pos < len(text) {
		child := node.child(text[pos])
		if child == nil {
			break
		}
		l := commonPrefix(child.edge, text[pos:])
		node = child
		pos += l
		if l < len(child.edge) {
			partial = l
			break
		}
	}
	for node != &p.root {
		if i := p.bestHolder(node, cands, ids); i >= 0 {
			// Cut back to a character boundary.
			for pos > 0 && pos < len(text) && !utf8.RuneStart(text[pos]) {
				pos--
			}
			return i, pos
		}
		if partial > 0 {
			pos -= partial
			partial = 0
		} else {
			pos -= len(node.edge)
		}
		node = node.parent
	}
	return -1, 0
}

// bestHolder is the candidate among node's tenants with the fewest in-flight
// requests, then the most recent use; -1 when none is a candidate.
func (p *CacheAware) bestHolder(node *caNode, cands []*workers.Worker, ids []int32) int {
	best := -1
	var bl, blast int64
	for _, t := range node.tenants {
		for i, id := range ids {
			if id != t.id {
				continue
			}
			l := cands[i].Load()
			if best < 0 || l < bl || l == bl && t.last > blast {
				best, bl, blast = i, l, t.last
			}
		}
	}
	return best
}

func (n *caNode) child(b byte) *caNode {
	for _, c := range n.children {
		if c.edge[0] == b {
			return c
		}
	}
	return nil
}

func (n *caNode) touch(id int32, now int64) {
	for i := range n.tenants {
		if n.tenants[i].id == id {
			n.tenants[i].last = now
			return
		}
	}
	n.tenants = append(n.tenants, tenantStamp{id: id, last: now})
}

func (n *caNode) recency() int64 {
	var r int64
	for _, t := range n.tenants {
		r = max(r, t.last)
	}
	return r
}

func commonPrefix(a, b string) int {
	n := min(len(a), len(b))
	for i := 0; i < n; i++ {
		if a[i] != b[i] {
			return i
		}
	}
	return n
}

// insert records text as held by tenant id.
func (p *CacheAware) insert(text string, id int32, now int64) {
	node, pos := &p.root, 0
	for pos < len(text) {
		child := node.child(text[pos])
		if child == nil {
			leaf := &caNode{edge: strings.Clone(text[pos:]), parent: node, tenants: []tenantStamp{{id, now}}}
			node.children = append(node.children, leaf)
			p.size += len(leaf.edge)
			return
		}
		l := commonPrefix(child.edge, text[pos:])
		if l < len(child.edge) {
			mid := &caNode{
				edge:     child.edge[:l],
				parent:   node,
				children: []*caNode{child},
				tenants:  append([]tenantStamp(nil), child.tenants...),
			}
			child.edge = child.edge[l:]
			child.parent = mid
			for i, c := range node.children {
				if c == child {
					node.children[i] = mid
				}
			}
			child = mid
		}
		child.touch(id, now)
		pos += l
		node = child
	}
}

// evictLocked removes least recently used leaves until the tree fits.
func (p *CacheAware) evictLocked(now time.Time) {
	p.lastEvict = now
	if p.size <= p.maxSize {
		return
	}
	var h leafHeap
	var collect func(n *caNode)
	collect = func(n *caNode) {
		for _, c := range n.children {
			if len(c.children) == 0 {
				h = append(h, leafItem{c, c.recency()})
			} else {
				collect(c)
			}
		}
	}
	collect(&p.root)
	heap.Init(&h)
	for p.size > p.maxSize && h.Len() > 0 {
		it := heap.Pop(&h).(leafItem)
		n := it.n
		parent := n.parent
		for i, c := range parent.children {
			if c == n {
				parent.children = append(parent.children[:i], parent.children[i+1:]...)
				break
			}
		}
		p.size -= len(n.edge)
		n.parent = nil
		if parent != &p.root && len(parent.children) == 0 {
			heap.Push(&h, leafItem{parent, parent.recency()})
		}
	}
}

// Start runs eviction every eviction interval until ctx is done.
func (p *CacheAware) Start(ctx context.Context) {
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

// TreeSize is the number of characters (bytes) the tree holds.
func (p *CacheAware) TreeSize() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.size
}

type leafItem struct {
	n    *caNode
	last int64
}

type leafHeap []leafItem

func (h leafHeap) Len() int           { return len(h) }
func (h leafHeap) Less(i, j int) bool { return h[i].last < h[j].last }
func (h leafHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *leafHeap) Push(x any)        { *h = append(*h, x.(leafItem)) }
func (h *leafHeap) Pop() any {
	old := *h
	it := old[len(old)-1]
	*h = old[:len(old)-1]
	return it
}
