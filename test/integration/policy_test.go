package integration

import (
	"encoding/json"
	"fmt"
	"io"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/smg-project/smg-extproc/pkg/fake/sglang"
)

// Per-leg policies through the real binary, a real Envoy and strict SGLang
// fakes (spec "Per-Phase Policies", smg-behavior §5, checklist 64–68). Which
// worker served a leg is read from the fakes' recorded requests; the decode
// is cross-checked against x-smg-routed-worker-id and its bootstrap_port
// against the prefill's, so a pair the fakes did not really form fails.

// polFleet is n prefill and m decode fakes.
type polFleet struct {
	P, D []*sglang.Server
}

func newPolFleet(t *testing.T, n, m int) *polFleet {
	t.Helper()
	f := &polFleet{}
	for i := 0; i < n; i++ {
		f.P = append(f.P, startFake(t, fastFake(sglang.Prefill)))
	}
	for i := 0; i < m; i++ {
		f.D = append(f.D, startFake(t, fastFake(sglang.Decode)))
	}
	return f
}

func (f *polFleet) prefills() []prefillSpec {
	out := make([]prefillSpec, len(f.P))
	for i, p := range f.P {
		out[i] = prefillSpec{URL: p.URL(), Port: strconv.Itoa(p.BootstrapPort())}
	}
	return out
}

func (f *polFleet) decodes() []string {
	out := make([]string, len(f.D))
	for i, d := range f.D {
		out[i] = d.URL()
	}
	return out
}

func (f *polFleet) counts() (p, d []int) {
	for _, s := range f.P {
		p = append(p, len(s.Requests()))
	}
	for _, s := range f.D {
		d = append(d, len(s.Requests()))
	}
	return p, d
}

func (f *polFleet) reset() {
	for _, s := range append(append([]*sglang.Server{}, f.P...), f.D...) {
		s.Reset()
	}
}

// grew returns the one index whose count went up by exactly one, the others
// unchanged.
func polGrew(t *testing.T, leg string, before, after []int) int {
	t.Helper()
	idx := -1
	for i := range before {
		switch after[i] - before[i] {
		case 0:
		case 1:
			require.Equal(t, -1, idx, "%s: more than one %s worker contacted (%v -> %v)", leg, leg, before, after)
			idx = i
		default:
			t.Fatalf("%s worker %d got %d requests for one client request", leg, i, after[i]-before[i])
		}
	}
	require.NotEqual(t, -1, idx, "no %s worker contacted (%v -> %v)", leg, before, after)
	return idx
}

// send posts one completion and returns the prefill and decode indices that
// served it.
func (f *polFleet) send(t *testing.T, gw *Gateway, prompt string, hdr map[string]string) (pi, di int) {
	t.Helper()
	bp, bd := f.counts()
	body, err := json.Marshal(map[string]any{"prompt": prompt, "max_tokens": 2})
	require.NoError(t, err)
	r := post(t, gw.URL+"/v1/completions", string(body), hdr)
	require.Equal(t, 200, r.Status, "completion (headers %v): %s", hdr, r.Body)
	ap, ad := f.counts()
	pi, di = polGrew(t, "prefill", bp, ap), polGrew(t, "decode", bd, ad)
	require.Equal(t, f.D[di].URL(), r.Header.Get("x-smg-routed-worker-id"), "x-smg-routed-worker-id names the decode that served the request")
	reqs := f.D[di].Requests()
	got := legBody(t, reqs[len(reqs)-1])["bootstrap_port"]
	require.Equal(t, json.Number(strconv.Itoa(f.P[pi].BootstrapPort())), got, "decode leg must carry its prefill's bootstrap_port")
	return pi, di
}

