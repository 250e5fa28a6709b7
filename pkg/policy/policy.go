// Package policy holds the per-leg worker selection policies, one for each of
// SMG's policy names. Each leg owns its own instance, so stateful policies
// (round_robin's rotations, manual's sticky keys, cache_aware's tree, bucket's
// boundaries) keep separate state per leg.
//
// A policy is handed the candidates of one selection (already filtered to the
// available ones, in a stable order) and returns an index into them. The
// candidate slice may be a pooled buffer: policies never retain it.
package policy

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"
	"unsafe"

	"github.com/smg-project/smg-extproc/pkg/workers"
)

// NoSelection is what Pick returns when the policy refuses every candidate:
// consistent_hashing's x-smg-target-worker names an index that is out of
// range or unavailable, or least_load's waiting-request cap vetoes them all.
// The caller turns it into a 503 selection failure.
const NoSelection = -1

// MaxRoutingKeyBytes caps a routing key: newest SMG ignores a longer (or
// empty) x-smg-routing-key. Policies treat a longer key as absent.
const MaxRoutingKeyBytes = 128

// Request is what a policy may look at. All fields are optional; "" means
// absent. The processor fills it once per request and hands the same value
// to both legs.
type Request struct {
	// Text is the routing text (see SMG's per-endpoint table: generate text,
	// the whole chat history, the completion prompt, ...). cache_aware,
	// bucket and prefix_hash read it.
	Text string
	// RoutingKey is x-smg-routing-key (or the configured routing-key header).
	RoutingKey string
	// TargetWorker is the raw x-smg-target-worker value: a 0-based index
	// into the candidates (consistent_hashing only).
	TargetWorker string
	// Authorization, ForwardedFor and Cookie are the client's
	// authorization, x-forwarded-for and cookie headers: consistent_hashing's
	// implicit session key, in that order.
	Authorization string
	ForwardedFor  string
	Cookie        string
	// Model is the request's model (informational; every policy instance
	// serves one leg of one model).
	Model string
}

// routingKey is the request's routing key after the size cap.
func (r *Request) routingKey() string {
	if len(r.RoutingKey) > MaxRoutingKeyBytes {
		return ""
	}
	return r.RoutingKey
}

// Policy picks one of the candidates for one leg.
//
// Pick is called with a non-empty slice of available candidates in a stable
// order (registry order) and returns an index into it, or NoSelection (-1)
// when the policy refuses every candidate. It must be safe for concurrent use
// and must not retain cands.
type Policy interface {
	Name() string
	Pick(cands []*workers.Worker, req Request) int
}

// Runner is implemented by policies with periodic housekeeping (cache_aware's
// eviction, manual's idle-key eviction, bucket's boundary refit). Start runs
// it on a goroutine until ctx is done. A policy that is never started does
// the same housekeeping inline on Pick once its interval has passed, so it is
// bounded either way; starting it keeps that work off the request path.
// Calls after the first are no-ops.
type Runner interface {
	Start(ctx context.Context)
}

// Leg is the PD leg a policy instance serves.
type Leg int

const (
	LegPrefill Leg = iota
	LegDecode
)

func (l Leg) String() string {
	if l == LegDecode {
		return "decode"
	}
	return "prefill"
}

// Names returns the SMG policy names Build accepts.
func Names() []string {
	return []string{
		"random", "round_robin", "power_of_two", "least_load", "cache_aware",
		"prefix_hash", "consistent_hashing", "manual", "bucket",
	}
}

// NeedsEngineLoads reports whether the named policy scores engine-reported
// loads, i.e. whether an EngineLoadMonitor should run for its leg.
func NeedsEngineLoads(name string) bool { return name == "power_of_two" || name == "least_load" }

// Assignment modes of the manual policy.
const (
	AssignRandom   = "random"
	AssignMinLoad  = "min_load"
	AssignMinGroup = "min_group"
)

