// Package fleet holds SMG's per-worker resilience machinery: the circuit
// breaker, the retry policy, the background health prober, runtime detection
// at registration, and the Prometheus series that describe them.
//
// The package knows nothing about the worker registry (it must not import
// pkg/workers, which embeds these pieces): a worker is identified by plain
// values (a URL or id string, a Target). Every clock, ticker, HTTP client and
// metrics registerer is injected, so there is no package-level mutable state
// and the tests run on fake time.
package fleet
