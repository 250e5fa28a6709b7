package policy

import (
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/smg-project/smg-extproc/pkg/workers"
)

func pickN(p Policy, ws []*workers.Worker, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = ws[p.Pick(ws, Request{})].ID
	}
	return out
}

func TestRoundRobin(t *testing.T) {
	w := mkws("w0", "w1", "w2")
	tests := []struct {
		name  string
		steps []func(p *RoundRobin) []string
		want  [][]string
	}{
		{
			name:  "rotates in order",
			steps: []func(p *RoundRobin) []string{func(p *RoundRobin) []string { return pickN(p, w, 5) }},
			want:  [][]string{{"w0", "w1", "w2", "w0", "w1"}},
		},
		{
			// A shrunken set is a new set and starts at the shared position
			// (1 by then); the full set resumes where it left off.
			name: "a set that shrinks and grows keeps rotating",
			steps: []func(p *RoundRobin) []string{
				func(p *RoundRobin) []string { return pickN(p, w, 1) },
				func(p *RoundRobin) []string { return pickN(p, []*workers.Worker{w[0], w[2]}, 2) },
				func(p *RoundRobin) []string { return pickN(p, w, 2) },
			},
			want: [][]string{{"w0"}, {"w2", "w0"}, {"w1", "w2"}},
		},
		{
			// Two interleaved sets on one instance each get an even spread.
			name: "interleaved sets rotate independently",
			steps: []func(p *RoundRobin) []string{
				func(p *RoundRobin) []string {
					a, b := w[:2], []*workers.Worker{w[2], w[0]}
					var out []string
					for i := 0; i < 4; i++ {
						out = append(out, a[p.Pick(a, Request{})].ID, b[p.Pick(b, Request{})].ID)
					}
					return out
				},
			},
			want: [][]string{{"w0", "w0", "w1", "w2", "w0", "w0", "w1", "w2"}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := NewRoundRobin()
			for i, step := range tt.steps {
				assert.Equal(t, tt.want[i], step(p), "step %d", i)
			}
		})
	}
}

func TestRoundRobinEvictsLeastRecentlyUsedSet(t *testing.T) {
	p := NewRoundRobin()
	hot := mkws("h0", "h1")
	assert.Equal(t, 0, p.Pick(hot, Request{}))
	filler := make([][]*workers.Worker, maxTrackedSets+3)
	for i := range filler {
		filler[i] = mkws("f0", "f1")
	}
	for _, s := range filler[:maxTrackedSets-2] {
		p.Pick(s, Request{})
	}
	assert.Equal(t, 1, p.Pick(hot, Request{})) // recent again before the cap is hit
	for _, s := range filler[maxTrackedSets-2:] {
		p.Pick(s, Request{})
	}
	assert.Equal(t, maxTrackedSets, p.tracked())
	assert.Equal(t, 0, p.Pick(hot, Request{}), "the hot set kept its rotation")
}
