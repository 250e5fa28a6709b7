// Command bench measures what the smg-extproc gateway (real Envoy + the Go
// ext_proc server) adds over calling the engines directly. `make bench` runs
// it; see docs/benchmarks.md.
//
// One run starts a fake SGLang prefill and decode in-process (no artificial
// delays) and `bin/smg-extproc launch` as a child; when a vLLM cell is
// selected, also a strict fake vLLM NIXL prefill (kv_producer) and decode
// (kv_consumer) and a second gateway that gets only that pair through its
// worker API (POST /workers), so round-robin prefill selection never mixes
// the two pools. It then runs each scenario cell in every mode with the
// modes alternated in ABBA rounds so machine noise hits them alike:
//
//   - direct: the bench does an ideal zero-cost gateway's work itself and
//     times the decode answer. SGLang: random room, bootstrap keys, both legs
//     at once. vLLM NIXL: the one-token prefill leg first, then the client's
//     body plus the prefill's kv_transfer_params to the decode (sequential);
//   - ext_proc only (small-request cells): the bench plays Envoy against the
//     processor's gRPC port, isolating the Go side from Envoy's proxying;
//   - via gateway: the client body goes to Envoy's port.
//
// CPU of smg-extproc and its Envoy child comes from /proc/<pid>/stat around
// every round. The Markdown report goes to stdout and, with -out, to a file.
package main

import (
	"context"
	"debug/buildinfo"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/smg-project/smg-extproc/pkg/fake/sglang"
	"github.com/smg-project/smg-extproc/pkg/fake/vllm"
)

type mode int

const (
	modeDirect mode = iota
	modeExtProc
	modeGateway
)

func (m mode) String() string {
	switch m {
	case modeDirect:
		return "direct"
	case modeExtProc:
		return "ext_proc only"
	}
	return "via gateway"
}

// Stacks: the engines and the gateway a cell runs against.
const (
	stackSGLang = "sglang"
	stackVLLM   = "vllm"
)

// cell is one scenario at one concurrency.
type cell struct {
	scenario string // small, sse, large, vllm-small, vllm-sse
	name     string // e.g. small-c16
	conc     int
	n        int // measured requests per mode
	w        *workload
	modes    []mode
	stack    string // stackSGLang or stackVLLM
}

// stack is one gateway with its engines, as the cells of that stack use it.
type stack struct {
	name    string
	gw      *gateway
	t       *target
	pids    cpuPids
	fns     map[mode]reqFunc
	workers []workerInfo // vLLM: the pair as GET /workers listed it
}

type cellResult struct {
	cell
	res       map[mode]*batch
	warmErrs  int
	warmFirst string
	elapsed   time.Duration
	attempts  int // runs of this cell; the one with the least interference is kept
}

// idleState is the outcome of the wait for an idle machine.
type idleState struct {
	waited, ok bool
	share      float64
	took       time.Duration
}

type options struct {
	quick     bool
	out       string
	scenarios string
	rounds    int
	capMode   time.Duration // time cap per mode per cell
	perf      bool
	perfData  string
	waitIdle  time.Duration
	maxNoise  float64
	gwEnv     string
	retries   int
	extproc   bool
}