// Options holds SMG's policy tuning flags. Both legs get the same options.
// DefaultOptions returns SMG's CLI defaults.
type Options struct {
	// cache_aware (and bucket's imbalance test).
	CacheThreshold      float64       // --cache-threshold, 0.3
	BalanceAbsThreshold int64         // --balance-abs-threshold, 64
	BalanceRelThreshold float64       // --balance-rel-threshold, 1.5
	EvictionInterval    time.Duration // --eviction-interval, 120 s (cache_aware and manual)
	MaxTreeSize         int           // --max-tree-size, 67108864 characters
	BlockSize           int           // --block-size, 16 (event-driven gRPC only; unused over HTTP)

	// prefix_hash.
	PrefixTokenCount              int     // --prefix-token-count, 256 (×4 characters of text)
	LoadFactor                    float64 // --prefix-hash-load-factor, 1.25
	PrefixHashBalanceAbsThreshold int64   // --prefix-hash-balance-abs-threshold, 10

	// least_load and power_of_two.
	LeastLoadKVPressureWeight  float64 // λ seconds, 0.15
	LeastLoadDefaultThroughput float64 // tokens/s, 2000
	LeastLoadMeanPrefillTokens int     // 1024
	LeastLoadMaxWaitingReqs    int     // 0 = off

	// manual.
	AssignmentMode string        // --assignment-mode, "random" for manual
	MaxIdle        time.Duration // --max-idle-secs, 14400 s

	// bucket.
	BucketAdjustInterval time.Duration // bucket_adjust_interval_secs, 5 s

	// EngineLoadMonitor.
	LoadMonitorInterval time.Duration // --load-monitor-interval, 10 s
}

// DefaultOptions returns SMG's CLI defaults.
func DefaultOptions() Options {
	return Options{
		CacheThreshold:                0.3,
		BalanceAbsThreshold:           64,
		BalanceRelThreshold:           1.5,
		EvictionInterval:              120 * time.Second,
		MaxTreeSize:                   67108864,
		BlockSize:                     16,
		PrefixTokenCount:              256,
		LoadFactor:                    1.25,
		PrefixHashBalanceAbsThreshold: 10,
		LeastLoadKVPressureWeight:     0.15,
		LeastLoadDefaultThroughput:    2000,
		LeastLoadMeanPrefillTokens:    1024,
		LeastLoadMaxWaitingReqs:       0,
		AssignmentMode:                AssignRandom,
		MaxIdle:                       4 * time.Hour,
		BucketAdjustInterval:          5 * time.Second,
		LoadMonitorInterval:           10 * time.Second,
	}
}

// Validate reports the first invalid option.
func (o Options) Validate() error {
	switch {
	case o.CacheThreshold < 0 || o.CacheThreshold > 1:
		return fmt.Errorf("cache_threshold must be within [0, 1], got %v", o.CacheThreshold)
	case o.BalanceAbsThreshold < 0:
		return fmt.Errorf("balance_abs_threshold must not be negative, got %d", o.BalanceAbsThreshold)
	case o.BalanceRelThreshold < 0:
		return fmt.Errorf("balance_rel_threshold must not be negative, got %v", o.BalanceRelThreshold)
	case o.EvictionInterval < 0 || o.MaxIdle < 0 || o.BucketAdjustInterval < 0 || o.LoadMonitorInterval < 0:
		return fmt.Errorf("intervals must not be negative")
	case o.MaxTreeSize < 0:
		return fmt.Errorf("max_tree_size must not be negative, got %d", o.MaxTreeSize)
	case o.PrefixTokenCount < 0:
		return fmt.Errorf("prefix_token_count must not be negative, got %d", o.PrefixTokenCount)
	case o.LoadFactor < 0 || o.PrefixHashBalanceAbsThreshold < 0:
		return fmt.Errorf("prefix_hash load factor and threshold must not be negative")
	case o.LeastLoadMaxWaitingReqs < 0:
		return fmt.Errorf("least_load max waiting requests must not be negative, got %d", o.LeastLoadMaxWaitingReqs)
	}
	switch o.AssignmentMode {
	case "", AssignRandom, AssignMinLoad, AssignMinGroup:
	default:
		return fmt.Errorf("unknown assignment mode %q (want random, min_load or min_group)", o.AssignmentMode)
	}
	return nil
}

