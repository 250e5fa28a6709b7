package main

import (
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strings"
	"time"
)

func execOut(name string, args ...string) (string, error) {
	out, err := exec.Command(name, args...).CombinedOutput()
	return string(out), err
}

// stats of one mode in one cell; times in milliseconds.
type stats struct {
	n, errs                  int
	p50, p90, p99, max, mean float64
	ttfb50, ttfb99           float64
	rps                      float64
}

func ms(d time.Duration) float64 { return float64(d) / 1e6 }

// pct is the nearest-rank percentile of sorted values.
func pct(sorted []time.Duration, p float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	i := int(float64(len(sorted))*p+0.999999) - 1
	return ms(sorted[min(max(i, 0), len(sorted)-1)])
}

func summarize(b *batch) stats {
	s := stats{n: len(b.samples), errs: b.errs}
	if s.n == 0 {
		return s
	}
	tot := make([]time.Duration, s.n)
	ttfb := make([]time.Duration, s.n)
	var sum time.Duration
	for i, x := range b.samples {
		tot[i], ttfb[i] = x.total, x.ttfb
		sum += x.total
	}
	slices.Sort(tot)
	slices.Sort(ttfb)
	s.p50, s.p90, s.p99, s.max = pct(tot, .5), pct(tot, .9), pct(tot, .99), ms(tot[s.n-1])
	s.mean = ms(sum) / float64(s.n)
	s.ttfb50, s.ttfb99 = pct(ttfb, .5), pct(ttfb, .99)
	if b.wall > 0 {
		s.rps = float64(s.n) / b.wall.Seconds()
	}
	return s
}

func phaseMean(b *batch, i int) float64 {
	if len(b.samples) == 0 {
		return 0
	}
	var sum time.Duration
	for _, s := range b.samples {
		sum += s.phases[i]
	}
	return ms(sum) / float64(len(b.samples))
}

// perK is CPU milliseconds per 1000 requests.
func perK(cpu float64, b *batch) float64 {
	n := len(b.samples) + b.errs
	if n == 0 {
		return 0
	}
	return cpu * 1000 / float64(n)
}

func errCell(b *batch) string {
	if b.errs == 0 {
		return "0"
	}
	return fmt.Sprintf("**%d**", b.errs)
}

func commandLine() string {
	args := strings.Join(os.Args[1:], " ")
	if os.Getenv("MAKELEVEL") != "" {
		if args == "" {
			return "make bench"
		}
		return fmt.Sprintf("make bench BENCH_ARGS='%s'", args)
	}
	return strings.TrimSpace("go run ./test/bench " + args)
}