func main() {
	var o options
	flag.BoolVar(&o.quick, "quick", false, "small request counts (smoke run, < 30 s)")
	flag.StringVar(&o.out, "out", "", "also write the Markdown report to this file")
	flag.StringVar(&o.scenarios, "scenarios", "", "comma-separated scenario, cell or stack names to run (small, sse, large, vllm-small, vllm-sse, small-c16, ...; sglang or vllm for all cells of one stack); empty = all")
	flag.IntVar(&o.rounds, "rounds", 8, "alternating rounds per cell (ABBA order)")
	flag.DurationVar(&o.capMode, "cap", 0, "time cap per mode per cell (default 12s, 3s with -quick)")
	flag.BoolVar(&o.perf, "perf", true, "after the measured cells, profile smg-extproc with perf during an extra c=16 run (skipped if perf is missing)")
	flag.StringVar(&o.perfData, "perf-data", "", "keep the perf.data file at this path")
	flag.DurationVar(&o.waitIdle, "wait-idle", -1, "before measuring, wait up to this long for other processes to leave the CPUs idle (default 2m, 0 with -quick)")
	flag.Float64Var(&o.maxNoise, "max-noise", 0.10, "run a cell again when other processes used more than this share of the CPUs during it")
	flag.IntVar(&o.retries, "retries", -1, "how many times a noisy cell is run again, the quietest run being reported (default 2, 0 with -quick)")
	flag.StringVar(&o.gwEnv, "gateway-env", "", "comma-separated KEY=VALUE pairs added to the gateway's environment (e.g. GODEBUG=adaptivestackstart=1)")
	flag.BoolVar(&o.extproc, "extproc", true, "add the ext_proc-only mode (bench plays Envoy) to the small-request cells")
	flag.Parse()
	if o.capMode == 0 {
		o.capMode = 12 * time.Second
		if o.quick {
			o.capMode = 3 * time.Second
		}
	}
	if o.waitIdle < 0 {
		o.waitIdle = 2 * time.Minute
		if o.quick {
			o.waitIdle = 0
		}
	}
	if o.retries < 0 {
		o.retries = 2
		if o.quick {
			o.retries = 0
		}
	}
	if o.rounds < 1 {
		o.rounds = 1
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, o)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "%s bench: %s\n", time.Now().Format("15:04:05"), fmt.Sprintf(format, args...))
}

// chatBody is a chat request of about size bytes (words of 8-9 characters).
func chatBody(size, maxTokens int, stream bool) []byte {
	head := `{"model":"fake-model","messages":[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"`
	tailFmt := `"}],"max_tokens":%d,"temperature":0%s}`
	st := ""
	if stream {
		st = `,"stream":true`
	}
	tail := fmt.Sprintf(tailFmt, maxTokens, st)
	var b strings.Builder
	b.Grow(size + 64)
	b.WriteString(head)
	for i := 0; b.Len()+len(tail) < size; i++ {
		if i > 0 {
			b.WriteByte(' ')
		}
		fmt.Fprintf(&b, "word%04d", i%10000)
	}
	b.WriteString(tail)
	return []byte(b.String())
}

func cells(o options) []cell {
	small := &workload{path: "/v1/chat/completions", body: chatBody(1024, 8, false)}
	sse := &workload{path: "/v1/chat/completions", body: chatBody(1024, 64, true), stream: true, tokens: 64}
	large := &workload{path: "/v1/chat/completions", body: chatBody(400*1024, 8, false)}
	vsmall := vllmWorkload(chatBody(1024, 8, false), false, 0)
	vsse := vllmWorkload(chatBody(1024, 64, true), true, 64)
	two := []mode{modeDirect, modeGateway}
	three := two
	if o.extproc {
		three = []mode{modeDirect, modeExtProc, modeGateway}
	}
	cs := []cell{
		{"small", "small-c1", 1, 1500, small, three, stackSGLang},
		{"small", "small-c16", 16, 3000, small, three, stackSGLang},
		{"small", "small-c64", 64, 3000, small, three, stackSGLang},
		{"sse", "sse-c1", 1, 600, sse, two, stackSGLang},
		{"large", "large-c1", 1, 300, large, two, stackSGLang},
		{"large", "large-c8", 8, 300, large, two, stackSGLang},
		{"vllm-small", "vllm-small-c1", 1, 1500, vsmall, three, stackVLLM},
		{"vllm-small", "vllm-small-c16", 16, 3000, vsmall, three, stackVLLM},
		{"vllm-sse", "vllm-sse-c1", 1, 600, vsse, two, stackVLLM},
	}
	var out []cell
	want := map[string]bool{}
	for _, s := range strings.Split(o.scenarios, ",") {
		if s = strings.TrimSpace(s); s != "" {
			want[s] = true
		}
	}
	for _, c := range cs {
		if len(want) > 0 && !want[c.scenario] && !want[c.name] && !want[c.stack] {
			continue
		}
		if o.quick {
			c.n = max(c.n/15, 20)
		}
		out = append(out, c)
	}
	return out
}

// vllmWorkload is a chat workload with its NIXL prefill leg prepared.
func vllmWorkload(body []byte, stream bool, tokens int) *workload {
	leg, err := vllmPrefillLeg(body)
	if err != nil {
		panic(fmt.Sprintf("bench: vLLM prefill leg of %.80s: %v", body, err))
	}
	return &workload{path: "/v1/chat/completions", body: body, stream: stream, tokens: tokens, prefillLeg: leg}
}