// TestPolicyRoundRobinPerLeg: 2 prefills × 3 decodes, round_robin on both
// legs. Each leg rotates on its own: prefills strictly alternate, decodes
// strictly cycle with period 3, and over 12 requests every one of the 6
// (prefill, decode) combinations occurs exactly twice. One counter shared by
// the legs (or a decode rotation driven by the prefill's picks) would pin the
// combinations and fail the last check.
func TestPolicyRoundRobinPerLeg(t *testing.T) {
	f := newPolFleet(t, 2, 3)
	gw := startGateway(t, gwOpts{Prefills: f.prefills(), Decodes: f.decodes(), Extra: []string{"--policy", "round_robin"}})

	const n = 12
	var ps, ds []int
	pairs := map[[2]int]int{}
	for i := 0; i < n; i++ {
		pi, di := f.send(t, gw, fmt.Sprintf("round robin %d", i), nil)
		ps, ds = append(ps, pi), append(ds, di)
		pairs[[2]int{pi, di}]++
	}
	for i := 1; i < n; i++ {
		assert.NotEqual(t, ps[i-1], ps[i], "prefill leg must alternate: %v", ps)
		if i >= 3 {
			assert.Equal(t, ds[i-3], ds[i], "decode leg must cycle with period 3: %v", ds)
		}
	}
	assert.ElementsMatch(t, []int{0, 1, 2}, ds[:3], "the first three decodes are all distinct: %v", ds)
	pc, dc := make([]int, 2), make([]int, 3)
	for i := range ps {
		pc[ps[i]]++
		dc[ds[i]]++
	}
	assert.Equal(t, []int{6, 6}, pc, "prefill counts")
	assert.Equal(t, []int{4, 4, 4}, dc, "decode counts")
	assert.Len(t, pairs, 6, "independent rotations meet every (prefill, decode) combination: %v", pairs)
	for p, c := range pairs {
		assert.Equal(t, 2, c, "pair %v", p)
	}
}

// TestPolicyManualStickyUntilUnhealthy: manual on both legs sticks each
// x-smg-routing-key to one prefill and one decode; when the key's decode
// fails its health checks the key moves to the other decode (its prefill
// stays), and once the original recovers the key returns to it, because SMG
// remembers the first worker ahead of the failover one.
func TestPolicyManualStickyUntilUnhealthy(t *testing.T) {
	f := newPolFleet(t, 2, 2)
	gw := startGateway(t, gwOpts{Prefills: f.prefills(), Decodes: f.decodes(), Extra: []string{
		"--policy", "manual",
		"--health-check-interval-secs", "1", "--health-failure-threshold", "1", "--health-success-threshold", "1",
	}})

	keys := []string{"alice", "bob", "carol", "dave", "erin"}
	pinP, pinD := map[string]int{}, map[string]int{}
	for round := 0; round < 4; round++ {
		for _, k := range keys {
			pi, di := f.send(t, gw, "manual "+k+" "+strconv.Itoa(round), map[string]string{"x-smg-routing-key": k})
			if round == 0 {
				pinP[k], pinD[k] = pi, di
				continue
			}
			require.Equal(t, pinP[k], pi, "key %q must stick to its prefill", k)
			require.Equal(t, pinD[k], di, "key %q must stick to its decode", k)
		}
	}

	victim := pinD["alice"]
	other := 1 - victim
	f.D[victim].UpdateConfig(func(c *sglang.Config) { c.StartupWindow = time.Hour }) // /health answers 503
	waitFor(t, 15*time.Second, func() bool { return workerStatus(t, gw, f.D[victim].URL()) == "not_ready" }, "decode %d never marked not_ready", victim)

	f.reset()
	for round := 0; round < 3; round++ {
		for _, k := range keys {
			pi, di := f.send(t, gw, "moved "+k, map[string]string{"x-smg-routing-key": k})
			assert.Equal(t, other, di, "key %q must be served by the healthy decode", k)
			assert.Equal(t, pinP[k], pi, "key %q keeps its prefill: the legs stick independently", k)
		}
	}
	assert.Empty(t, f.D[victim].Requests(), "an unhealthy decode must not be contacted")

	f.D[victim].UpdateConfig(func(c *sglang.Config) { c.StartupWindow = 0 })
	waitFor(t, 15*time.Second, func() bool { return workerStatus(t, gw, f.D[victim].URL()) == "ready" }, "decode %d never recovered", victim)
	for _, k := range keys {
		pi, di := f.send(t, gw, "back "+k, map[string]string{"x-smg-routing-key": k})
		assert.Equal(t, pinD[k], di, "key %q returns to its original decode once it is healthy again", k)
		assert.Equal(t, pinP[k], pi, "key %q prefill", k)
	}
}

