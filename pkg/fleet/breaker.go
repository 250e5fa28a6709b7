package fleet

import (
	"sync"
	"sync/atomic"
	"time"
)

// State is a circuit-breaker state. Its numeric value is what the
// smg_worker_cb_state gauge reports (0 closed, 1 open, 2 half-open).
type State uint32

const (
	StateClosed State = iota
	StateOpen
	StateHalfOpen
)

// String is SMG's label spelling, used by smg_worker_cb_transitions_total.
func (s State) String() string {
	switch s {
	case StateClosed:
		return "closed"
	case StateOpen:
		return "open"
	case StateHalfOpen:
		return "half_open"
	default:
		return "unknown"
	}
}

// Outcome is what one attempt teaches a worker's breaker.
type Outcome uint8

const (
	OutcomeSuccess Outcome = iota
	OutcomeFailure
	// OutcomeIgnore records nothing: capacity pushback (429 by default) is a
	// routing signal, not a fault. Counting it as a failure would turn a load
	// spike into an outage; counting it as a success would close a half-open
	// breaker on a request the worker refused.
	OutcomeIgnore
)

// String is the smg_worker_cb_outcomes_total label value.
func (o Outcome) String() string {
	switch o {
	case OutcomeSuccess:
		return "success"
	case OutcomeFailure:
		return "failure"
	default:
		return "ignore"
	}
}

// DefaultRetryableStatuses is SMG's retryable set (also the breaker's failure
// set before capacity codes are removed). A fresh slice on every call so no
// caller can mutate a shared default.
func DefaultRetryableStatuses() []int { return []int{408, 429, 500, 502, 503, 504} }

// DefaultCapacityStatuses is SMG's capacity-pushback set.
func DefaultCapacityStatuses() []int { return []int{429} }

// OutcomeForStatus classifies an attempt's result for the breaker, as SMG's
// record_outcome does: a transport error is a failure; a capacity code is
// ignored; a retryable code is a failure; anything else, including every
// other 4xx, is a success. A nil retryable or capacity slice means SMG's
// default set; an empty non-nil slice means "none".
//
// Recording rules stay with the caller: on the parallel SGLang path both legs
// record the attempt's final status (the prefill records its drain result
// instead when the stream committed early, a body error counting as 502); on
// the sequential vLLM path each leg records its own status, 502 for its
// transport or read error, and a leg never contacted records nothing.
func OutcomeForStatus(status int, transportErr bool, retryable, capacity []int) Outcome {
	if transportErr {
		return OutcomeFailure
	}
	isCapacity := status == 429
	if capacity != nil {
		isCapacity = containsInt(capacity, status)
	}
	if isCapacity {
		return OutcomeIgnore
	}
	isRetryable := RetryableStatus(status)
	if retryable != nil {
		isRetryable = containsInt(retryable, status)
	}
	if isRetryable {
		return OutcomeFailure
	}
	return OutcomeSuccess
}

func containsInt(set []int, v int) bool {
	for _, x := range set {
		if x == v {
			return true
		}
	}
	return false
}

// BreakerConfig is one worker's breaker configuration.
type BreakerConfig struct {
	// FailureThreshold consecutive failures open a closed breaker.
	FailureThreshold int
	// SuccessThreshold successes in half-open close it.
	SuccessThreshold int
	// Timeout is how long an open breaker rejects before going half-open.
	Timeout time.Duration
	// Window bounds the consecutive-failure streak in time: a failure older
	// than Window (relative to the newest one) no longer counts toward
	// FailureThreshold. Zero means unbounded. SMG carries this setting but its
	// breaker never reads it; we apply it so a trickle of failures spread over
	// hours cannot trip the breaker the way a burst does.
	Window time.Duration
	// Disabled mirrors --disable-circuit-breaker (SMG sets the threshold to
	// u32::MAX): outcomes are still counted but the breaker never opens.
	Disabled bool
}

// DefaultBreakerConfig is SMG's CLI default (10 failures, 3 successes, 60 s
// open, 120 s window). SMG's struct default, 5/2/30 s/60 s, applies only to
// breakers built without the CLI.
func DefaultBreakerConfig() BreakerConfig {
	return BreakerConfig{FailureThreshold: 10, SuccessThreshold: 3, Timeout: 60 * time.Second, Window: 120 * time.Second}
}

func (c BreakerConfig) normalized() BreakerConfig {
	// A threshold below 1 would open (or close) without evidence.
	c.FailureThreshold = max(c.FailureThreshold, 1)
	c.SuccessThreshold = max(c.SuccessThreshold, 1)
	c.Timeout = max(c.Timeout, 0)
	c.Window = max(c.Window, 0)
	return c
}

// BreakerHooks observe a breaker, typically for metrics (see
// Metrics.BreakerHooks). Both run while the breaker holds its lock, so events
// arrive in order and a gauge can never end up behind the state; they must
// be quick and must not call back into the Breaker.
type BreakerHooks struct {
	OnTransition func(from, to State)
	// OnOutcome runs for every recorded success or failure (never for
	// OutcomeIgnore) with the counters after it was applied.
	OnOutcome func(o Outcome, consecutiveFailures, consecutiveSuccesses int)
}