// newStack dials the gateway's ext_proc port (when the mode is on) and
// collects what the cells of the stack need.
func newStack(name string, gw *gateway, t *target, direct reqFunc, epPort int, o options) (*stack, error) {
	st := &stack{name: name, gw: gw, t: t, pids: cpuPids{gw: gw.Pid(), envoy: findChild(gw.Pid(), "envoy")}}
	if st.pids.envoy == 0 {
		logf("warning: Envoy child of pid %d not found; its CPU is not reported", gw.Pid())
	}
	if o.extproc {
		ep, err := dialExtProc(fmt.Sprintf("127.0.0.1:%d", epPort), strings.TrimPrefix(gw.URL, "http://"))
		if err != nil {
			return nil, err
		}
		t.ep = ep
	}
	st.fns = map[mode]reqFunc{modeDirect: direct, modeExtProc: t.viaExtProc, modeGateway: t.viaGateway}
	return st, nil
}

func run(ctx context.Context, o options) (err error) {
	cs := cells(o)
	if len(cs) == 0 {
		return fmt.Errorf("-scenarios %q matches no cell", o.scenarios)
	}
	root, err := repoRoot()
	if err != nil {
		return err
	}
	bin := filepath.Join(root, "bin", "smg-extproc")
	if _, err := os.Stat(bin); err != nil {
		return fmt.Errorf("%s missing: run `make build` first", bin)
	}
	// Run a private copy: other builds may replace bin/smg-extproc during the
	// run, and perf needs the exact binary to resolve symbols afterwards.
	tmp, err := os.MkdirTemp("", "smg-bench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	if bin, err = copyExecutable(bin, filepath.Join(tmp, "smg-extproc")); err != nil {
		return err
	}
	envoy, err := findEnvoy(root)
	if err != nil {
		return err
	}
	env := describeEnv(envoy)

	fctx, cancelFakes := context.WithCancel(context.Background())
	defer cancelFakes()
	p, err := startFake(fctx, sglang.Prefill)
	if err != nil {
		return err
	}
	defer p.Close()
	d, err := startFake(fctx, sglang.Decode)
	if err != nil {
		return err
	}
	defer d.Close()

	freeEP := func() (int, error) {
		if !o.extproc {
			return 0, nil
		}
		return freePort()
	}
	epPort, err := freeEP()
	if err != nil {
		return err
	}
	env.gwBuild = buildInfo(bin, root)
	logf("starting gateway (copy of %s)", filepath.Join(root, "bin", "smg-extproc"))
	var gwEnv []string
	for _, kv := range strings.Split(o.gwEnv, ",") {
		if kv = strings.TrimSpace(kv); kv != "" {
			gwEnv = append(gwEnv, kv)
		}
	}
	sgWorkers := []string{"--prefill", p.URL(), strconv.Itoa(p.BootstrapPort()), "--decode", d.URL()}
	gw, err := startGateway(ctx, bin, envoy, sgWorkers, epPort, gwEnv, nil)
	if err != nil {
		return err
	}
	defer func() {
		logf("stopping gateway")
		gw.Stop()
	}()
	t := &target{client: newHTTPClient(), prefill: p.URL(), decode: d.URL(), bootPort: p.BootstrapPort(), gateway: gw.URL}
	sg, err := newStack(stackSGLang, gw, t, t.direct, epPort, o)
	if err != nil {
		return err
	}
	if t.ep != nil {
		defer t.ep.Close()
	}
	stacks := map[string]*stack{stackSGLang: sg}

	if slices.ContainsFunc(cs, func(c cell) bool { return c.stack == stackVLLM }) {
		vp, err := startVLLMFake(fctx, vllm.Producer)
		if err != nil {
			return err
		}
		defer vp.Close()
		vd, err := startVLLMFake(fctx, vllm.Consumer)
		if err != nil {
			return err
		}
		defer vd.Close()
		vepPort, err := freeEP()
		if err != nil {
			return err
		}
		// A gateway of its own with only the vLLM pair: the SGLang gateway's
		// round-robin prefill selection would alternate between both pools.
		logf("starting the vLLM gateway; registering the NIXL prefill and decode through POST /workers")
		var workers []workerInfo
		register := func(ctx context.Context, g *gateway) error {
			var err error
			workers, err = registerWorkers(ctx, g.URL, []workerSpec{
				{URL: vp.URL(), WorkerType: "prefill", KVConnector: string(vllm.Nixl)},
				{URL: vd.URL(), WorkerType: "decode", KVConnector: string(vllm.Nixl)},
			})
			return err
		}
		vgw, err := startGateway(ctx, bin, envoy, nil, vepPort, gwEnv, register)
		if err != nil {
			return err
		}
		defer func() {
			logf("stopping the vLLM gateway")
			vgw.Stop()
		}()
		vt := &target{client: newHTTPClient(), prefill: vp.URL(), decode: vd.URL(), gateway: vgw.URL}
		vl, err := newStack(stackVLLM, vgw, vt, vt.directSeq, vepPort, o)
		if err != nil {
			return err
		}
		if vt.ep != nil {
			defer vt.ep.Close()
		}
		vl.workers = workers
		stacks[stackVLLM] = vl
		// Each gateway is idle while the other one's cells run: its CPU is
		// the bench's own, not other processes' interference.
		sg.pids.idle = []int{vl.pids.gw, vl.pids.envoy}
		vl.pids.idle = []int{sg.pids.gw, sg.pids.envoy}
	}
	idle := idleState{waited: o.waitIdle > 0}
	if o.waitIdle > 0 {
		logf("waiting up to %s for an idle machine", o.waitIdle)
		t0 := time.Now()
		idle.share, idle.ok = waitIdle(ctx, o.waitIdle, 0.10, env.nproc)
		idle.took = time.Since(t0)
		if !idle.ok {
			logf("machine still busy (%.0f%% used by other processes); running anyway", idle.share*100)
		}
	}
	began := time.Now()
	var results []*cellResult
	for _, c := range cs {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		st := stacks[c.stack]
		r := runCell(ctx, c, st.fns, st.pids, o)
		logf("%s done in %.1fs (other processes: %.0f%% of the CPUs): %s", c.name, r.elapsed.Seconds(), r.noise(env.nproc)*100, oneLine(r))
		// Other processes competing for the CPUs skew the comparison (the
		// gateway needs more CPU than direct calls): wait and run the cell again.
		for try := 1; try <= o.retries && r.noise(env.nproc) > o.maxNoise && ctx.Err() == nil; try++ {
			logf("%s: other processes used %.0f%% of the CPUs (> %.0f%%); waiting for an idle machine and running it again (%d/%d)",
				c.name, r.noise(env.nproc)*100, o.maxNoise*100, try, o.retries)
			waitIdle(ctx, time.Minute, 0.10, env.nproc)
			again := runCell(ctx, c, st.fns, st.pids, o)
			again.attempts = r.attempts + 1
			logf("%s done in %.1fs (other processes: %.0f%% of the CPUs): %s", c.name, again.elapsed.Seconds(), again.noise(env.nproc)*100, oneLine(again))
			if again.noise(env.nproc) < r.noise(env.nproc) {
				r = again
			} else {
				r.attempts = again.attempts
			}
		}
		results = append(results, r)
	}
	if ctx.Err() != nil {
		return ctx.Err()
	}
	var prof *profile
	if o.perf {
		prof = runProfile(ctx, sg.t, sg.pids, o)
	}
	rep := report(env, o, stacks, results, prof, idle, time.Since(began))
	fmt.Print(rep)
	if o.out != "" {
		if err := os.WriteFile(o.out, []byte(rep), 0o644); err != nil {
			return err
		}
		logf("report written to %s", o.out)
	}
	for _, name := range []string{stackSGLang, stackVLLM} {
		if st := stacks[name]; st != nil && st.gw.exitedEarly() {
			return fmt.Errorf("%s gateway exited during the run:\n%s", name, tail(st.gw.logs.String(), 4000))
		}
	}
	return nil
}