// TestPolicyConsistentHashing: consistent_hashing on the decode leg
// (round_robin on the prefill leg, so x-smg-target-worker only steers the
// decode). A routing key keeps its decode; adding a decode moves a key only
// onto the new worker; x-smg-target-worker picks a candidate by index among
// the available decodes in registry order, and an index with no available
// candidate is a 503 no_available_workers that contacts no engine.
func TestPolicyConsistentHashing(t *testing.T) {
	f := newPolFleet(t, 2, 2)
	extra := startFake(t, fastFake(sglang.Decode))
	gw := startGateway(t, gwOpts{Prefills: f.prefills(), Decodes: f.decodes(), Extra: []string{
		"--prefill-policy", "round_robin", "--decode-policy", "consistent_hashing",
		"--health-check-interval-secs", "1", "--health-failure-threshold", "1", "--health-success-threshold", "1",
	}})

	const nKeys = 24
	key := func(i int) map[string]string {
		return map[string]string{"x-smg-routing-key": fmt.Sprintf("session-%d", i)}
	}
	before := make([]int, nKeys)
	used := map[int]bool{}
	for i := 0; i < nKeys; i++ {
		_, before[i] = f.send(t, gw, "hash a", key(i))
		_, again := f.send(t, gw, "hash b", key(i))
		require.Equal(t, before[i], again, "key %d must land on the same decode", i)
		used[before[i]] = true
	}
	assert.Len(t, used, 2, "%d keys spread over both decodes (a constant choice is not hashing): %v", nKeys, before)

	// An unrelated decode joins: keys stay, or move to the newcomer only.
	addWorker(t, gw, fmt.Sprintf(`{"url":%q,"worker_type":"decode"}`, extra.URL()), nil)
	f.D = append(f.D, extra)
	stayed := 0
	for i := 0; i < nKeys; i++ {
		_, after := f.send(t, gw, "hash c", key(i))
		if after == before[i] {
			stayed++
		} else {
			assert.Equal(t, 2, after, "key %d moved from decode %d to an old decode %d", i, before[i], after)
		}
		_, again := f.send(t, gw, "hash d", key(i))
		assert.Equal(t, after, again, "key %d must be stable after the join", i)
	}
	assert.Positive(t, stayed, "adding a decode must not move every key")
	t.Logf("%d of %d keys stayed after the third decode joined", stayed, nKeys)

	// x-smg-target-worker: the index into [D0, D1, D2] (registry order); it
	// wins over the routing key.
	for idx := 0; idx < 3; idx++ {
		for rep := 0; rep < 2; rep++ {
			hdr := map[string]string{"x-smg-target-worker": strconv.Itoa(idx)}
			if rep == 1 {
				hdr["x-smg-routing-key"] = "session-0"
			}
			_, di := f.send(t, gw, "target", hdr)
			assert.Equal(t, idx, di, "x-smg-target-worker: %d (headers %v)", idx, hdr)
		}
	}
	refused := func(val string) {
		t.Helper()
		f.reset()
		r := post(t, gw.URL+"/v1/completions", `{"prompt":"target","max_tokens":2}`, map[string]string{"x-smg-target-worker": val})
		require.Equal(t, 503, r.Status, "x-smg-target-worker: %s: %s", val, r.Body)
		code, msg, _ := errorBody(t, r)
		assert.Equal(t, "no_available_workers", code, "x-smg-target-worker: %s", val)
		assert.Contains(t, msg, "decode", "x-smg-target-worker: %s", val)
		p, d := f.counts()
		assert.Equal(t, []int{0, 0}, p, "no prefill may be contacted when the decode selection fails")
		assert.Equal(t, []int{0, 0, 0}, d, "no decode may be contacted")
	}
	refused("3")
	refused("-1")
	refused("one")

	// D0 goes unhealthy: the index now counts within [D1, D2], so 0 is D1 and
	// 2 has no candidate.
	f.D[0].UpdateConfig(func(c *sglang.Config) { c.StartupWindow = time.Hour })
	waitFor(t, 15*time.Second, func() bool { return workerStatus(t, gw, f.D[0].URL()) == "not_ready" }, "decode 0 never marked not_ready")
	_, di := f.send(t, gw, "target", map[string]string{"x-smg-target-worker": "0"})
	assert.Equal(t, 1, di, "index 0 is the first available decode")
	_, di = f.send(t, gw, "target", map[string]string{"x-smg-target-worker": "1"})
	assert.Equal(t, 2, di, "index 1 is the second available decode")
	refused("2")
}

