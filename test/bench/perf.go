package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// profile is a perf CPU profile of smg-extproc during an extra, unmeasured
// c=16 small-request run through the gateway.
type profile struct {
	seconds   float64
	requests  int
	errs      int
	rps       float64
	cpuGW     float64   // smg-extproc CPU ms per 1000 requests while profiled
	samples   string    // as perf prints it, e.g. "4K"
	self      []profRow // top symbols by self time
	groups    []profRow // self time grouped by package
	inclusive []profRow // selected frames, self + callees
	note      string
}

type profRow struct {
	pct  float64
	name string
}

func runProfile(ctx context.Context, t *target, pids cpuPids, o options) *profile {
	perf, err := exec.LookPath("perf")
	if err != nil {
		return &profile{note: "perf is not installed; no profile."}
	}
	data := o.perfData
	if data == "" {
		dir, err := os.MkdirTemp("", "smg-bench-perf-")
		if err != nil {
			return &profile{note: "perf: " + err.Error()}
		}
		defer os.RemoveAll(dir)
		data = filepath.Join(dir, "perf.data")
	}
	dur := 10 * time.Second
	if o.quick {
		dur = 2 * time.Second
	}
	logf("profiling smg-extproc (pid %d) with perf for %s at c=16", pids.gw, dur)
	rec := exec.Command(perf, "record", "-F", "999", "-g", "-p", strconv.Itoa(pids.gw), "-o", data)
	var recOut syncBuffer
	rec.Stdout, rec.Stderr = &recOut, &recOut
	rec.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := rec.Start(); err != nil {
		return &profile{note: "perf record: " + err.Error()}
	}
	time.Sleep(500 * time.Millisecond)
	w := &workload{path: "/v1/chat/completions", body: chatBody(1024, 8, false)}
	b := runClosed(ctx, t.viaGateway, w, 16, 1<<30, time.Now().Add(dur), pids)
	_ = rec.Process.Signal(syscall.SIGINT)
	done := make(chan error, 1)
	go func() { done <- rec.Wait() }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		_ = rec.Process.Kill()
		<-done
	}
	st := summarize(b)
	p := &profile{seconds: b.wall.Seconds(), requests: st.n, errs: b.errs, rps: st.rps, cpuGW: perK(b.cpu.gw, b)}
	if _, err := os.Stat(data); err != nil {
		p.note = "perf record produced no data: " + oneLineStr(recOut.String())
		return p
	}
	selfOut, err := exec.Command(perf, "report", "-i", data, "--stdio", "--no-children", "--sort", "sym", "-g", "none", "--percent-limit", "0").Output()
	if err != nil {
		p.note = "perf report: " + err.Error()
		return p
	}
	rows, samples := parsePerf(string(selfOut))
	p.samples = samples
	if samples == "" || len(rows) == 0 {
		p.samples, p.note = "", "perf recorded no samples: "+oneLineStr(recOut.String())
		return p
	}
	group := map[string]float64{}
	for _, r := range rows {
		group[category(r.name)] += r.pct
	}
	for k, v := range group {
		p.groups = append(p.groups, profRow{v, k})
	}
	sort.Slice(p.groups, func(i, j int) bool { return p.groups[i].pct > p.groups[j].pct })
	p.self = rows[:min(len(rows), 20)]
	if incOut, err := exec.Command(perf, "report", "-i", data, "--stdio", "--children", "--sort", "sym", "-g", "none", "--percent-limit", "0.5").Output(); err == nil {
		inc, _ := parsePerf(string(incOut))
		for _, r := range inc {
			if interesting.MatchString(r.name) {
				p.inclusive = append(p.inclusive, r)
			}
		}
		p.inclusive = p.inclusive[:min(len(p.inclusive), 30)]
	}
	return p
}

var perfLine = regexp.MustCompile(`^\s*([0-9.]+)%\s+(?:([0-9.]+)%\s+)?\[(.)\]\s+(.*?)\s*$`)

// parsePerf reads `perf report --stdio -g none --sort sym` lines. With
// --children, the first percentage is self+callees.
func parsePerf(out string) ([]profRow, string) {
	var rows []profRow
	samples := ""
	for _, l := range strings.Split(out, "\n") {
		if strings.HasPrefix(l, "# Samples:") {
			if f := strings.Fields(l); len(f) >= 3 {
				samples = f[2]
			}
			continue
		}
		m := perfLine.FindStringSubmatch(l)
		if m == nil {
			continue
		}
		v, _ := strconv.ParseFloat(m[1], 64)
		name := m[4]
		if m[3] == "k" {
			name = "[kernel] " + name
		}
		rows = append(rows, profRow{v, name})
	}
	return rows, samples
}

var interesting = regexp.MustCompile(`smg-project|grpc/internal/transport\.\(\*(loopyWriter\)\.run|http2Server\)\.(HandleStreams|operateHeaders))|grpc\.\(\*Server\)\.(processStreamingRPC|handleStream)|net/http\.\(\*persistConn\)\.(readLoop|writeLoop|roundTrip)|net/http\.\(\*conn\)\.serve|runtime\.(gcBgMarkWorker|mallocgc|schedule|findRunnable|netpoll|newstack|scanstack|morestack\.abi0)$|structpb|proto\.(Marshal|Unmarshal|MarshalOptions|UnmarshalOptions)|prometheus|zerolog|crypto/rand|^\[kernel\] (entry_SYSCALL|do_syscall|__x64_sys|tcp_sendmsg|tcp_recvmsg|__sys_sendto|__sys_recvfrom|ksys_write|ksys_read)`)

