package pairing

import (
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/smg-project/smg-extproc/pkg/apierr"
	"github.com/smg-project/smg-extproc/pkg/policy"
	"github.com/smg-project/smg-extproc/pkg/workers"
)

func rr(t testing.TB) policy.Policy {
	p, ok, err := policy.New("round_robin")
	require.NoError(t, err)
	require.True(t, ok)
	return p
}

func newSel(t testing.TB, m Mode, ws ...*workers.Worker) *Selector {
	s := NewSelector(rr(t), rr(t), m)
	s.Rebuild(ws)
	return s
}

func vp(id, conn string) *workers.Worker { return mk(id, workers.Prefill, "vllm", conn, nil) }
func vd(id, conn string) *workers.Worker { return mk(id, workers.Decode, "vllm", conn, nil) }

func ids(ws []*workers.Worker) []string {
	out := make([]string, len(ws))
	for i, w := range ws {
		out[i] = w.ID
	}
	return out
}

func TestBuildIndex(t *testing.T) {
	pn, pm, ps := vp("pn", "NixlConnector"), vp("pm", "MooncakeConnector"), vp("ps", "")
	dn, dm := vd("dn", "NixlConnector"), vd("dm", "MooncakeConnector")
	reg := mk("r", workers.Regular, "vllm", "", nil)
	ws := []*workers.Worker{pn, dn, reg, pm, dm, ps}

	tests := []struct {
		mode     Mode
		prefill  []string
		partners map[string][]string
	}{
		{Lenient, []string{"pn", "pm", "ps"}, map[string][]string{"pn": {"dn"}, "pm": {"dm"}, "ps": {"dn", "dm"}}},
		{Strict, []string{"pn", "pm"}, map[string][]string{"pn": {"dn"}, "pm": {"dm"}, "ps": nil}},
		{Off, []string{"pn", "pm", "ps"}, map[string][]string{"pn": {"dn", "dm"}, "pm": {"dn", "dm"}, "ps": {"dn", "dm"}}},
	}
	for _, tt := range tests {
		t.Run(tt.mode.String(), func(t *testing.T) {
			ix := BuildIndex(ws, tt.mode)
			assert.Equal(t, tt.mode, ix.Mode())
			assert.Equal(t, tt.prefill, ids(ix.prefill))
			assert.Equal(t, []string{"pn", "pm", "ps"}, ids(ix.prefillPool))
			assert.Equal(t, []string{"dn", "dm"}, ids(ix.decodePool))
			for _, p := range []*workers.Worker{pn, pm, ps} {
				want := tt.partners[p.ID]
				if want == nil {
					assert.Nil(t, ix.Partners(p), p.ID)
					continue
				}
				assert.Equal(t, want, ids(ix.Partners(p)), p.ID)
			}
			assert.Nil(t, ix.Refusal())
		})
	}

	t.Run("equal descriptors share one list", func(t *testing.T) {
		ix := BuildIndex([]*workers.Worker{vp("p1", "NixlConnector"), vp("p2", "NixlConnector"), dn}, Lenient)
		require.Len(t, ix.partners, 2)
		assert.Same(t, &ix.partners[0][0], &ix.partners[1][0])
	})
	t.Run("an empty leg is not a refusal", func(t *testing.T) {
		assert.Nil(t, BuildIndex([]*workers.Worker{pn}, Strict).Refusal())
		assert.Nil(t, BuildIndex([]*workers.Worker{dn}, Strict).Refusal())
		assert.Nil(t, BuildIndex(nil, Strict).Refusal())
	})
}

