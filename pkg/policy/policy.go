// Package policy holds the per-leg worker selection policies. Each leg owns its
// own instance, so stateful policies keep separate state per leg.
package policy

import (
	"fmt"
	"math/rand/v2"
	"sync/atomic"

	"github.com/smg-project/smg-extproc/pkg/workers"
)

// Request is what a policy may look at.
type Request struct {
	Text       string
	RoutingKey string
}

// Policy picks one of the available candidates (never empty) and returns its index.
type Policy interface {
	Name() string
	Pick(cands []*workers.Worker, req Request) int
}

// New builds a policy by SMG name. Policies not implemented yet fall back to
// round_robin and say so (ok=false), so the caller can log it once.
func New(name string) (p Policy, implemented bool, err error) {
	switch name {
	case "round_robin":
		return &RoundRobin{}, true, nil
	case "random":
		return Random{}, true, nil
	case "power_of_two":
		return PowerOfTwo{}, true, nil
	case "least_load", "cache_aware", "prefix_hash", "consistent_hashing", "manual", "bucket":
		return &RoundRobin{name: name}, false, nil
	default:
		return nil, false, fmt.Errorf("unknown policy %q", name)
	}
}

// RoundRobin cycles over the candidates available at each pick.
type RoundRobin struct {
	n    atomic.Uint64
	name string
}

func (r *RoundRobin) Name() string {
	if r.name != "" {
		return r.name
	}
	return "round_robin"
}

func (r *RoundRobin) Pick(cands []*workers.Worker, _ Request) int {
	return int((r.n.Add(1) - 1) % uint64(len(cands)))
}

// Random picks uniformly.
type Random struct{}

func (Random) Name() string { return "random" }

func (Random) Pick(cands []*workers.Worker, _ Request) int { return rand.IntN(len(cands)) }

// PowerOfTwo samples two distinct candidates and keeps the less loaded one
// (the gateway's in-flight count).
type PowerOfTwo struct{}

func (PowerOfTwo) Name() string { return "power_of_two" }

func (PowerOfTwo) Pick(cands []*workers.Worker, _ Request) int {
	if len(cands) == 1 {
		return 0
	}
	i := rand.IntN(len(cands))
	j := (i + 1 + rand.IntN(len(cands)-1)) % len(cands)
	if cands[j].Load() < cands[i].Load() {
		return j
	}
	return i
}
