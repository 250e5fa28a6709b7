package policy_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/smg-project/smg-extproc/pkg/pairing"
	"github.com/smg-project/smg-extproc/pkg/policy"
	"github.com/smg-project/smg-extproc/pkg/workers"
)

func vw(id string, t workers.Type, conn string) *workers.Worker {
	w := &workers.Worker{ID: id, URL: "http://" + id + ":8000", BaseURL: "http://" + id + ":8000", Type: t, Runtime: "vllm", KVConnector: conn}
	w.SetHealthy(true)
	return w
}

func selector(t *testing.T, prefill, decode string, ws ...*workers.Worker) *pairing.Selector {
	t.Helper()
	pp, err := policy.Build(prefill, policy.LegPrefill, policy.DefaultOptions(), policy.Deps{Rand: policy.SeededRand(1)})
	require.NoError(t, err)
	dp, err := policy.Build(decode, policy.LegDecode, policy.DefaultOptions(), policy.Deps{Rand: policy.SeededRand(2)})
	require.NoError(t, err)
	s := pairing.NewSelector(pp, dp, pairing.Lenient)
	s.Available = (*workers.Worker).Available
	require.Nil(t, s.Rebuild(ws))
	return s
}

func pairs(t *testing.T, s *pairing.Selector, req policy.Request, n int) []string {
	t.Helper()
	out := make([]string, n)
	for i := range out {
		p, aerr := s.SelectPair(req)
		require.Nil(t, aerr)
		out[i] = p.Prefill.ID + "/" + p.Decode.ID
	}
	return out
}

// Checklist 64: cohorts P1(nixl){D1,D2} and P2(mooncake){D3,D4} under round
// robin on both legs: 120 requests give 60 per prefill and 30 per decode.
func TestChecklist64CohortRoundRobin(t *testing.T) {
	s := selector(t, "round_robin", "round_robin",
		vw("P1", workers.Prefill, "NixlConnector"), vw("P2", workers.Prefill, "MooncakeConnector"),
		vw("D1", workers.Decode, "NixlConnector"), vw("D2", workers.Decode, "NixlConnector"),
		vw("D3", workers.Decode, "MooncakeConnector"), vw("D4", workers.Decode, "MooncakeConnector"))
	got := map[string]int{}
	for _, p := range pairs(t, s, policy.Request{}, 120) {
		got[p[:2]]++
		got[p[3:]]++
	}
	assert.Equal(t, map[string]int{"P1": 60, "P2": 60, "D1": 30, "D2": 30, "D3": 30, "D4": 30}, got)
}

// Checklist 66: round robin on the decode leg with D1, D2 alternates decodes,
// whatever the prefill leg does.
func TestChecklist66DecodeAlternates(t *testing.T) {
	s := selector(t, "round_robin", "round_robin",
		vw("P1", workers.Prefill, "NixlConnector"), vw("P2", workers.Prefill, "NixlConnector"),
		vw("D1", workers.Decode, "NixlConnector"), vw("D2", workers.Decode, "NixlConnector"))
	got := pairs(t, s, policy.Request{}, 6)
	var decodes, prefills []string
	for _, p := range got {
		prefills = append(prefills, p[:2])
		decodes = append(decodes, p[3:])
	}
	assert.Equal(t, []string{"P1", "P2", "P1", "P2", "P1", "P2"}, prefills)
	for i := 1; i < len(decodes); i++ {
		assert.NotEqual(t, decodes[i-1], decodes[i], "decodes alternate: %v", decodes)
	}
}

// Checklist 67: manual with x-smg-routing-key sticks to the same P and D
// (per-leg namespaces) until that worker becomes unhealthy.
func TestChecklist67ManualSticky(t *testing.T) {
	ps := []*workers.Worker{vw("P1", workers.Prefill, "NixlConnector"), vw("P2", workers.Prefill, "NixlConnector"), vw("P3", workers.Prefill, "NixlConnector")}
	ds := []*workers.Worker{vw("D1", workers.Decode, "NixlConnector"), vw("D2", workers.Decode, "NixlConnector"), vw("D3", workers.Decode, "NixlConnector")}
	s := selector(t, "manual", "manual", append(append([]*workers.Worker{}, ps...), ds...)...)
	req := policy.Request{RoutingKey: "k"}
	first := pairs(t, s, req, 1)[0]
	for _, p := range pairs(t, s, req, 20) {
		assert.Equal(t, first, p)
	}
	// Other keys spread independently; k stays.
	for i := 0; i < 20; i++ {
		_, aerr := s.SelectPair(policy.Request{RoutingKey: string(rune('a' + i))})
		require.Nil(t, aerr)
	}
	assert.Equal(t, first, pairs(t, s, req, 1)[0])

	// Take the pinned decode down: k moves its decode only, and sticks there.
	byID := map[string]*workers.Worker{}
	for _, w := range append(ps, ds...) {
		byID[w.ID] = w
	}
	byID[first[3:]].SetHealthy(false)
	moved := pairs(t, s, req, 1)[0]
	assert.Equal(t, first[:2], moved[:2], "prefill pin unaffected")
	assert.NotEqual(t, first[3:], moved[3:])
	for _, p := range pairs(t, s, req, 10) {
		assert.Equal(t, moved, p)
	}
}

// Checklist 68: consistent_hashing with x-smg-target-worker: 1 selects the
// candidate at index 1; when that worker is unavailable the candidates the
// selector hands over no longer reach index 1 and the pick fails.
func TestChecklist68TargetWorker(t *testing.T) {
	p, err := policy.Build("consistent_hashing", policy.LegDecode, policy.DefaultOptions(), policy.Deps{})
	require.NoError(t, err)
	d0, d1 := vw("D0", workers.Decode, ""), vw("D1", workers.Decode, "")
	all := []*workers.Worker{d0, d1}
	req := policy.Request{TargetWorker: "1", RoutingKey: "ignored"}
	for range 5 {
		assert.Equal(t, 1, p.Pick(all, req))
	}
	d1.SetHealthy(false)
	assert.Equal(t, policy.NoSelection, p.Pick([]*workers.Worker{d0}, req), "filtered candidates")
	assert.Equal(t, policy.NoSelection, p.Pick(all, req), "unfiltered candidates")
}
