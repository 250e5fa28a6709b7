package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/smg-project/smg-extproc/pkg/fake/common"
	"github.com/smg-project/smg-extproc/pkg/fake/sglang"
)

// fastFake shortens the engines' rendezvous timeouts so a gateway bug fails in
// seconds, not SGLang's 300 s.
func fastFake(mode sglang.Mode) sglang.Config {
	return sglang.Config{
		Mode: mode, BootstrapTimeout: 8 * time.Second, WaitingTimeout: 8 * time.Second,
		FetchRetryInterval: 50 * time.Millisecond, FetchAttempts: 20,
		HeartbeatInterval: 500 * time.Millisecond,
	}
}

func startFake(t testing.TB, cfg sglang.Config) *sglang.Server {
	t.Helper()
	s := sglang.New(cfg)
	ctx, cancel := context.WithCancel(context.Background())
	require.NoError(t, s.Start(ctx))
	t.Cleanup(func() { cancel(); _ = s.Close() })
	return s
}

// stack is one fake prefill, one fake decode and a gateway in front of them.
type stack struct {
	P, D *sglang.Server
	GW   *Gateway
}

func newStack(t testing.TB, extra ...string) *stack {
	t.Helper()
	p := startFake(t, fastFake(sglang.Prefill))
	d := startFake(t, fastFake(sglang.Decode))
	gw := startGateway(t, gwOpts{
		Prefills: []prefillSpec{{URL: p.URL(), Port: strconv.Itoa(p.BootstrapPort())}},
		Decodes:  []string{d.URL()},
		Extra:    append([]string{"--policy", "round_robin"}, extra...),
	})
	return &stack{P: p, D: d, GW: gw}
}

func (s *stack) reset() {
	s.P.Reset()
	s.D.Reset()
}

// legBody decodes one recorded request's JSON body.
func legBody(t testing.TB, r common.RecordedRequest) map[string]any {
	t.Helper()
	var m map[string]any
	dec := json.NewDecoder(bytesReader(r.Body))
	dec.UseNumber()
	require.NoError(t, dec.Decode(&m), "leg body: %s", r.Body)
	return m
}

// onlyRequest returns the single engine request a fake received.
func onlyRequest(t testing.TB, name string, reqs []common.RecordedRequest) common.RecordedRequest {
	t.Helper()
	require.Len(t, reqs, 1, "%s should receive exactly one request, got %d", name, len(reqs))
	return reqs[0]
}

func eventsWith(evs []common.Event, outcome string) []common.Event {
	var out []common.Event
	for _, e := range evs {
		if e.Outcome == outcome {
			out = append(out, e)
		}
	}
	return out
}

// waitFor polls cond for up to d.
func waitFor(t testing.TB, d time.Duration, cond func() bool, msg string, args ...any) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting: "+msg, args...)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func errorBody(t testing.TB, r Response) (code, msg, typ string) {
	t.Helper()
	var b struct {
		Error struct {
			Type    string  `json:"type"`
			Code    string  `json:"code"`
			Message string  `json:"message"`
			Param   *string `json:"param"`
		} `json:"error"`
	}
	require.NoError(t, json.Unmarshal(r.Body, &b), "error body is not JSON: %s", r.Body)
	require.Equal(t, "application/json", r.Header.Get("Content-Type"), "error content type")
	require.Equal(t, b.Error.Code, r.Header.Get("X-SMG-Error-Code"), "X-SMG-Error-Code must equal error.code")
	require.Nil(t, b.Error.Param)
	var raw map[string]map[string]any
	require.NoError(t, json.Unmarshal(r.Body, &raw))
	require.Len(t, raw["error"], 4, "SMG error bodies have exactly four keys: %s", r.Body)
	return b.Error.Code, b.Error.Message, b.Error.Type
}

func fmtRoom(v any) string { return fmt.Sprint(v) }
