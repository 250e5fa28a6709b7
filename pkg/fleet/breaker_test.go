package fleet

import (
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// fakeClock is a manually advanced clock for breaker tests.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func newFakeClock() *fakeClock { return &fakeClock{t: time.Unix(1_700_000_000, 0)} }

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

func TestOutcomeForStatus(t *testing.T) {
	tests := []struct {
		name      string
		status    int
		transport bool
		retryable []int
		capacity  []int
		want      Outcome
	}{
		{"200 success", 200, false, nil, nil, OutcomeSuccess},
		{"400 success", 400, false, nil, nil, OutcomeSuccess},
		{"404 success", 404, false, nil, nil, OutcomeSuccess},
		{"422 success", 422, false, nil, nil, OutcomeSuccess},
		{"501 not retryable so success", 501, false, nil, nil, OutcomeSuccess},
		{"408 failure", 408, false, nil, nil, OutcomeFailure},
		{"500 failure", 500, false, nil, nil, OutcomeFailure},
		{"502 failure", 502, false, nil, nil, OutcomeFailure},
		{"503 failure", 503, false, nil, nil, OutcomeFailure},
		{"504 failure", 504, false, nil, nil, OutcomeFailure},
		{"429 capacity ignored", 429, false, nil, nil, OutcomeIgnore},
		{"transport error failure", 0, true, nil, nil, OutcomeFailure},
		{"transport error beats capacity", 429, true, nil, nil, OutcomeFailure},
		{"custom capacity 503 ignored", 503, false, nil, []int{503}, OutcomeIgnore},
		{"custom capacity makes 429 a failure", 429, false, nil, []int{503}, OutcomeFailure},
		{"empty capacity makes 429 a failure", 429, false, nil, []int{}, OutcomeFailure},
		{"custom retryable excludes 500", 500, false, []int{502}, nil, OutcomeSuccess},
		{"custom retryable includes 502", 502, false, []int{502}, nil, OutcomeFailure},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			assert.Equal(t, tt.want, OutcomeForStatus(tt.status, tt.transport, tt.retryable, tt.capacity))
		})
	}
}

func TestDefaultBreakerConfig(t *testing.T) {
	assert.Equal(t, BreakerConfig{FailureThreshold: 10, SuccessThreshold: 3, Timeout: 60 * time.Second, Window: 120 * time.Second},
		DefaultBreakerConfig())
}

// step is one action on a breaker followed by the expected state.
type step struct {
	outcome Outcome
	times   int           // how many times to record outcome (0 = none)
	wait    time.Duration // advance the clock before recording
	want    State
}

func rec(o Outcome, n int, want State) step { return step{outcome: o, times: n, want: want} }
func wait(d time.Duration, want State) step { return step{wait: d, want: want} }

func TestBreakerTransitions(t *testing.T) {
	const (
		S = OutcomeSuccess
		F = OutcomeFailure
		I = OutcomeIgnore
	)
	def := DefaultBreakerConfig()
	// opened drives a default breaker to open.
	opened := []step{rec(F, 10, StateOpen)}
	// halfOpen drives it to half-open.
	halfOpen := append(append([]step{}, opened...), wait(60*time.Second, StateHalfOpen))

	tests := []struct {
		name  string
		cfg   BreakerConfig
		steps []step
		fails int // expected ConsecutiveFailures at the end (-1 = skip)
	}{
		{"opens after threshold consecutive failures", def,
			[]step{rec(F, 9, StateClosed), rec(F, 1, StateOpen)}, 10},
		{"a success resets the streak", def,
			[]step{rec(F, 9, StateClosed), rec(S, 1, StateClosed), rec(F, 9, StateClosed)}, 9},
		{"4xx is a success", def,
			[]step{rec(F, 9, StateClosed), rec(OutcomeForStatus(404, false, nil, nil), 1, StateClosed), rec(F, 1, StateClosed)}, 1},
		{"429 changes neither count", def,
			[]step{rec(F, 5, StateClosed), rec(I, 100, StateClosed), rec(F, 5, StateOpen)}, 10},
		{"429 does not close half-open", def,
			append(append([]step{}, halfOpen...), rec(I, 10, StateHalfOpen)), 0},
		{"open until timeout then half-open", def,
			append(append([]step{}, opened...), wait(59*time.Second, StateOpen), wait(time.Second, StateHalfOpen)), 0},
		{"late outcomes while open change nothing", def,
			append(append([]step{}, opened...), rec(S, 5, StateOpen), rec(F, 5, StateOpen), wait(60*time.Second, StateHalfOpen)), 0},
		{"half-open success threshold closes", def,
			append(append([]step{}, halfOpen...), rec(S, 2, StateHalfOpen), rec(S, 1, StateClosed)), 0},
		{"half-open failure re-opens", def,
			append(append([]step{}, halfOpen...), rec(S, 2, StateHalfOpen), rec(F, 1, StateOpen),
				wait(59*time.Second, StateOpen), wait(time.Second, StateHalfOpen)), 0},
		{"after closing, a fresh streak is needed", def,
			append(append([]step{}, halfOpen...), rec(S, 3, StateClosed), rec(F, 9, StateClosed), rec(F, 1, StateOpen)), 10},
		{"failures older than the window do not count", def,
			[]step{rec(F, 9, StateClosed), wait(121*time.Second, StateClosed), rec(F, 1, StateClosed)}, 1},
		{"failures within the window accumulate across pauses", def,
			[]step{rec(F, 5, StateClosed), wait(70*time.Second, StateClosed), rec(F, 5, StateOpen)}, 10},
		{"the window slides", def,
			[]step{rec(F, 5, StateClosed), wait(70*time.Second, StateClosed), rec(F, 4, StateClosed),
				wait(60*time.Second, StateClosed), rec(F, 1, StateClosed)}, 5},
		{"zero window is unbounded",
			BreakerConfig{FailureThreshold: 10, SuccessThreshold: 3, Timeout: time.Minute},
			[]step{rec(F, 9, StateClosed), wait(time.Hour, StateClosed), rec(F, 1, StateOpen)}, 10},
		{"disabled never opens",
			BreakerConfig{FailureThreshold: 10, SuccessThreshold: 3, Timeout: time.Minute, Window: time.Minute, Disabled: true},
			[]step{rec(F, 1000, StateClosed)}, 1000},
		{"threshold below one is one",
			BreakerConfig{Timeout: time.Second},
			[]step{rec(F, 1, StateOpen), wait(time.Second, StateHalfOpen), rec(S, 1, StateClosed)}, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			clk := newFakeClock()
			b := NewBreaker(tt.cfg, clk.Now, BreakerHooks{})
			require.Equal(t, StateClosed, b.State())
			for i, s := range tt.steps {
				clk.Advance(s.wait)
				for range s.times {
					b.Record(s.outcome)
				}
				require.Equalf(t, s.want, b.State(), "step %d", i)
				require.Equalf(t, s.want != StateOpen, b.Allow(), "step %d", i)
			}
			if tt.fails >= 0 {
				assert.Equal(t, tt.fails, b.ConsecutiveFailures())
			}
		})
	}
}