// category buckets a symbol for the grouped self-time table.
func category(sym string) string {
	switch {
	case strings.HasPrefix(sym, "[kernel]"):
		return "kernel (syscalls, loopback TCP, scheduler)"
	case strings.Contains(sym, "smg-project/smg-extproc"):
		return "smg-extproc's own code (pkg/extproc, pkg/pd, ...)"
	case strings.HasPrefix(sym, "google.golang.org/grpc"), strings.HasPrefix(sym, "golang.org/x/net/http2"):
		return "gRPC + HTTP/2 (ext_proc stream)"
	case strings.HasPrefix(sym, "google.golang.org/protobuf"), strings.HasPrefix(sym, "github.com/envoyproxy"):
		return "protobuf (ext_proc messages)"
	case strings.HasPrefix(sym, "net/http"), strings.HasPrefix(sym, "net."), strings.HasPrefix(sym, "internal/poll"),
		strings.HasPrefix(sym, "bufio"), strings.HasPrefix(sym, "syscall"), strings.HasPrefix(sym, "net/textproto"):
		return "net/http + net (prefill leg)"
	case strings.HasPrefix(sym, "github.com/prometheus"):
		return "Prometheus client"
	case strings.HasPrefix(sym, "github.com/rs/zerolog"):
		return "zerolog"
	case strings.HasPrefix(sym, "crypto/"), strings.HasPrefix(sym, "vendor/golang.org/x/crypto"):
		return "crypto (room minting)"
	case isStackSym(sym):
		return "Go runtime: stack unwinding/copying (goroutine stack growth, GC stack scans)"
	case strings.HasPrefix(sym, "runtime.") && isGCSym(sym):
		return "Go runtime: allocation + GC"
	case strings.HasPrefix(sym, "runtime.memmove"), strings.HasPrefix(sym, "runtime.memclr"):
		return "Go runtime: memmove/memclr"
	case strings.HasPrefix(sym, "runtime."), strings.HasPrefix(sym, "internal/runtime"), strings.HasPrefix(sym, "sync"),
		strings.HasPrefix(sym, "context."), strings.HasPrefix(sym, "time."):
		return "Go runtime: scheduler, channels, locks, timers"
	case strings.HasPrefix(sym, "encoding/"), strings.HasPrefix(sym, "strconv"), strings.HasPrefix(sym, "strings"),
		strings.HasPrefix(sym, "bytes"), strings.HasPrefix(sym, "unicode"), strings.HasPrefix(sym, "fmt"),
		strings.HasPrefix(sym, "aeshash"), strings.HasPrefix(sym, "indexbyte"):
		return "std text (strings, strconv, maps)"
	}
	return "other"
}

func isStackSym(s string) bool {
	for _, k := range []string{"runtime.step", "runtime.pcvalue", "runtime.pcdatavalue", "runtime.findfunc", "runtime.(*stkframe)",
		"runtime.adjustframe", "runtime.adjustpointers", "runtime.copystack", "runtime.newstack", "runtime.(*unwinder)",
		"runtime.readvarint", "runtime.funcdata", "runtime.funcInfo", "runtime.(*moduledata).textAddr", "runtime.funcspdelta",
		"runtime.stackalloc", "runtime.stackfree", "runtime.stackpool", "runtime.morestack", "runtime.funcMaxSPDelta",
		"runtime.fillstack", "runtime.stackcache", "runtime.scanframeworker", "runtime.scanstack"} {
		if strings.HasPrefix(s, k) {
			return true
		}
	}
	return false
}

func isGCSym(s string) bool {
	for _, k := range []string{"gc", "scan", "mark", "sweep", "malloc", "alloc", "heap", "span", "wb", "Barrier", "greyobject",
		"findObject", "typePointers", "newobject", "makeslice", "growslice", "mcache", "mcentral", "mheap", "pageAlloc",
		"memclrNoHeapPointers", "bulkBarrier", "nextFreeFast", "profilealloc", "deductAssist"} {
		if strings.Contains(s, k) {
			return true
		}
	}
	return false
}

func (p *profile) markdown() string {
	var w strings.Builder
	f := func(format string, args ...any) { fmt.Fprintf(&w, format, args...) }
	f("## CPU profile of smg-extproc (c=16 small requests via the gateway)\n\n")
	if p.samples == "" {
		f("%s\n\n", p.note)
		return w.String()
	}
	f("`perf record -F 999 -g -p <smg-extproc pid>` during an extra, unmeasured %.1f s run of the small-c16 cell through the gateway (%d requests, %d errors, %.0f req/s, smg-extproc %.0f CPU ms per 1000 requests, %s samples). Go frame pointers give the call chains; Envoy is stripped and not profiled.\n\n",
		p.seconds, p.requests, p.errs, p.rps, p.cpuGW, p.samples)
	f("Self time by package:\n\n| share of smg-extproc CPU | where |\n|---|---|\n")
	for _, r := range p.groups {
		if r.pct >= 0.1 {
			f("| %.1f%% | %s |\n", r.pct, r.name)
		}
	}
	f("\nTop symbols by self time:\n\n| self | symbol |\n|---|---|\n")
	for _, r := range p.self {
		f("| %.2f%% | `%s` |\n", r.pct, r.name)
	}
	if len(p.inclusive) > 0 {
		f("\nSelected frames, self + callees:\n\n| incl. | frame |\n|---|---|\n")
		for _, r := range p.inclusive {
			f("| %.1f%% | `%s` |\n", r.pct, r.name)
		}
	}
	f("\n")
	return w.String()
}