// TestPolicyCacheAwarePrefixAffinity: cache_aware on both legs. A request
// whose text extends a long prompt an earlier request carried goes to the
// worker that served that prompt, on each leg. The first two unrelated
// prompts land on different workers (nothing matches, so the least-loaded,
// then least-picked worker is taken), and the sequence A, B, A+x, A+y, B+x,
// B+y defeats both a rotation and a constant choice.
func TestPolicyCacheAwarePrefixAffinity(t *testing.T) {
	f := newPolFleet(t, 2, 2)
	gw := startGateway(t, gwOpts{Prefills: f.prefills(), Decodes: f.decodes(), Extra: []string{"--policy", "cache_aware"}})

	long := func(seed string) string {
		var b strings.Builder
		for i := 0; b.Len() < 1500; i++ {
			fmt.Fprintf(&b, "%s paragraph %d of a shared system prompt. ", seed, i)
		}
		return b.String()
	}
	a, b := "Alpha: "+long("alpha"), "Bravo: "+long("bravo")

	aP, aD := f.send(t, gw, a, nil)
	bP, bD := f.send(t, gw, b, nil)
	require.NotEqual(t, aP, bP, "with nothing cached the second prompt goes to the other (less used) prefill")
	require.NotEqual(t, aD, bD, "with nothing cached the second prompt goes to the other (less used) decode")

	for i, c := range []struct {
		prompt string
		p, d   int
	}{
		{a + " Question one?", aP, aD},
		{a + " Question two, longer than the first one?", aP, aD},
		{b + " Question one?", bP, bD},
		{b + " Question two, longer than the first one?", bP, bD},
		{a, aP, aD}, // an exact repeat
	} {
		pi, di := f.send(t, gw, c.prompt, nil)
		assert.Equal(t, c.p, pi, "request %d: the prefill that computed the shared prefix", i)
		assert.Equal(t, c.d, di, "request %d: the decode that holds the shared prefix", i)
	}
}