func runCell(ctx context.Context, c cell, fns map[mode]reqFunc, pids cpuPids, o options) *cellResult {
	start := time.Now()
	r := &cellResult{cell: c, res: map[mode]*batch{}, attempts: 1}
	warm := max(4*c.conc, 50)
	if o.quick {
		warm = max(2*c.conc, 10)
	}
	for _, m := range c.modes {
		b := runClosed(ctx, fns[m], c.w, c.conc, warm, time.Now().Add(10*time.Second), pids)
		r.warmErrs += b.errs
		if r.warmFirst == "" && b.firstErr != "" {
			r.warmFirst = m.String() + ": " + b.firstErr
		}
		r.res[m] = &batch{}
	}
	per := (c.n + o.rounds - 1) / o.rounds
	for round := 0; round < o.rounds && ctx.Err() == nil; round++ {
		order := append([]mode(nil), c.modes...)
		if round%2 == 1 {
			for i, j := 0, len(order)-1; i < j; i, j = i+1, j-1 {
				order[i], order[j] = order[j], order[i]
			}
		}
		for _, m := range order {
			acc := r.res[m]
			// The cap is spread over the rounds so a slow mode still alternates.
			left := o.capMode*time.Duration(round+1)/time.Duration(o.rounds) - acc.wall
			todo := min(per, c.n-len(acc.samples)-acc.errs)
			if left <= 0 || todo <= 0 {
				continue
			}
			runtime.GC()
			acc.merge(runClosed(ctx, fns[m], c.w, c.conc, todo, time.Now().Add(left), pids))
		}
	}
	r.elapsed = time.Since(start)
	return r
}

