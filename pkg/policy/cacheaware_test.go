package policy

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func newCA(t testing.TB, tune func(*Options), clock Clock) *CacheAware {
	t.Helper()
	o := DefaultOptions()
	if tune != nil {
		tune(&o)
	}
	if clock == nil {
		clock = newFakeClock()
	}
	return build(t, "cache_aware", o, Deps{Clock: clock}).(*CacheAware)
}

func TestCacheAwareRouting(t *testing.T) {
	type step struct {
		text  string
		loads []int64 // raise in-flight counts before the pick (nil = keep)
		cands []int   // candidate subset by index (nil = all)
		want  string
	}
	tests := []struct {
		name  string
		steps []step
	}{
		{"empty tree takes least loaded, then fewest routed", []step{
			{text: "hello", want: "w0"},
			{text: "zzz", want: "w1"},
			{text: "yyy", want: "w2"},
		}},
		{"match above threshold sticks to the holder", []step{
			{text: "hello", want: "w0"},
			{text: "zzz", want: "w1"},
			{text: "hello world", want: "w0"}, // 5/11 = 0.45 > 0.3
			{text: "hello world!!", want: "w0"},
		}},
		{"match below threshold takes least loaded", []step{
			{text: "hello", want: "w0"},
			{text: "hexxxxxxxxxx", want: "w1"}, // 2/12
		}},
		{"imbalance (abs and rel) takes least loaded", []step{
			{text: "hello", want: "w0"},
			{text: "hello", loads: []int64{100, 10, 50}, want: "w1"},
		}},
		{"abs difference alone is not imbalance", []step{
			{text: "hello", want: "w0"},
			{text: "hello", loads: []int64{100, 70, 90}, want: "w0"}, // 30 ≤ 64
		}},
		{"rel ratio alone is not imbalance", []step{
			{text: "hello", want: "w0"},
			{text: "hello", loads: []int64{60, 1, 1}, want: "w0"}, // 59 ≤ 64
		}},
		{"least loaded holder among several", []step{
			{text: "shared prefix", want: "w0"},
			{text: "shared prefix", loads: []int64{100, 0, 100}, want: "w1"}, // imbalanced: w1 now holds it too
			{text: "shared prefix!", loads: []int64{100, 50, 100}, want: "w1"},
		}},
		{"holder outside the candidates: shallower holder", []step{
			{text: "abcdefgh", want: "w0"},
			{text: "abcdXXXX", cands: []int{1, 2}, want: "w1"}, // no candidate holds any prefix yet
			{text: "abcdefgh", cands: []int{1, 2}, want: "w1"}, // w1 holds "abcd" (4/8 = 0.5)
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := newCA(t, nil, nil)
			ws := mkws("w0", "w1", "w2")
			for i, s := range tt.steps {
				for j, l := range s.loads {
					setLoad(t, ws[j], l)
				}
				cands := ws
				if s.cands != nil {
					cands = nil
					for _, j := range s.cands {
						cands = append(cands, ws[j])
					}
				}
				got := p.Pick(cands, Request{Text: s.text})
				require.GreaterOrEqual(t, got, 0)
				assert.Equal(t, s.want, cands[got].ID, "step %d (%q)", i, s.text)
			}
		})
	}
}

func TestCacheAwareTreeSplits(t *testing.T) {
	p := newCA(t, nil, nil)
	ws := mkws("w0")
	for _, s := range []string{"abc", "abd", "abc", "ab", "abcde", "x"} {
		p.Pick(ws, Request{Text: s})
	}
	// Edges: "ab", "c", "d", "de", "x".
	assert.Equal(t, 7, p.TreeSize())
	i, n := p.match("abcdz", ws, []int32{0})
	assert.Equal(t, 0, i)
	assert.Equal(t, 4, n)
	i, n = p.match("abdz", ws, []int32{0})
	assert.Equal(t, 0, i)
	assert.Equal(t, 3, n)
	i, _ = p.match("q", ws, []int32{0})
	assert.Equal(t, -1, i)
}

func TestCacheAwareMatchCountsCharacters(t *testing.T) {
	p := newCA(t, func(o *Options) { o.CacheThreshold = 0.5 }, nil)
	ws := mkws("w0", "w1")
	require.Equal(t, 0, p.Pick(ws, Request{Text: "ééé"}))
	// "éééaaaa": 3 of 7 characters match (but 6 of 10 bytes): below 0.5.
	assert.Equal(t, 1, p.Pick(ws, Request{Text: "éééaaaa"}))
	// Partial-rune match cut back to a boundary: "é" and "è" share a lead byte.
	i, n := p.match("è", ws, []int32{p.tenant(ws[0].URL), p.tenant(ws[1].URL)})
	assert.Equal(t, 0, n)
	_ = i
}

func TestCacheAwareEviction(t *testing.T) {
	clock := newFakeClock()
	p := newCA(t, func(o *Options) { o.MaxTreeSize = 25; o.EvictionInterval = time.Minute }, clock)
	ws := mkws("w0", "w1")
	texts := []string{strings.Repeat("a", 10), strings.Repeat("b", 10), strings.Repeat("c", 10)}
	for _, s := range texts {
		p.Pick(ws, Request{Text: s})
		clock.Advance(time.Second)
	}
	assert.Equal(t, 30, p.TreeSize(), "no eviction before the interval")
	clock.Advance(time.Minute)
	p.Pick(ws, Request{Text: "bbbbbbbbbb"}) // touches b; eviction runs first
	assert.Equal(t, 20, p.TreeSize(), "the least recently used leaf went")
	i, _ := p.match(texts[0], ws, []int32{0, 1})
	assert.Equal(t, -1, i, "a's text was evicted")
	i, _ = p.match(texts[2], ws, []int32{0, 1})
	assert.NotEqual(t, -1, i)
}

func TestCacheAwareEvictionCascades(t *testing.T) {
	clock := newFakeClock()
	p := newCA(t, func(o *Options) { o.MaxTreeSize = 0; o.EvictionInterval = time.Minute }, clock)
	ws := mkws("w0")
	for _, s := range []string{"abc", "abd", "abce", "x"} {
		p.Pick(ws, Request{Text: s})
	}
	p.mu.Lock()
	p.evictLocked(clock.Now())
	p.mu.Unlock()
	assert.Equal(t, 0, p.TreeSize())
	assert.Empty(t, p.root.children)
}

func BenchmarkCacheAwareLongText(b *testing.B) {
	p := newCA(b, nil, nil)
	ws := mkws("w0", "w1", "w2", "w3")
	text := strings.Repeat("the quick brown fox jumps over the lazy dog ", 200)
	p.Pick(ws, Request{Text: text})
	b.ReportAllocs()
	for b.Loop() {
		p.Pick(ws, Request{Text: text})
	}
}