func report(env envInfo, o options, stacks map[string]*stack, rs []*cellResult, prof *profile, idle idleState, took time.Duration) string {
	gw := stacks[stackSGLang].gw
	vl := stacks[stackVLLM]
	var w strings.Builder
	p := func(format string, args ...any) { fmt.Fprintf(&w, format, args...) }
	p("# smg-extproc: what the gateway adds\n\n")
	p("- Date: %s\n", time.Now().UTC().Format("2006-01-02 15:04 MST"))
	p("- Command: `%s` (from the repository root; %.0f s measured)\n", commandLine(), took.Seconds())
	p("- Machine: %d CPUs (nproc), %s, Linux %s; bench GOMAXPROCS=%d\n", env.nproc, env.cpuModel, env.kernel, env.gomaxprocs)
	p("- Go: %s; Envoy: `%s`\n", env.goVersion, env.envoyVer)
	p("- Gateway: `bin/smg-extproc %s` (ports and paths as placeholders; Envoy runs with its default worker-thread count, one per CPU = %d); binary %s\n",
		strings.Join(shortArgs(gw.Args), " "), env.nproc, env.gwBuild)
	if len(gw.Env) > 0 {
		p("- Gateway environment additions: `%s`\n", strings.Join(gw.Env, " "))
	}
	if vl != nil {
		var pairing []string
		for _, w := range vl.workers {
			pairing = append(pairing, fmt.Sprintf("%s runtime `%s`, `%s`, pairing `%s`", w.WorkerType, w.RuntimeType, w.KVConnector, w.PDPairing))
		}
		p("- vLLM gateway (the vllm-* cells): a second `bin/smg-extproc %s` with no worker on the command line; the fake vLLM prefill and decode were added through `POST /workers` (`{\"url\",\"worker_type\",\"kv_connector\":\"NixlConnector\"}`) and were ready before measuring (GET /workers: %s). Each gateway is idle while the other one's cells run.\n",
			strings.Join(shortArgs(vl.gw.Args), " "), strings.Join(pairing, "; "))
	}
	p("- Engines: one fake SGLang prefill and one fake decode (pkg/fake/sglang, zero prefill/per-token/transfer delay) inside the bench process; the decode really waits for its prefill over the bootstrap server.")
	if vl != nil {
		p(" vLLM cells: one strict fake vLLM prefill (`kv_producer`) and one decode (`kv_consumer`), both `NixlConnector` (pkg/fake/vllm, zero delays), also in the bench process; the decode reads the handoff from the prefill's NIXL side channel.")
	}
	p("\n")
	p("- Method: closed loop, c workers each sending its next request when the last one ends; per cell every mode is warmed up, then runs in %d rounds in ABBA order (cap %s per mode); HTTP/1.1 keep-alive, no compression. Latency = request start to the last byte of the decode answer. Every answer is checked: 200, `X-Fake-KV: transferred`, a chat completion JSON or a complete SSE stream ending in `[DONE]`.\n", o.rounds, o.capMode)
	p("- Modes: **direct** = the bench is an ideal zero-cost gateway (SGLang: mints the room, appends `bootstrap_host/port/room`, POSTs prefill and decode at once, drains the prefill, times the decode; vLLM NIXL, sequential: POSTs the one-token prefill leg — `max_tokens` 1, `stream` false, `kv_transfer_params` `{\"do_remote_decode\":true,\"do_remote_prefill\":false}`, built once per workload — reads the top-level `kv_transfer_params` of its JSON answer, POSTs the client body plus those params verbatim to the decode, times both legs); **ext_proc only** = the bench plays Envoy against smg-extproc's gRPC port (request headers, buffered body, decode leg sent by the bench with the processor's body, response headers) — Go processor + gRPC without Envoy; **via gateway** = the client body to Envoy's port.\n")
	noisy := false
	var noise []string
	for _, r := range rs {
		n := r.noise(env.nproc)
		noisy = noisy || n > 0.05
		s := fmt.Sprintf("%s %.0f%%", r.name, n*100)
		if r.attempts > 1 {
			s += fmt.Sprintf(" (quietest of %d runs)", r.attempts)
		}
		noise = append(noise, s)
	}
	switch {
	case !idle.waited:
		p("- Machine load: not checked before the run (-wait-idle 0).")
	case idle.ok:
		p("- Machine load: idle before the run (other processes < 10%% of the CPUs for 3 s, after %.0f s of waiting).", idle.took.Seconds())
	default:
		p("- Machine load: **busy before the run** (other processes used %.0f%% of the CPUs after %.0f s of waiting).", idle.share*100, idle.took.Seconds())
	}
	p(" CPU share used by other processes during each cell's measured rounds: %s.", strings.Join(noise, ", "))
	if noisy {
		p(" **Other processes competed for the CPUs (> 5%%) in some cells: treat those figures with care.**")
	}
	p("\n")
	if o.quick {
		p("- **-quick run: small counts, figures are indicative only.**\n")
	}
	p("\n")

	sections := []struct{ scenario, title string }{
		{"small", "1. Small non-streaming chat (1 KB body, `max_tokens` 8)"},
		{"sse", "2. Streaming chat (SSE, 64 tokens, c=1)"},
		{"large", "3. Large non-streaming chat (~400 KB prompt, `max_tokens` 8)"},
		{"vllm-small", "4. vLLM NIXL (sequential): small non-streaming chat (1 KB body, `max_tokens` 8)"},
		{"vllm-sse", "5. vLLM NIXL (sequential): streaming chat (SSE, 64 tokens, c=1)"},
	}
	for _, sec := range sections {
		var cs []*cellResult
		for _, r := range rs {
			if r.scenario == sec.scenario {
				cs = append(cs, r)
			}
		}
		if len(cs) == 0 {
			continue
		}
		p("## %s\n\n", sec.title)
		if cs[0].stack == stackVLLM {
			p("Sequential path: the prefill leg (one token) must answer before the decode leg goes out. direct = the bench relays the handoff itself (prefill, then decode); via gateway = the vLLM gateway does it.\n\n")
		}
		phases := phaseNames
		if cs[0].stack == stackVLLM {
			phases = vllmPhaseNames
		}
		if cs[0].w.stream {
			p("| c | mode | n | errors | first byte p50 ms | first byte p99 ms | full stream p50 ms | full stream p99 ms | req/s |\n|---|---|---|---|---|---|---|---|---|\n")
			for _, r := range cs {
				for _, m := range r.modes {
					s := summarize(r.res[m])
					p("| %d | %s | %d | %s | %.3f | %.3f | %.3f | %.3f | %.0f |\n", r.conc, m, s.n, errCell(r.res[m]), s.ttfb50, s.ttfb99, s.p50, s.p99, s.rps)
				}
			}
			p("\n| c | added first byte p50 ms | added first byte p99 ms | added full p50 ms | added full p99 ms | throughput gateway/direct |\n|---|---|---|---|---|---|\n")
			for _, r := range cs {
				d, g := summarize(r.res[modeDirect]), summarize(r.res[modeGateway])
				p("| %d | %+.3f | %+.3f | %+.3f | %+.3f | %.2f |\n", r.conc, g.ttfb50-d.ttfb50, g.ttfb99-d.ttfb99, g.p50-d.p50, g.p99-d.p99, ratio(g.rps, d.rps))
			}
		} else {
			p("| c | mode | n | errors | p50 ms | p90 ms | p99 ms | max ms | req/s |\n|---|---|---|---|---|---|---|---|---|\n")
			for _, r := range cs {
				for _, m := range r.modes {
					s := summarize(r.res[m])
					p("| %d | %s | %d | %s | %.3f | %.3f | %.3f | %.2f | %.0f |\n", r.conc, m, s.n, errCell(r.res[m]), s.p50, s.p90, s.p99, s.max, s.rps)
				}
			}
			hasEP := slices.Contains(cs[0].modes, modeExtProc)
			p("\n| c | added p50 ms | added p99 ms | throughput gateway/direct |")
			if hasEP {
				p(" ext_proc only: added p50 ms | added p99 ms | throughput |")
			}
			p("\n|---|---|---|---|")
			if hasEP {
				p("---|---|---|")
			}
			p("\n")
			for _, r := range cs {
				d, g := summarize(r.res[modeDirect]), summarize(r.res[modeGateway])
				p("| %d | %+.3f | %+.3f | %.2f |", r.conc, g.p50-d.p50, g.p99-d.p99, ratio(g.rps, d.rps))
				if hasEP {
					if b, ok := r.res[modeExtProc]; ok {
						e := summarize(b)
						p(" %+.3f | %+.3f | %.2f |", e.p50-d.p50, e.p99-d.p99, ratio(e.rps, d.rps))
					} else {
						p(" | | |")
					}
				}
				p("\n")
			}
			if hasEP {
				p("\next_proc only, where a request's time goes (mean of each step, ms; the bench plays Envoy; the steps add up to the mean latency):\n\n| c |")
				for _, n := range phases {
					p(" %s |", n)
				}
				p(" rest (decode body read, client) | mean latency |\n|---|---|---|---|---|---|---|\n")
				for _, r := range cs {
					b, ok := r.res[modeExtProc]
					if !ok || len(b.samples) == 0 {
						continue
					}
					p("| %d |", r.conc)
					var sum float64
					for i := range nPhases {
						v := phaseMean(b, i)
						sum += v
						p(" %.3f |", v)
					}
					m := summarize(b).mean
					p(" %.3f | %.3f |\n", m-sum, m)
				}
			}
		}
		p("\n")
	}

	p("## CPU per 1000 requests (ms)\n\n")
	p("From utime+stime in `/proc/<pid>/stat` (CLK_TCK %.0f) around every measured round. \"bench\" is the bench process: the client **and both fake engines**, so it is comparable across modes only as a total.\n\n", clkTck)
	p("| cell | smg-extproc (via gateway) | Envoy (via gateway) | smg-extproc (ext_proc only) | bench, direct | bench, via gateway | all processes, direct | all processes, via gateway |\n|---|---|---|---|---|---|---|---|\n")
	for _, r := range rs {
		d, g := r.res[modeDirect], r.res[modeGateway]
		epCol := "–"
		if b, ok := r.res[modeExtProc]; ok {
			epCol = fmt.Sprintf("%.0f", perK(b.cpu.gw, b))
		}
		p("| %s | %.0f | %.0f | %s | %.0f | %.0f | %.0f | %.0f |\n", r.name, perK(g.cpu.gw, g), perK(g.cpu.envoy, g), epCol,
			perK(d.cpu.self, d), perK(g.cpu.self, g), perK(d.cpu.self+d.cpu.gw+d.cpu.envoy, d), perK(g.cpu.self+g.cpu.gw+g.cpu.envoy, g))
	}
	p("\n")

	var bad []string
	for _, r := range rs {
		for _, m := range r.modes {
			if b := r.res[m]; b.errs > 0 {
				bad = append(bad, fmt.Sprintf("- %s, %s: %d errors; first: `%s`", r.name, m, b.errs, oneLineStr(b.firstErr)))
			}
		}
		if r.warmErrs > 0 {
			bad = append(bad, fmt.Sprintf("- %s warm-up: %d errors; first: `%s`", r.name, r.warmErrs, oneLineStr(r.warmFirst)))
		}
	}
	p("## Errors\n\n")
	if len(bad) == 0 {
		p("None: every request in every cell (and warm-up) passed validation.\n\n")
	} else {
		p("Cells with errors are not valid measurements.\n\n%s\n\n", strings.Join(bad, "\n"))
	}
	if prof != nil {
		p("%s", prof.markdown())
	}
	return w.String()
}

