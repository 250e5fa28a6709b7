package fleet

import (
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

func TestRetryAttempts(t *testing.T) {
	tests := []struct {
		name string
		cfg  RetryConfig
		want int
	}{
		{"default is five total attempts", DefaultRetryConfig(), 5},
		{"disabled is one", RetryConfig{MaxRetries: 5, Disabled: true}, 1},
		{"zero is one", RetryConfig{}, 1},
		{"three", RetryConfig{MaxRetries: 3}, 3},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			assert.Equal(t, tt.want, tt.cfg.Attempts())
		})
	}
}

func TestRetryBackoffWithoutJitter(t *testing.T) {
	cfg := DefaultRetryConfig()
	tests := []struct {
		attempt int
		want    time.Duration
	}{
		{-1, 50 * time.Millisecond},
		{0, 50 * time.Millisecond},
		{1, 75 * time.Millisecond},
		{2, 112500 * time.Microsecond},
		{3, 168750 * time.Microsecond},
		{30, 30 * time.Second}, // 50 ms × 1.5^30 ≈ 9.6e6 s, capped
		{10_000, 30 * time.Second},
	}
	for _, tt := range tests {
		assert.Equalf(t, tt.want, cfg.Backoff(tt.attempt, nil), "attempt %d", tt.attempt)
	}
}

func TestRetryBackoffJitterBounds(t *testing.T) {
	cfg := DefaultRetryConfig()
	tests := []struct {
		name    string
		attempt int
		rnd     func() float64
		want    time.Duration
	}{
		{"draw 0 is -20%", 0, func() float64 { return 0 }, 40 * time.Millisecond},
		{"draw 0.5 is exact", 0, func() float64 { return 0.5 }, 50 * time.Millisecond},
		{"draw 0.75 is +10%", 0, func() float64 { return 0.75 }, 55 * time.Millisecond},
		{"jitter applies after the cap", 100, func() float64 { return 0 }, 24 * time.Second},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			assert.InDelta(t, float64(tt.want), float64(cfg.Backoff(tt.attempt, tt.rnd)), float64(time.Microsecond))
		})
	}

	// Random draws stay within ±20% of the nominal delay and use the range.
	r := rand.New(rand.NewPCG(1, 2))
	for attempt := range 5 {
		nominal := float64(cfg.Backoff(attempt, nil))
		lo, hi := math.Inf(1), math.Inf(-1)
		for range 2000 {
			d := float64(cfg.Backoff(attempt, r.Float64))
			assert.GreaterOrEqual(t, d, 0.8*nominal-1)
			assert.LessOrEqual(t, d, 1.2*nominal+1)
			lo, hi = math.Min(lo, d), math.Max(hi, d)
		}
		assert.Less(t, lo, 0.85*nominal, "attempt %d: jitter never went low", attempt)
		assert.Greater(t, hi, 1.15*nominal, "attempt %d: jitter never went high", attempt)
	}
}

func TestRetryBackoffEdgeCases(t *testing.T) {
	// An unbounded MaxBackoff must saturate rather than overflow.
	unbounded := RetryConfig{InitialBackoff: time.Second, Multiplier: 10}
	assert.Equal(t, time.Duration(math.MaxInt64), unbounded.Backoff(100, nil))
	// A non-positive multiplier means a constant delay.
	constant := RetryConfig{InitialBackoff: time.Second, MaxBackoff: time.Minute}
	assert.Equal(t, time.Second, constant.Backoff(5, nil))
	// Jitter above 1 is clamped, so the delay never goes negative.
	wild := RetryConfig{InitialBackoff: time.Second, MaxBackoff: time.Minute, Multiplier: 1, Jitter: 5}
	assert.Equal(t, time.Duration(0), wild.Backoff(0, func() float64 { return 0 }))
}

func TestRetryableStatus(t *testing.T) {
	for status := 100; status < 600; status++ {
		want := status == 408 || status == 429 || status == 500 || status == 502 || status == 503 || status == 504
		assert.Equalf(t, want, RetryableStatus(status), "status %d", status)
	}
	assert.ElementsMatch(t, []int{408, 429, 500, 502, 503, 504}, DefaultRetryableStatuses())
	assert.Equal(t, []int{429}, DefaultCapacityStatuses())
}