func TestRefusal(t *testing.T) {
	tests := []struct {
		name       string
		mode       Mode
		ws         []*workers.Worker
		prefill    []string
		decode     []string
		mismatches []string
		message    string
	}{
		{
			name:       "59: nixl prefill, mooncake decode",
			mode:       Lenient,
			ws:         []*workers.Worker{vp("p", "NixlConnector"), vd("d", "MooncakeConnector")},
			prefill:    []string{"vllm/nixl/?"},
			decode:     []string{"vllm/mooncake/?"},
			mismatches: []string{"transport"},
			message:    `No prefill/decode pair shares a KV transfer protocol (mismatch on ["transport"]; prefill: ["vllm/nixl/?"], decode: ["vllm/mooncake/?"])`,
		},
		{
			name: "sorted and deduplicated",
			mode: Strict,
			ws: []*workers.Worker{
				vp("p1", "NixlConnector"), vp("p2", "NixlConnector"),
				mk("p3", workers.Prefill, "sglang", "", kv{"pairing_protocol": "blue"}),
				vd("d1", "MooncakeConnector"), vd("d2", ""),
			},
			prefill:    []string{"blue", "vllm/nixl/?"},
			decode:     []string{"vllm/?/?", "vllm/mooncake/?"},
			mismatches: []string{"runtime", "transport", "unknown transport"},
			message: `No prefill/decode pair shares a KV transfer protocol (mismatch on ["runtime", "transport", "unknown transport"]; ` +
				`prefill: ["blue", "vllm/nixl/?"], decode: ["vllm/?/?", "vllm/mooncake/?"])`,
		},
		{
			name: "61: strict refuses versions 1 and 0",
			mode: Strict,
			ws: []*workers.Worker{
				mk("p", workers.Prefill, "vllm", "NixlConnector", kv{"version": "1"}),
				mk("d", workers.Decode, "vllm", "NixlConnector", kv{"version": "0"}),
			},
			prefill:    []string{"vllm/nixl/?"},
			decode:     []string{"vllm/nixl/?"},
			mismatches: []string{"version"},
			message:    `No prefill/decode pair shares a KV transfer protocol (mismatch on ["version"]; prefill: ["vllm/nixl/?"], decode: ["vllm/nixl/?"])`,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := NewSelector(rr(t), rr(t), tt.mode)
			ref := s.Rebuild(tt.ws)
			require.NotNil(t, ref)
			assert.Same(t, ref, s.Refusal())
			assert.Equal(t, tt.prefill, ref.Prefill)
			assert.Equal(t, tt.decode, ref.Decode)
			assert.Equal(t, tt.mismatches, ref.Mismatches)
			assert.Equal(t, tt.message, ref.Message())

			_, aerr := s.SelectPair(policy.Request{})
			require.NotNil(t, aerr)
			assert.Equal(t, 503, aerr.Status)
			assert.Equal(t, apierr.CodeNoCompatiblePair, aerr.Code)
			assert.Equal(t, tt.message, aerr.Message)
		})
	}
}

// TestPairingMatrix is checklist 59–63 end to end: does a one-prefill,
// one-decode fleet serve a request in each mode?
func TestPairingMatrix(t *testing.T) {
	tests := []struct {
		name   string
		p, d   *workers.Worker
		paired [3]bool // off, lenient, strict
	}{
		{"59/62: nixl vs mooncake", vp("p", "NixlConnector"), vd("d", "MooncakeConnector"), [3]bool{true, false, false}},
		{"60: unknown transport vs nixl", vp("p", ""), vd("d", "NixlConnector"), [3]bool{true, true, false}},
		{"61: versions 1 and 0",
			mk("p", workers.Prefill, "vllm", "NixlConnector", kv{"version": "1"}),
			mk("d", workers.Decode, "vllm", "NixlConnector", kv{"version": "0"}), [3]bool{true, true, false}},
		{"62: different runtimes", mk("p", workers.Prefill, "sglang", "", nil), vd("d", "NixlConnector"), [3]bool{true, false, false}},
		{"63: blue/blue across transports",
			mk("p", workers.Prefill, "vllm", "NixlConnector", kv{"pairing_protocol": "blue"}),
			mk("d", workers.Decode, "vllm", "MooncakeConnector", kv{"pairing_protocol": "blue"}), [3]bool{true, true, true}},
		{"63: blue/red",
			mk("p", workers.Prefill, "vllm", "NixlConnector", kv{"pairing_protocol": "blue"}),
			mk("d", workers.Decode, "vllm", "NixlConnector", kv{"pairing_protocol": "red"}), [3]bool{true, false, false}},
		{"63: explicit on one side, facts agree",
			mk("p", workers.Prefill, "vllm", "NixlConnector", kv{"pairing_protocol": "blue"}), vd("d", "NixlConnector"), [3]bool{true, true, false}},
		{"63: explicit on one side, facts differ",
			mk("p", workers.Prefill, "vllm", "NixlConnector", kv{"pairing_protocol": "blue"}), vd("d", "MooncakeConnector"), [3]bool{true, false, false}},
		{"layout differs",
			mk("p", workers.Prefill, "vllm", "NixlConnector", kv{"block_size": "16"}),
			mk("d", workers.Decode, "vllm", "NixlConnector", kv{"page_size": "32"}), [3]bool{true, false, false}},
		{"layout on one side",
			mk("p", workers.Prefill, "vllm", "NixlConnector", kv{"kv_cache_dtype": "auto"}), vd("d", "NixlConnector"), [3]bool{true, true, false}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for i, m := range [3]Mode{Off, Lenient, Strict} {
				pair, aerr := newSel(t, m, tt.p, tt.d).SelectPair(policy.Request{})
				if tt.paired[i] {
					require.Nil(t, aerr, "mode %s", m)
					assert.Equal(t, Pair{Prefill: tt.p, Decode: tt.d}, pair, "mode %s", m)
				} else {
					require.NotNil(t, aerr, "mode %s", m)
					assert.Equal(t, apierr.CodeNoCompatiblePair, aerr.Code, "mode %s", m)
				}
			}
		})
	}
}