func ratio(a, b float64) float64 {
	if b == 0 {
		return 0
	}
	return a / b
}

func oneLineStr(s string) string {
	s = strings.ReplaceAll(s, "\n", " ")
	s = strings.ReplaceAll(s, "`", "'")
	if len(s) > 240 {
		s = s[:240] + "…"
	}
	return s
}

// shortArgs replaces absolute paths and numeric ports in the launch command
// with placeholders so the report shows its shape.
func shortArgs(args []string) []string {
	out := make([]string, len(args))
	copy(out, args)
	for i := 0; i < len(out); i++ {
		switch out[i] {
		case "--envoy-path":
			if i+1 < len(out) {
				out[i+1] = "$ENVOY_BIN"
			}
		case "--port", "--prometheus-port", "--extproc-port":
			if i+1 < len(out) {
				out[i+1] = strings.ToUpper(strings.TrimPrefix(out[i], "--"))
				out[i+1] = strings.ReplaceAll(out[i+1], "-", "_")
			}
		case "--prefill":
			if i+2 < len(out) {
				out[i+1], out[i+2] = "http://127.0.0.1:PREFILL", "BOOTSTRAP_PORT"
			}
		case "--decode":
			if i+1 < len(out) {
				out[i+1] = "http://127.0.0.1:DECODE"
			}
		}
	}
	return out
}
