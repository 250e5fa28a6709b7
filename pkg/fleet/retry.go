package fleet

import (
	"math"
	"time"
)

// RetryConfig is SMG's retry policy. Each retry is a whole new PD attempt
// (new pair, new bootstrap rooms or transfer ids); this type only decides
// how many attempts and how long to wait between them.
type RetryConfig struct {
	// MaxRetries counts total attempts, the first one included (SMG's naming).
	MaxRetries     int
	InitialBackoff time.Duration
	MaxBackoff     time.Duration
	Multiplier     float64
	// Jitter is the ± fraction applied uniformly to each delay (0.2 = ±20%).
	Jitter float64
	// Disabled mirrors --disable-retries: one attempt.
	Disabled bool
}

// DefaultRetryConfig is SMG's default: 5 attempts, 50 ms × 1.5^n capped at
// 30 s, ±20% jitter.
func DefaultRetryConfig() RetryConfig {
	return RetryConfig{
		MaxRetries:     5,
		InitialBackoff: 50 * time.Millisecond,
		MaxBackoff:     30 * time.Second,
		Multiplier:     1.5,
		Jitter:         0.2,
	}
}

// Attempts is the total number of attempts allowed, never below 1.
func (c RetryConfig) Attempts() int {
	if c.Disabled {
		return 1
	}
	return max(c.MaxRetries, 1)
}

// Backoff is the delay before the retry that follows failed attempt number
// attempt+1, i.e. attempt is zero-based as in SMG: attempt 0 waits about
// InitialBackoff. The delay is min(initial × multiplier^attempt, max), then
// scaled by a uniform factor in [1-Jitter, 1+Jitter] drawn from rnd (which
// must return values in [0, 1), e.g. rand.Float64). A nil rnd applies no
// jitter, which keeps callers that do not care deterministic.
func (c RetryConfig) Backoff(attempt int, rnd func() float64) time.Duration {
	attempt = max(attempt, 0)
	mult := c.Multiplier
	if mult <= 0 {
		mult = 1
	}
	delay := float64(c.InitialBackoff) * math.Pow(mult, float64(attempt))
	if c.MaxBackoff > 0 && delay > float64(c.MaxBackoff) {
		delay = float64(c.MaxBackoff)
	}
	if j := min(max(c.Jitter, 0), 1); j > 0 && rnd != nil {
		delay *= 1 + j*(2*rnd()-1)
	}
	// Guard the float → Duration conversion against overflow and negatives
	// (e.g. an unbounded MaxBackoff with a large attempt number).
	if math.IsNaN(delay) || delay <= 0 {
		return 0
	}
	if delay >= float64(math.MaxInt64) {
		return time.Duration(math.MaxInt64)
	}
	return time.Duration(delay)
}

// RetryableStatus reports whether a final status is in SMG's default retry
// set: 408, 429, 500, 502, 503, 504. A response the gateway itself marked
// non-retryable (the overload shed) must be excluded by the caller.
func RetryableStatus(status int) bool {
	switch status {
	case 408, 429, 500, 502, 503, 504:
		return true
	}
	return false
}
