package policy

import (
	"fmt"
	"testing"

	"github.com/smg-project/smg-extproc/pkg/workers"
)

// BenchmarkPick measures one pick over 8 candidates per policy, with a short
// prompt and a routing key, and engine loads known for every worker.
func BenchmarkPick(b *testing.B) {
	ws := mkws("w0", "w1", "w2", "w3", "w4", "w5", "w6", "w7")
	src := NewEngineLoadMonitor(nil, 0)
	snap := map[*workers.Worker]EngineLoad{}
	for i, w := range ws {
		snap[w] = EngineLoad{QueuedTokens: float64(100 * i), KVUsage: 0.1, Throughput: 1000, Epoch: 1}
	}
	src.snap.Store(&snap)
	req := Request{Text: "You are a helpful assistant. Summarise the following document in three sentences.", RoutingKey: "session-42"}
	for _, name := range Names() {
		b.Run(name, func(b *testing.B) {
			p := build(b, name, DefaultOptions(), Deps{Loads: src})
			p.Pick(ws, req) // warm: first-seen sets, keys, tree paths
			b.ReportAllocs()
			for b.Loop() {
				p.Pick(ws, req)
			}
		})
	}
	b.Run("consistent_hashing/target", func(b *testing.B) {
		p := build(b, "consistent_hashing", DefaultOptions(), Deps{})
		r := Request{TargetWorker: "3"}
		b.ReportAllocs()
		for b.Loop() {
			p.Pick(ws, r)
		}
	})
	b.Run("least_load/dark", func(b *testing.B) {
		p := build(b, "least_load", DefaultOptions(), Deps{})
		b.ReportAllocs()
		for b.Loop() {
			p.Pick(ws, req)
		}
	})
}

// BenchmarkPickParallel runs picks from all Ps at once on one instance.
func BenchmarkPickParallel(b *testing.B) {
	ws := mkws("w0", "w1", "w2", "w3", "w4", "w5", "w6", "w7")
	for _, name := range Names() {
		b.Run(name, func(b *testing.B) {
			p := build(b, name, DefaultOptions(), Deps{})
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				i := 0
				for pb.Next() {
					i++
					p.Pick(ws, Request{Text: "shared system prompt", RoutingKey: fmt.Sprint(i & 63)})
				}
			})
		})
	}
}
