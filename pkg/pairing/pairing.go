// Package pairing chooses a prefill/decode pair for one request: the prefill
// policy picks among prefills that have an available partner, then the decode
// policy among that prefill's partners.
package pairing

import (
	"github.com/smg-project/smg-extproc/pkg/apierr"
	"github.com/smg-project/smg-extproc/pkg/policy"
	"github.com/smg-project/smg-extproc/pkg/workers"
)

// Selector holds one policy instance per leg.
type Selector struct {
	Prefill policy.Policy
	Decode  policy.Policy
}

// Pair is a selection result.
type Pair struct {
	Prefill *workers.Worker
	Decode  *workers.Worker
}

func available(ws []*workers.Worker, t workers.Type) (all, ok int, out []*workers.Worker) {
	for _, w := range ws {
		if w.Type != t {
			continue
		}
		all++
		if w.Healthy() {
			out = append(out, w)
		}
	}
	return all, len(out), out
}

// SelectPair picks a pair from a registry snapshot.
func (s *Selector) SelectPair(ws []*workers.Worker, req policy.Request) (Pair, *apierr.Error) {
	pAll, _, ps := available(ws, workers.Prefill)
	dAll, _, ds := available(ws, workers.Decode)
	switch {
	case pAll == 0:
		return Pair{}, apierr.New(503, apierr.CodeNoAvailableWorkers,
			"No available servers: No prefill workers available. Please check if prefill servers are configured and healthy.")
	case dAll == 0:
		return Pair{}, apierr.New(503, apierr.CodeNoAvailableWorkers,
			"No available servers: No decode workers available. Please check if decode servers are configured and healthy.")
	case len(ps) == 0:
		return Pair{}, apierr.New(503, apierr.CodeNoAvailableWorkers, "No available prefill workers (all circuits open or unhealthy)")
	case len(ds) == 0:
		return Pair{}, apierr.New(503, apierr.CodeNoAvailableWorkers, "No available decode workers (all circuits open or unhealthy)")
	}
	p := ps[s.Prefill.Pick(ps, req)]
	d := ds[s.Decode.Pick(ds, req)]
	return Pair{Prefill: p, Decode: d}, nil
}

// SelectPrefill picks one prefill (count_tokens).
func (s *Selector) SelectPrefill(ws []*workers.Worker, req policy.Request) (*workers.Worker, *apierr.Error) {
	_, _, ps := available(ws, workers.Prefill)
	if len(ps) == 0 {
		return nil, apierr.New(503, apierr.CodeNoPrefillServers, "No available prefill servers to count tokens")
	}
	return ps[s.Prefill.Pick(ps, req)], nil
}