func TestSelectPairUnavailable(t *testing.T) {
	down := func(w *workers.Worker) *workers.Worker { w.SetHealthy(false); return w }
	tests := []struct {
		name string
		ws   []*workers.Worker
		code string
		msg  string
	}{
		{"no workers", nil, apierr.CodeNoAvailableWorkers, msgNoPrefill},
		{"no prefill pool", []*workers.Worker{vd("d", "NixlConnector")}, apierr.CodeNoAvailableWorkers,
			"No available servers: No prefill workers available. Please check if prefill servers are configured and healthy."},
		{"no decode pool", []*workers.Worker{vp("p", "NixlConnector")}, apierr.CodeNoAvailableWorkers,
			"No available servers: No decode workers available. Please check if decode servers are configured and healthy."},
		{"empty leg wins over refusal", []*workers.Worker{vd("d", "NixlConnector")}, apierr.CodeNoAvailableWorkers, msgNoPrefill},
		{"refusal wins over health", []*workers.Worker{down(vp("p", "NixlConnector")), down(vd("d", "MooncakeConnector"))},
			apierr.CodeNoCompatiblePair, ""},
		{"every paired prefill down", []*workers.Worker{down(vp("p", "NixlConnector")), vd("d", "NixlConnector")},
			apierr.CodeNoAvailableWorkers, "No available prefill workers (all circuits open or unhealthy)"},
		{"prefills up, every partner down", []*workers.Worker{vp("p", "NixlConnector"), down(vd("d", "NixlConnector"))},
			apierr.CodeNoAvailableWorkers, "No available decode workers (all circuits open or unhealthy)"},
		{"up prefill's partners down, paired prefill down", []*workers.Worker{
			vp("p1", "NixlConnector"), down(vp("p2", "MooncakeConnector")),
			down(vd("d1", "NixlConnector")), vd("d2", "MooncakeConnector"),
		}, apierr.CodeNoAvailableWorkers, msgDecodeDown},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, aerr := newSel(t, Lenient, tt.ws...).SelectPair(policy.Request{})
			require.NotNil(t, aerr)
			assert.Equal(t, 503, aerr.Status)
			assert.Equal(t, tt.code, aerr.Code)
			if tt.msg != "" {
				assert.Equal(t, tt.msg, aerr.Message)
			}
		})
	}

	t.Run("before the first rebuild", func(t *testing.T) {
		_, aerr := NewSelector(rr(t), rr(t), Lenient).SelectPair(policy.Request{})
		require.NotNil(t, aerr)
		assert.Equal(t, msgNoPrefill, aerr.Message)
		_, aerr = NewSelector(rr(t), rr(t), Lenient).SelectPrefill(policy.Request{})
		require.NotNil(t, aerr)
		assert.Equal(t, apierr.CodeNoPrefillServers, aerr.Code)
	})
}

// count runs n selections and tallies the picks per worker id.
func count(t *testing.T, s *Selector, n int) map[string]int {
	t.Helper()
	got := map[string]int{}
	for range n {
		pair, aerr := s.SelectPair(policy.Request{})
		require.Nil(t, aerr)
		require.Empty(t, Mismatch(DescriptorOf(pair.Prefill), DescriptorOf(pair.Decode), s.Mode), "incompatible pair")
		got[pair.Prefill.ID]++
		got[pair.Decode.ID]++
	}
	return got
}

// setRR is round robin with a rotation per candidate set, as SMG's
// RoundRobinPolicy keeps it (keyed by the available candidates in order). A
// single shared counter cannot pass checklist 64: prefills alternate, so each
// cohort only ever sees even or odd counter values and sticks to one decode.
type setRR struct {
	mu  sync.Mutex
	pos map[string]int
}