func TestBreakerHooks(t *testing.T) {
	clk := newFakeClock()
	type tr struct{ from, to State }
	var trs []tr
	var outcomes []Outcome
	b := NewBreaker(BreakerConfig{FailureThreshold: 2, SuccessThreshold: 1, Timeout: time.Second}, clk.Now, BreakerHooks{
		OnTransition: func(from, to State) { trs = append(trs, tr{from, to}) },
		OnOutcome:    func(o Outcome, _, _ int) { outcomes = append(outcomes, o) },
	})
	b.Record(OutcomeFailure)
	b.Record(OutcomeIgnore)
	b.Record(OutcomeFailure)
	assert.False(t, b.Allow())
	clk.Advance(time.Second)
	assert.True(t, b.Allow())
	b.Record(OutcomeSuccess)
	b.Reset() // already closed: no transition

	assert.Equal(t, []tr{
		{StateClosed, StateOpen},
		{StateOpen, StateHalfOpen},
		{StateHalfOpen, StateClosed},
	}, trs)
	assert.Equal(t, []Outcome{OutcomeFailure, OutcomeFailure, OutcomeSuccess}, outcomes)
}

func TestBreakerRecordAppliesElapsedTimeout(t *testing.T) {
	// An outcome arriving after the open timeout, before any Allow, is judged
	// as a half-open trial.
	clk := newFakeClock()
	b := NewBreaker(BreakerConfig{FailureThreshold: 1, SuccessThreshold: 1, Timeout: time.Second}, clk.Now, BreakerHooks{})
	b.Record(OutcomeFailure)
	clk.Advance(time.Second)
	b.Record(OutcomeSuccess)
	assert.Equal(t, StateClosed, b.State())
}

func TestBreakerReset(t *testing.T) {
	clk := newFakeClock()
	b := NewBreaker(DefaultBreakerConfig(), clk.Now, BreakerHooks{})
	for range 10 {
		b.Record(OutcomeFailure)
	}
	require.Equal(t, StateOpen, b.State())
	b.Reset()
	assert.Equal(t, StateClosed, b.State())
	assert.Equal(t, 0, b.ConsecutiveFailures())
	assert.True(t, b.Allow())
}

func TestStateAndOutcomeStrings(t *testing.T) {
	assert.Equal(t, "closed", StateClosed.String())
	assert.Equal(t, "open", StateOpen.String())
	assert.Equal(t, "half_open", StateHalfOpen.String())
	assert.Equal(t, "unknown", State(7).String())
	assert.Equal(t, "success", OutcomeSuccess.String())
	assert.Equal(t, "failure", OutcomeFailure.String())
	assert.Equal(t, "ignore", OutcomeIgnore.String())
}

func TestBreakerConcurrent(t *testing.T) {
	// Exercised under -race: Allow's lock-free path against Record's
	// transitions, with the clock moving.
	clk := newFakeClock()
	var mu sync.Mutex
	transitions := 0
	b := NewBreaker(BreakerConfig{FailureThreshold: 3, SuccessThreshold: 2, Timeout: time.Millisecond}, clk.Now, BreakerHooks{
		OnTransition: func(State, State) { mu.Lock(); transitions++; mu.Unlock() },
	})
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 2000 {
				if b.Allow() {
					if (i+g)%3 == 0 {
						b.Record(OutcomeSuccess)
					} else {
						b.Record(OutcomeFailure)
					}
				}
				if i%50 == 0 {
					clk.Advance(time.Millisecond)
				}
				_ = b.ConsecutiveFailures()
			}
		})
	}
	wg.Wait()
	mu.Lock()
	defer mu.Unlock()
	assert.Positive(t, transitions)
}

func BenchmarkBreakerAllowClosed(b *testing.B) {
	br := NewBreaker(DefaultBreakerConfig(), nil, BreakerHooks{})
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if !br.Allow() {
				b.Fatal("closed breaker rejected")
			}
		}
	})
}
