package manager

import (
	"context"
	"net/http"
	"time"

	"github.com/rs/zerolog"

	"github.com/smg-project/smg-extproc/pkg/fleet"
	"github.com/smg-project/smg-extproc/pkg/workers"
)

// FleetConfig is the per-worker machinery's settings.
type FleetConfig struct {
	Health  fleet.HealthConfig
	Breaker fleet.BreakerConfig
	// PendingInterval is the probe cadence until a new worker is first ready,
	// so registration does not wait a full health interval.
	PendingInterval time.Duration
}

// FleetHooks wires health checks, circuit breakers and runtime detection to
// every worker the manager adds.
func FleetHooks(ctx context.Context, cfg FleetConfig, client *http.Client, m *fleet.Metrics,
	reg *workers.Registry, log zerolog.Logger) Hooks {
	prober := fleet.NewProber(client)
	return Hooks{
		Detect: func(ctx context.Context, baseURL, apiKey string) (string, error) {
			return fleet.DetectRuntime(ctx, client, baseURL, apiKey)
		},
		Attach: func(w *workers.Worker) func() {
			hooks := m.BreakerHooks(w.URL)
			onT := hooks.OnTransition
			hooks.OnTransition = func(from, to fleet.State) {
				if onT != nil {
					onT(from, to)
				}
				log.Warn().Str("url", w.URL).Str("from", from.String()).Str("to", to.String()).Msg("circuit breaker changed")
			}
			b := fleet.NewBreaker(cfg.Breaker, time.Now, hooks)
			w.Allow = b.Allow
			w.Outcome = func(status int, transportErr bool) {
				b.Record(fleet.OutcomeForStatus(status, transportErr, nil, nil))
			}
			if cfg.Health.Disabled {
				w.SetStatus(workers.StatusReady)
				m.SetHealth(w.URL, true)
				reg.Changed()
				return func() { m.DeleteWorker(w.URL) }
			}
			wctx, cancel := context.WithCancel(ctx)
			go healthLoop(wctx, prober, cfg, w, m, reg, log)
			return func() { cancel(); m.DeleteWorker(w.URL) }
		},
	}
}

func healthLoop(ctx context.Context, p *fleet.Prober, cfg FleetConfig, w *workers.Worker, m *fleet.Metrics,
	reg *workers.Registry, log zerolog.Logger) {
	tr := fleet.NewHealthTracker(cfg.Health)
	target := fleet.Target{ID: w.ID, BaseURL: w.BaseURL, APIKey: w.APIKey}
	for {
		err := p.Probe(ctx, target, cfg.Health)
		if ctx.Err() != nil {
			return
		}
		from, to, changed := tr.Observe(err == nil)
		if changed {
			w.SetStatus(workers.Status(to))
			m.SetHealth(w.URL, to == fleet.HealthReady)
			ev := log.Info()
			if to != fleet.HealthReady {
				ev = log.Warn().AnErr("probe_error", err)
			}
			ev.Str("url", w.URL).Str("from", string(from)).Str("to", string(to)).Msg("worker health changed")
			reg.Changed()
		}
		wait := cfg.Health.Interval
		if tr.Status() == fleet.HealthPending && cfg.PendingInterval > 0 && cfg.PendingInterval < wait {
			wait = cfg.PendingInterval
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
	}
}

// WaitReady waits until every given worker is ready or ctx ends.
func WaitReady(ctx context.Context, ws []*workers.Worker) {
	for {
		all := true
		for _, w := range ws {
			if !w.Healthy() {
				all = false
				break
			}
		}
		if all {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(20 * time.Millisecond):
		}
	}
}