// Breaker is one worker's circuit breaker. Allow is called per request per
// candidate worker, so the closed and half-open states answer with a single
// atomic load and an unexpired open state with one clock read; only state
// changes and Record take the mutex.
type Breaker struct {
	cfg   BreakerConfig
	now   func() time.Time
	hooks BreakerHooks

	state     atomic.Uint32 // a State; written only under mu
	openUntil atomic.Int64  // UnixNano on now's clock; stored before state flips to open

	mu        sync.Mutex
	streak    []time.Time // closed state: times of the current streak's failures within Window
	failures  int         // consecutive failures (len(streak) when a window applies)
	successes int         // consecutive successes
}

// NewBreaker returns a closed breaker. A nil now means time.Now.
func NewBreaker(cfg BreakerConfig, now func() time.Time, hooks BreakerHooks) *Breaker {
	if now == nil {
		now = time.Now
	}
	return &Breaker{cfg: cfg.normalized(), now: now, hooks: hooks}
}

// Config is the normalized configuration in force.
func (b *Breaker) Config() BreakerConfig { return b.cfg }

// Allow reports whether a request may be sent to the worker now. An open
// breaker rejects until Timeout has passed and then turns half-open. Like
// SMG, half-open admits every request: the first SuccessThreshold outcomes
// decide, and any failure re-opens.
func (b *Breaker) Allow() bool { return b.State() != StateOpen }

// State is the current state, applying the open → half-open timeout.
func (b *Breaker) State() State {
	s := State(b.state.Load())
	if s != StateOpen || b.now().UnixNano() < b.openUntil.Load() {
		return s
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.expireOpenLocked(b.now())
	return State(b.state.Load())
}

// Record applies one attempt's outcome.
func (b *Breaker) Record(o Outcome) {
	if o != OutcomeSuccess && o != OutcomeFailure {
		return
	}
	now := b.now()
	b.mu.Lock()
	defer b.mu.Unlock()
	// Apply an elapsed open timeout first so the outcome is judged against the
	// state Allow would report at this instant.
	b.expireOpenLocked(now)
	switch State(b.state.Load()) {
	case StateClosed:
		if o == OutcomeSuccess {
			b.clearFailuresLocked()
			b.successes++
			break
		}
		b.successes = 0
		if b.noteFailureLocked(now) >= b.cfg.FailureThreshold && !b.cfg.Disabled {
			b.transitionLocked(StateOpen, now)
		}
	case StateHalfOpen:
		if o == OutcomeSuccess {
			b.failures = 0
			b.successes++
			if b.successes >= b.cfg.SuccessThreshold {
				b.transitionLocked(StateClosed, now)
			}
			break
		}
		b.successes = 0
		b.failures++
		b.transitionLocked(StateOpen, now)
	case StateOpen:
		// A late answer to a request admitted before the breaker opened: the
		// timeout alone decides when to probe again.
	}
	if b.hooks.OnOutcome != nil {
		b.hooks.OnOutcome(o, b.failures, b.successes)
	}
}

// Reset forces the breaker closed with clean counters (admin use).
func (b *Breaker) Reset() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.transitionLocked(StateClosed, b.now())
	b.clearFailuresLocked()
	b.successes = 0
}

// ConsecutiveFailures is the failure streak as of the last recorded outcome.
func (b *Breaker) ConsecutiveFailures() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.failures
}

// ConsecutiveSuccesses is the success streak as of the last recorded outcome.
func (b *Breaker) ConsecutiveSuccesses() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.successes
}

func (b *Breaker) expireOpenLocked(now time.Time) {
	if State(b.state.Load()) == StateOpen && now.UnixNano() >= b.openUntil.Load() {
		b.transitionLocked(StateHalfOpen, now)
	}
}

// noteFailureLocked extends the closed-state streak and returns its length,
// counting only failures no older than Window before the newest.
func (b *Breaker) noteFailureLocked(now time.Time) int {
	if b.cfg.Window <= 0 || b.cfg.Disabled {
		// No window, or a breaker that never opens: a counter suffices and
		// the timestamp list cannot grow without bound.
		b.failures++
		return b.failures
	}
	b.streak = append(b.streak, now)
	drop := 0
	for drop < len(b.streak) && now.Sub(b.streak[drop]) > b.cfg.Window {
		drop++
	}
	// Only the newest FailureThreshold timestamps can ever matter.
	drop = max(drop, len(b.streak)-b.cfg.FailureThreshold)
	b.streak = b.streak[drop:]
	b.failures = len(b.streak)
	return b.failures
}

func (b *Breaker) clearFailuresLocked() {
	b.failures = 0
	b.streak = b.streak[:0]
}

func (b *Breaker) transitionLocked(to State, now time.Time) {
	from := State(b.state.Load())
	if from == to {
		return
	}
	switch to {
	case StateOpen:
		// Keep the failure count visible while open; successes restart.
		b.openUntil.Store(now.Add(b.cfg.Timeout).UnixNano())
		b.streak = b.streak[:0]
		b.successes = 0
	case StateHalfOpen, StateClosed:
		b.clearFailuresLocked()
		b.successes = 0
	}
	b.state.Store(uint32(to))
	if b.hooks.OnTransition != nil {
		b.hooks.OnTransition(from, to)
	}
}