// polRun runs the gateway binary and expects it to refuse to start: to exit
// non-zero before its control plane comes up. A gateway that gets as far as
// "control plane up" was accepted; it is killed and the test fails.
func polRun(t *testing.T, args ...string) (code int, stderr string) {
	t.Helper()
	base := []string{"launch", "--pd-disaggregation", "--host", "127.0.0.1", "--port", strconv.Itoa(freePort(t)),
		"--prometheus-port", "0", "--envoy-path", envoyBin}
	cmd := exec.Command(gatewayBin, append(base, args...)...)
	errb := &syncBuffer{}
	cmd.Stdout, cmd.Stderr = io.Discard, errb
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	require.NoError(t, cmd.Start())
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	deadline := time.After(30 * time.Second)
	for {
		select {
		case err := <-done:
			require.Error(t, err, "the gateway exited 0:\n%s", errb.String())
			return cmd.ProcessState.ExitCode(), errb.String()
		case <-deadline:
			_ = cmd.Process.Kill()
			<-done
			t.Fatalf("the gateway neither exited nor came up in 30 s:\n%s", tail(errb.String(), 3000))
		case <-time.After(20 * time.Millisecond):
			if strings.Contains(errb.String(), "control plane up") {
				_ = cmd.Process.Kill()
				<-done
				t.Fatalf("the gateway was not refused:\n%s", tail(errb.String(), 3000))
			}
		}
	}
}

// TestPolicyStartupRefusals: bucket is refused for the decode leg (named or
// inherited from --policy), power_of_two with fewer than two startup workers
// on its leg; the same legs accept bucket on prefill and power_of_two with
// two decodes, and the gateway serves with them.
func TestPolicyStartupRefusals(t *testing.T) {
	f := newPolFleet(t, 2, 2)
	onePD := []string{"--prefill", f.P[0].URL(), strconv.Itoa(f.P[0].BootstrapPort()), "--decode", f.D[0].URL()}
	twoP := []string{"--prefill", f.P[0].URL(), strconv.Itoa(f.P[0].BootstrapPort()),
		"--prefill", f.P[1].URL(), strconv.Itoa(f.P[1].BootstrapPort()), "--decode", f.D[0].URL()}

	for _, c := range []struct {
		name string
		args []string
		want string // regexp over stderr
	}{
		{"bucket-decode", append([]string{"--decode-policy", "bucket"}, onePD...), `bucket.*decode`},
		{"bucket-inherited", append([]string{"--policy", "bucket"}, onePD...), `bucket.*decode`},
		{"p2c-decode", append([]string{"--prefill-policy", "round_robin", "--decode-policy", "power_of_two"}, twoP...), `power_of_two as the decode policy needs at least two decode workers`},
		{"p2c-prefill", append([]string{"--prefill-policy", "power_of_two", "--decode-policy", "round_robin"}, onePD...), `power_of_two as the prefill policy needs at least two prefill workers`},
		{"p2c-inherited", append([]string{"--policy", "power_of_two"}, twoP...), `power_of_two as the decode policy needs at least two decode workers`},
	} {
		t.Run(c.name, func(t *testing.T) {
			code, stderr := polRun(t, c.args...)
			assert.NotZero(t, code)
			assert.Regexp(t, c.want, stderr)
		})
	}
	for _, s := range append(append([]*sglang.Server{}, f.P...), f.D...) {
		assert.Empty(t, s.Requests(), "a refused gateway must not send engine requests")
	}

	t.Run("accepted", func(t *testing.T) {
		gw := startGateway(t, gwOpts{Prefills: f.prefills(), Decodes: f.decodes(), Extra: []string{
			"--prefill-policy", "bucket", "--decode-policy", "power_of_two",
		}})
		// JSON or console logs: "prefill_policy":"bucket" or prefill_policy=bucket.
		assert.Regexp(t, `prefill_policy"?[=:]"?bucket\b`, gw.Logs())
		assert.Regexp(t, `decode_policy"?[=:]"?power_of_two\b`, gw.Logs())
		// bucket lays [0, 4096) out over the prefills in registry order, the
		// last range open-ended: with two prefills a prompt of 2048+
		// characters belongs to the second. A rotation or the default
		// cache_aware would start on the first.
		long := strings.Repeat("x", 3000)
		pi, _ := f.send(t, gw, long, nil)
		assert.Equal(t, 1, pi, "a 3000-character prompt is in the second prefill's bucket")
		for i := 0; i < 4; i++ {
			f.send(t, gw, "short "+strconv.Itoa(i), nil)
		}
	})
}