func (*setRR) Name() string { return "round_robin" }

func (r *setRR) Pick(cands []*workers.Worker, _ policy.Request) int {
	var key strings.Builder
	for _, w := range cands {
		fmt.Fprintf(&key, "%p,", w)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.pos == nil {
		r.pos = map[string]int{}
	}
	n := r.pos[key.String()]
	r.pos[key.String()] = n + 1
	return n % len(cands)
}

// Checklist 64: each prefill's decode leg stays inside its cohort, and with a
// per-set rotation every decode of a cohort gets an even share.
func TestCohortRouting(t *testing.T) {
	fleet := func() []*workers.Worker {
		return []*workers.Worker{
			vp("P1", "NixlConnector"), vp("P2", "MooncakeConnector"),
			vd("D1", "NixlConnector"), vd("D2", "NixlConnector"),
			vd("D3", "MooncakeConnector"), vd("D4", "MooncakeConnector"),
		}
	}
	t.Run("per-set round robin", func(t *testing.T) {
		s := NewSelector(&setRR{}, &setRR{}, Lenient)
		s.Rebuild(fleet())
		assert.Equal(t, map[string]int{"P1": 60, "P2": 60, "D1": 30, "D2": 30, "D3": 30, "D4": 30}, count(t, s, 120))
	})
	t.Run("policy.RoundRobin", func(t *testing.T) {
		// The prefill split and cohort containment hold with any policy; the
		// even decode split needs policy.RoundRobin to rotate per set.
		got := count(t, newSel(t, Lenient, fleet()...), 120)
		assert.Equal(t, 60, got["P1"])
		assert.Equal(t, 60, got["P2"])
		assert.Equal(t, 60, got["D1"]+got["D2"])
		assert.Equal(t, 60, got["D3"]+got["D4"])
	})
}

// Checklist 65: a prefill whose only partner is down is skipped.
func TestPartnerDownSkipsPrefill(t *testing.T) {
	d1 := vd("D1", "NixlConnector")
	s := newSel(t, Lenient, vp("P1", "NixlConnector"), vp("P2", "MooncakeConnector"), d1, vd("D2", "MooncakeConnector"))
	d1.SetHealthy(false)
	assert.Equal(t, map[string]int{"P2": 20, "D2": 20}, count(t, s, 20))

	d1.SetHealthy(true) // health is read live; no rebuild needed
	assert.Equal(t, map[string]int{"P1": 10, "P2": 10, "D1": 10, "D2": 10}, count(t, s, 20))
}

func TestDownDecodeFilteredFromPartners(t *testing.T) {
	d2 := vd("D2", "NixlConnector")
	s := newSel(t, Lenient, vp("P1", "NixlConnector"), vd("D1", "NixlConnector"), d2, vd("D3", "NixlConnector"))
	d2.SetHealthy(false)
	assert.Equal(t, map[string]int{"P1": 10, "D1": 5, "D3": 5}, count(t, s, 10))
}

func TestAvailableHook(t *testing.T) {
	p1, p2, d := vp("P1", "NixlConnector"), vp("P2", "NixlConnector"), vd("D", "NixlConnector")
	s := newSel(t, Lenient, p1, p2, d)
	s.Available = func(w *workers.Worker) bool { return w != p1 && w.Healthy() } // P1's breaker open
	assert.Equal(t, map[string]int{"P2": 6, "D": 6}, count(t, s, 6))
	w, aerr := s.SelectPrefill(policy.Request{})
	require.Nil(t, aerr)
	assert.Same(t, p2, w)
}

func TestSelectPrefill(t *testing.T) {
	// The unpaired prefill still counts tokens: count_tokens has no decode leg.
	p1, p2 := vp("P1", "NixlConnector"), vp("P2", "MooncakeConnector")
	s := newSel(t, Lenient, p1, p2, vd("D", "NixlConnector"))
	got := map[string]int{}
	for range 4 {
		w, aerr := s.SelectPrefill(policy.Request{})
		require.Nil(t, aerr)
		got[w.ID]++
	}
	assert.Equal(t, map[string]int{"P1": 2, "P2": 2}, got)

	p1.SetHealthy(false)
	w, aerr := s.SelectPrefill(policy.Request{})
	require.Nil(t, aerr)
	assert.Same(t, p2, w)

	p2.SetHealthy(false)
	_, aerr = s.SelectPrefill(policy.Request{})
	require.NotNil(t, aerr)
	assert.Equal(t, 503, aerr.Status)
	assert.Equal(t, apierr.CodeNoPrefillServers, aerr.Code)
	assert.Equal(t, "No available prefill servers to count tokens", aerr.Message)

	_, aerr = newSel(t, Lenient, vd("D", "NixlConnector")).SelectPrefill(policy.Request{})
	require.NotNil(t, aerr)
	assert.Equal(t, apierr.CodeNoPrefillServers, aerr.Code)
}

func TestSync(t *testing.T) {
	reg := workers.NewRegistry()
	s := NewSelector(rr(t), rr(t), Lenient)

	_, rebuilt := s.Sync(reg.Snapshot)
	assert.True(t, rebuilt, "first call indexes")
	_, rebuilt = s.Sync(reg.Snapshot)
	assert.False(t, rebuilt, "same snapshot")

	require.NoError(t, reg.Add(vp("P", "NixlConnector")))
	require.NoError(t, reg.Add(vd("D", "MooncakeConnector")))
	ref, rebuilt := s.Sync(reg.Snapshot)
	assert.True(t, rebuilt)
	require.NotNil(t, ref)
	assert.Equal(t, []string{"transport"}, ref.Mismatches)

	d := vd("D2", "NixlConnector")
	require.NoError(t, reg.Add(d))
	ref, rebuilt = s.Sync(reg.Snapshot)
	assert.True(t, rebuilt)
	assert.Nil(t, ref)
	pair, aerr := s.SelectPair(policy.Request{})
	require.Nil(t, aerr)
	assert.Same(t, d, pair.Decode)
	_, rebuilt = s.Sync(reg.Snapshot)
	assert.False(t, rebuilt)
}

func fleet(n int) []*workers.Worker {
	var ws []*workers.Worker
	for i := range n {
		ws = append(ws, vp(fmt.Sprintf("p%d", i), "NixlConnector"))
	}
	for i := range n {
		ws = append(ws, vd(fmt.Sprintf("d%d", i), "NixlConnector"))
	}
	return ws
}

// The request path allocates nothing beyond what an error returns, even when
// workers must be filtered out.
func TestSelectPairAllocs(t *testing.T) {
	ws := fleet(8)
	s := newSel(t, Lenient, ws...)
	sel := func() {
		if _, aerr := s.SelectPair(policy.Request{}); aerr != nil {
			t.Fatal(aerr)
		}
	}
	assert.Zero(t, testing.AllocsPerRun(200, sel), "all available")
	if raceEnabled {
		t.Skip("sync.Pool drops items at random under -race")
	}
	ws[1].SetHealthy(false)
	ws[9].SetHealthy(false)
	sel() // warm the scratch pool
	assert.Zero(t, testing.AllocsPerRun(200, sel), "some down")
}

func BenchmarkSelectPair(b *testing.B) {
	for _, down := range []bool{false, true} {
		b.Run(fmt.Sprintf("8x8/some_down=%t", down), func(b *testing.B) {
			ws := fleet(8)
			if down {
				ws[2].SetHealthy(false)  // a prefill
				ws[11].SetHealthy(false) // a decode
			}
			s := newSel(b, Lenient, ws...)
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				if _, aerr := s.SelectPair(policy.Request{}); aerr != nil {
					b.Fatal(aerr)
				}
			}
		})
	}
	b.Run("8x8/parallel", func(b *testing.B) {
		s := newSel(b, Lenient, fleet(8)...)
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				if _, aerr := s.SelectPair(policy.Request{}); aerr != nil {
					b.Fatal(aerr)
				}
			}
		})
	})
}

// Past 64 prefills eligibility is judged per worker rather than from the mask.
func TestManyPrefillsSomeDown(t *testing.T) {
	var ws []*workers.Worker
	for i := range 70 {
		ws = append(ws, vp(fmt.Sprintf("p%d", i), "NixlConnector"))
	}
	ws = append(ws, vd("d", "NixlConnector"))
	s := newSel(t, Lenient, ws...)
	ws[0].SetHealthy(false)
	ws[65].SetHealthy(false)
	got := count(t, s, 68)
	assert.Len(t, got, 69, "68 prefills and the decode")
	assert.Zero(t, got["p0"])
	assert.Zero(t, got["p65"])
	assert.Equal(t, 1, got["p64"])
	assert.Equal(t, 1, got["p69"])
}
