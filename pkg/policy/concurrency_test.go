package policy

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"

	"github.com/smg-project/smg-extproc/pkg/workers"
)

// Every policy under concurrent picks over changing candidate sets, with its
// housekeeping running, engine loads being republished and worker loads
// moving. Run with -race.
func TestConcurrentPicks(t *testing.T) {
	o := DefaultOptions()
	o.EvictionInterval = time.Millisecond
	o.BucketAdjustInterval = time.Millisecond
	o.MaxIdle = 5 * time.Millisecond
	o.MaxTreeSize = 2000
	o.LeastLoadMaxWaitingReqs = 1000
	all := mkws("w0", "w1", "w2", "w3", "w4", "w5")
	src := &staticLoads{}
	for _, name := range Names() {
		t.Run(name, func(t *testing.T) {
			p := build(t, name, o, Deps{Loads: src})
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			if r, ok := p.(Runner); ok {
				r.Start(ctx)
			}
			var wg sync.WaitGroup
			for g := 0; g < 8; g++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					buf := make([]*workers.Worker, 0, len(all))
					for i := 0; i < 400; i++ {
						// A pooled buffer, rewritten between picks as the
						// selector's scratch is.
						buf = append(buf[:0], all[(g+i)%3:]...)
						req := Request{
							Text:       fmt.Sprintf("prompt %d of goroutine %d with a shared prefix", i%17, g),
							RoutingKey: fmt.Sprint(i % 11),
						}
						if i%50 == 0 {
							src.set(all[i%len(all)], EngineLoad{WaitingRequests: int64(i), Epoch: uint64(i)})
						}
						if i%7 == 0 {
							release := buf[0].Acquire()
							defer release()
						}
						got := p.Pick(buf, req)
						assert.True(t, got >= 0 && got < len(buf), "pick %d of %d", got, len(buf))
						clear(buf)
					}
				}()
			}
			wg.Wait()
		})
	}
}