// Clock tells the time; injected so tests control eviction and windows.
type Clock interface{ Now() time.Time }

type wallClock struct{}

func (wallClock) Now() time.Time { return time.Now() }

// Rand is the randomness a policy draws on. It must be safe for concurrent use.
type Rand interface {
	// IntN returns a uniform int in [0, n); n > 0.
	IntN(n int) int
}

type globalRand struct{}

func (globalRand) IntN(n int) int { return rand.IntN(n) }

// SeededRand returns a deterministic, concurrency-safe Rand (for tests).
func SeededRand(seed uint64) Rand {
	return &lockedRand{r: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))}
}

type lockedRand struct {
	mu sync.Mutex
	r  *rand.Rand
}

func (l *lockedRand) IntN(n int) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.r.IntN(n)
}

// Deps are the things a policy gets injected. Zero values mean the wall
// clock, math/rand/v2's global source and no engine loads (load-scoring
// policies then fall back to the gateway's in-flight counts).
type Deps struct {
	Clock Clock
	Rand  Rand
	Loads LoadSource
}

func (d Deps) withDefaults() Deps {
	if d.Clock == nil {
		d.Clock = wallClock{}
	}
	if d.Rand == nil {
		d.Rand = globalRand{}
	}
	return d
}

// Build constructs the named policy for one leg. bucket is refused for the
// decode leg, as SMG refuses it at startup.
func Build(name string, leg Leg, opts Options, deps Deps) (Policy, error) {
	if err := opts.Validate(); err != nil {
		return nil, fmt.Errorf("%s policy: %w", name, err)
	}
	deps = deps.withDefaults()
	switch name {
	case "random":
		return &Random{rnd: deps.Rand}, nil
	case "round_robin":
		return NewRoundRobin(), nil
	case "power_of_two":
		return newPowerOfTwo(opts, deps), nil
	case "least_load":
		return newLeastLoad(opts, deps), nil
	case "cache_aware":
		return newCacheAware(opts, deps), nil
	case "prefix_hash":
		return newPrefixHash(opts, deps), nil
	case "consistent_hashing":
		return newConsistentHashing(deps), nil
	case "manual":
		return newManual(opts, deps), nil
	case "bucket":
		if leg == LegDecode {
			return nil, fmt.Errorf("bucket policy is not supported for the decode leg (prefill only)")
		}
		return newBucket(opts, deps), nil
	default:
		return nil, fmt.Errorf("unknown policy %q", name)
	}
}

// New builds a policy by SMG name with default options and dependencies for
// the prefill leg. It is the pre-Build signature, kept so existing callers
// compile; implemented is always true now. New callers use Build.
//
// Deprecated: use Build, which takes the leg, options and dependencies.
func New(name string) (p Policy, implemented bool, err error) {
	p, err = Build(name, LegPrefill, DefaultOptions(), Deps{})
	if err != nil {
		return nil, false, err
	}
	return p, true, nil
}

// Random picks uniformly.
type Random struct{ rnd Rand }

func (*Random) Name() string { return "random" }

func (r *Random) Pick(cands []*workers.Worker, _ Request) int {
	if len(cands) == 1 {
		return 0
	}
	if r.rnd == nil {
		return rand.IntN(len(cands))
	}
	return r.rnd.IntN(len(cands))
}

// setKey identifies a candidate set by its workers' identities in order. The
// registry's worker records live as long as they are registered and Go's heap
// does not move objects, so the address is a stable identity; a freed address
// reused by a new worker only means inheriting a retired set's state.
func setKey(cands []*workers.Worker) uint64 {
	h := uint64(14695981039346656037)
	for _, w := range cands {
		h ^= uint64(uintptr(unsafe.Pointer(w)))
		h *= 1099511628211
		h ^= h >> 29
	}
	return h ^ uint64(len(cands))
}

// minLoadIndex returns the first candidate with the fewest in-flight requests.
func minLoadIndex(cands []*workers.Worker) int {
	best, bl := 0, cands[0].Load()
	for i := 1; i < len(cands); i++ {
		if l := cands[i].Load(); l < bl {
			best, bl = i, l
		}
	}
	return best
}