// noise is the share of the machine's CPUs other processes used during the
// cell's measured rounds.
func (r *cellResult) noise(ncpu int) float64 {
	var others, wall float64
	for _, b := range r.res {
		others += b.cpu.others()
		wall += float64(b.wall.Milliseconds())
	}
	if wall == 0 {
		return 0
	}
	return others / (wall * float64(ncpu))
}

func oneLine(r *cellResult) string {
	var parts []string
	for _, m := range r.modes {
		b := r.res[m]
		st := summarize(b)
		parts = append(parts, fmt.Sprintf("%s n=%d err=%d p50=%.3fms p99=%.3fms %.0f/s", m, len(b.samples), b.errs, st.p50, st.p99, st.rps))
	}
	return strings.Join(parts, " | ")
}

// envInfo is the report header's machine description.
type envInfo struct {
	nproc      int
	cpuModel   string
	kernel     string
	goVersion  string
	envoyPath  string
	envoyVer   string
	gomaxprocs int
	gwBuild    string
}

// buildInfo describes the gateway binary: Go version and VCS stamp.
func buildInfo(bin, root string) string {
	bi, err := buildinfo.ReadFile(bin)
	if err != nil {
		return "unknown build"
	}
	rev, dirty := "", ""
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			if s.Value == "true" {
				dirty = " + uncommitted changes"
			}
		}
	}
	if rev == "" {
		// No stamp in the binary: describe the working tree it was built from.
		out, err := exec.Command("git", "-C", root, "rev-parse", "HEAD").Output()
		if err != nil {
			return "built by " + bi.GoVersion + ", no VCS stamp"
		}
		rev = strings.TrimSpace(string(out))
		if st, err := exec.Command("git", "-C", root, "status", "--porcelain", "--untracked-files=no").Output(); err == nil && len(st) > 0 {
			dirty = " + uncommitted changes"
		}
		return fmt.Sprintf("built by %s from the working tree at commit %.12s%s", bi.GoVersion, rev, dirty)
	}
	return fmt.Sprintf("built by %s from commit %.12s%s", bi.GoVersion, rev, dirty)
}

func describeEnv(envoy string) envInfo {
	e := envInfo{nproc: runtime.NumCPU(), goVersion: runtime.Version(), envoyPath: envoy, gomaxprocs: runtime.GOMAXPROCS(0)}
	if out, err := execOut("nproc"); err == nil {
		if n, err := strconv.Atoi(strings.TrimSpace(out)); err == nil {
			e.nproc = n
		}
	}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(l, "model name") {
				if i := strings.IndexByte(l, ':'); i >= 0 {
					e.cpuModel = strings.TrimSpace(l[i+1:])
					break
				}
			}
		}
	}
	if b, err := os.ReadFile("/proc/sys/kernel/osrelease"); err == nil {
		e.kernel = strings.TrimSpace(string(b))
	}
	if out, err := execOut(envoy, "--version"); err == nil {
		for _, l := range strings.Split(out, "\n") {
			if i := strings.Index(l, "version:"); i >= 0 {
				e.envoyVer = strings.TrimSpace(l[i:])
				break
			}
		}
	}
	return e
}
