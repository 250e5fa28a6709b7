package policy

import (
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/smg-project/smg-extproc/pkg/workers"
)

func TestConsistentHashing(t *testing.T) {
	ws := mkws("w1", "w2", "w3")
	p := build(t, "consistent_hashing", DefaultOptions(), Deps{Rand: &seqRand{vals: []int{2, 1}}})
	keyed := func(r Request) int { return p.Pick(ws, r) }

	tests := []struct {
		name string
		req  Request
		want int
	}{
		{"target worker", Request{TargetWorker: "1"}, 1},
		{"target worker beats routing key", Request{TargetWorker: "0", RoutingKey: "x"}, 0},
		{"target out of range", Request{TargetWorker: "3"}, NoSelection},
		{"target not a number", Request{TargetWorker: "one"}, NoSelection},
		{"target negative", Request{TargetWorker: "-1"}, NoSelection},
		{"routing key", Request{RoutingKey: "user-123"}, keyed(Request{RoutingKey: "user-123"})},
		{"authorization is the implicit key", Request{Authorization: "Bearer a", ForwardedFor: "1.2.3.4"}, keyed(Request{RoutingKey: "Bearer a"})},
		{"then x-forwarded-for", Request{ForwardedFor: "1.2.3.4", Cookie: "c"}, keyed(Request{RoutingKey: "1.2.3.4"})},
		{"then cookie", Request{Cookie: "sid=1"}, keyed(Request{RoutingKey: "sid=1"})},
		{"else random", Request{}, 2},
		{"over-cap key is ignored", Request{RoutingKey: strings.Repeat("k", 129)}, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			assert.Equal(t, tt.want, p.Pick(ws, tt.req))
		})
	}
	t.Run("target unavailable", func(t *testing.T) {
		ws := mkws("a", "b")
		ws[1].SetHealthy(false)
		assert.Equal(t, NoSelection, p.Pick(ws, Request{TargetWorker: "1"}))
	})
}

func TestConsistentHashingStableAndMinimalMoves(t *testing.T) {
	ws := mkws("w1", "w2", "w3", "w4")
	p := build(t, "consistent_hashing", DefaultOptions(), Deps{})
	before := map[string]*workers.Worker{}
	spread := map[*workers.Worker]int{}
	for i := 0; i < 400; i++ {
		k := fmt.Sprintf("user-%d", i)
		w := ws[p.Pick(ws, Request{RoutingKey: k})]
		before[k] = w
		spread[w]++
		require.Same(t, w, ws[p.Pick(ws, Request{RoutingKey: k})], "stable")
	}
	assert.Len(t, spread, 4, "keys spread over every worker")
	for _, n := range spread {
		assert.Greater(t, n, 40)
	}
	// w3 goes away: only its keys move; the others stay put.
	rest := []*workers.Worker{ws[0], ws[1], ws[3]}
	for k, w := range before {
		got := rest[p.Pick(rest, Request{RoutingKey: k})]
		if w != ws[2] {
			assert.Same(t, w, got, k)
		} else {
			assert.NotSame(t, ws[2], got)
		}
	}
}

func TestPrefixHash(t *testing.T) {
	o := DefaultOptions()
	o.PrefixTokenCount = 2 // 8 characters
	t.Run("shared prefix routes alike", func(t *testing.T) {
		ws := mkws("w1", "w2", "w3")
		p := build(t, "prefix_hash", o, Deps{})
		a := p.Pick(ws, Request{Text: "abcdefgh-one"})
		for _, s := range []string{"abcdefgh-two", "abcdefgh", "abcdefghzzzzzzzzzzzzzz"} {
			assert.Equal(t, a, p.Pick(ws, Request{Text: s}), s)
		}
	})
	t.Run("prefix counts characters", func(t *testing.T) {
		ws := mkws("w1", "w2", "w3")
		p := build(t, "prefix_hash", o, Deps{})
		assert.Equal(t, p.Pick(ws, Request{Text: "ééééééééA"}), p.Pick(ws, Request{Text: "ééééééééB"}))
		assert.Equal(t, "éééé", runePrefix("éééééé", 4))
		assert.Equal(t, "ab", runePrefix("ab", 4))
	})
	t.Run("different prefixes spread", func(t *testing.T) {
		ws := mkws("w1", "w2", "w3")
		p := build(t, "prefix_hash", DefaultOptions(), Deps{})
		seen := map[int]bool{}
		for i := 0; i < 100; i++ {
			seen[p.Pick(ws, Request{Text: fmt.Sprintf("prompt %d ...", i)})] = true
		}
		assert.Len(t, seen, 3)
	})
	t.Run("routing key overrides text", func(t *testing.T) {
		ws := mkws("w1", "w2", "w3")
		p := build(t, "prefix_hash", DefaultOptions(), Deps{})
		want := p.Pick(ws, Request{RoutingKey: "k"})
		for i := 0; i < 20; i++ {
			assert.Equal(t, want, p.Pick(ws, Request{RoutingKey: "k", Text: fmt.Sprint(i)}))
		}
	})
	t.Run("nothing to hash takes the least loaded", func(t *testing.T) {
		ws := mkws("w1", "w2", "w3")
		setLoad(t, ws[0], 3)
		setLoad(t, ws[2], 1)
		p := build(t, "prefix_hash", DefaultOptions(), Deps{})
		assert.Equal(t, 1, p.Pick(ws, Request{}))
	})
	t.Run("overloaded target falls back to the least loaded", func(t *testing.T) {
		ws := mkws("w1", "w2", "w3")
		p := build(t, "prefix_hash", DefaultOptions(), Deps{})
		req := Request{Text: "hello world"}
		target := p.Pick(ws, req)
		// avg = (30+1)/3 ≈ 10.3: limit max(12.9, 20.3) = 20.3; the target at
		// 30 is overloaded, the others (0) are fine.
		setLoad(t, ws[target], 30)
		got := p.Pick(ws, req)
		assert.NotEqual(t, target, got)
		assert.Equal(t, int64(0), ws[got].Load())
	})
	t.Run("moderately loaded target is kept", func(t *testing.T) {
		ws := mkws("w1", "w2", "w3")
		p := build(t, "prefix_hash", DefaultOptions(), Deps{})
		req := Request{Text: "hello world"}
		target := p.Pick(ws, req)
		setLoad(t, ws[target], 9) // avg 3.3: limit max(4.2, 13.3)
		assert.Equal(t, target, p.Pick(ws, req))
	})
}

func TestRingCacheBounded(t *testing.T) {
	var c ringCache
	for i := 0; i < maxRings+10; i++ {
		c.get(mkws("a", "b"))
	}
	c.mu.RLock()
	defer c.mu.RUnlock()
	assert.Len(t, c.rings, maxRings)
	assert.Len(t, c.order, maxRings)
}
