package policy

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestBuild(t *testing.T) {
	for _, name := range Names() {
		for _, leg := range []Leg{LegPrefill, LegDecode} {
			t.Run(name+"/"+leg.String(), func(t *testing.T) {
				p, err := Build(name, leg, DefaultOptions(), Deps{})
				if name == "bucket" && leg == LegDecode {
					require.Error(t, err)
					assert.Contains(t, err.Error(), "decode")
					return
				}
				require.NoError(t, err)
				assert.Equal(t, name, p.Name())
				ws := mkws("a", "b", "c")
				i := p.Pick(ws, Request{Text: "hello"})
				assert.True(t, i >= 0 && i < len(ws), "index %d", i)
			})
		}
	}
}

func TestBuildErrors(t *testing.T) {
	bad := func(f func(*Options)) Options { o := DefaultOptions(); f(&o); return o }
	tests := []struct {
		name string
		pol  string
		opts Options
	}{
		{"unknown policy", "fastest", DefaultOptions()},
		{"cache threshold", "cache_aware", bad(func(o *Options) { o.CacheThreshold = 1.5 })},
		{"assignment mode", "manual", bad(func(o *Options) { o.AssignmentMode = "delegate_x" })},
		{"negative interval", "manual", bad(func(o *Options) { o.EvictionInterval = -time.Second })},
		{"negative cap", "least_load", bad(func(o *Options) { o.LeastLoadMaxWaitingReqs = -1 })},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Build(tt.pol, LegPrefill, tt.opts, Deps{})
			require.Error(t, err)
		})
	}
}

func TestDefaultOptions(t *testing.T) {
	o := DefaultOptions()
	require.NoError(t, o.Validate())
	assert.Equal(t, 0.3, o.CacheThreshold)
	assert.Equal(t, int64(64), o.BalanceAbsThreshold)
	assert.Equal(t, 1.5, o.BalanceRelThreshold)
	assert.Equal(t, 120*time.Second, o.EvictionInterval)
	assert.Equal(t, 67108864, o.MaxTreeSize)
	assert.Equal(t, 16, o.BlockSize)
	assert.Equal(t, 256, o.PrefixTokenCount)
	assert.Equal(t, 1.25, o.LoadFactor)
	assert.Equal(t, 0.15, o.LeastLoadKVPressureWeight)
	assert.Equal(t, 2000.0, o.LeastLoadDefaultThroughput)
	assert.Equal(t, 1024, o.LeastLoadMeanPrefillTokens)
	assert.Equal(t, 0, o.LeastLoadMaxWaitingReqs)
	assert.Equal(t, AssignRandom, o.AssignmentMode)
	assert.Equal(t, 4*time.Hour, o.MaxIdle)
	assert.Equal(t, 5*time.Second, o.BucketAdjustInterval)
	assert.Equal(t, 10*time.Second, o.LoadMonitorInterval)
}

func TestNewCompat(t *testing.T) {
	for _, name := range Names() {
		p, impl, err := New(name)
		require.NoError(t, err)
		assert.True(t, impl)
		assert.Equal(t, name, p.Name())
	}
	_, impl, err := New("nope")
	require.Error(t, err)
	assert.False(t, impl)
}

func TestNeedsEngineLoads(t *testing.T) {
	for _, name := range Names() {
		assert.Equal(t, name == "power_of_two" || name == "least_load", NeedsEngineLoads(name), name)
	}
}

func TestRandom(t *testing.T) {
	ws := mkws("a", "b", "c")
	p := build(t, "random", DefaultOptions(), Deps{Rand: &seqRand{vals: []int{2, 0, 1}}})
	assert.Equal(t, []int{2, 0, 1}, []int{p.Pick(ws, Request{}), p.Pick(ws, Request{}), p.Pick(ws, Request{})})
	assert.Equal(t, 0, p.Pick(ws[:1], Request{}))
}

func TestRoutingKeyCap(t *testing.T) {
	long := make([]byte, MaxRoutingKeyBytes+1)
	for i := range long {
		long[i] = 'k'
	}
	r := Request{RoutingKey: string(long)}
	assert.Equal(t, "", r.routingKey())
	r.RoutingKey = string(long[:MaxRoutingKeyBytes])
	assert.Equal(t, string(long[:MaxRoutingKeyBytes]), r.routingKey())
}

// Runners stop with their context and a second Start is a no-op.
func TestRunnersStop(t *testing.T) {
	o := DefaultOptions()
	o.EvictionInterval = time.Millisecond
	o.BucketAdjustInterval = time.Millisecond
	for _, name := range []string{"cache_aware", "manual", "bucket"} {
		t.Run(name, func(t *testing.T) {
			p := build(t, name, o, Deps{})
			r, ok := p.(Runner)
			require.True(t, ok)
			ctx, cancel := context.WithCancel(context.Background())
			r.Start(ctx)
			r.Start(ctx)
			ws := mkws("a", "b")
			for i := 0; i < 50; i++ {
				p.Pick(ws, Request{Text: "abc", RoutingKey: "k"})
			}
			time.Sleep(5 * time.Millisecond)
			cancel()
		})
	}
}
