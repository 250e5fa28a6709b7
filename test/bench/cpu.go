package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// clkTck is the kernel's clock tick rate for /proc/<pid>/stat times.
var clkTck = func() float64 {
	out, err := exec.Command("getconf", "CLK_TCK").Output()
	if err == nil {
		if v, err := strconv.Atoi(strings.TrimSpace(string(out))); err == nil && v > 0 {
			return float64(v)
		}
	}
	return 100
}()

// procStat is the part of /proc/<pid>/stat the bench uses.
type procStat struct {
	comm  string
	ppid  int
	ticks uint64 // utime + stime, all threads
}

func readProcStat(pid int) (procStat, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return procStat{}, err
	}
	s := string(b)
	open, closing := strings.IndexByte(s, '('), strings.LastIndexByte(s, ')')
	if open < 0 || closing < open {
		return procStat{}, fmt.Errorf("/proc/%d/stat: unexpected format", pid)
	}
	// Fields after ")": 3 state, 4 ppid, ... 14 utime, 15 stime.
	f := strings.Fields(s[closing+1:])
	if len(f) < 13 {
		return procStat{}, fmt.Errorf("/proc/%d/stat: too few fields", pid)
	}
	ppid, _ := strconv.Atoi(f[1])
	ut, _ := strconv.ParseUint(f[11], 10, 64)
	st, _ := strconv.ParseUint(f[12], 10, 64)
	return procStat{comm: s[open+1 : closing], ppid: ppid, ticks: ut + st}, nil
}

// cpuMS is a process's total CPU time in milliseconds (0 if it is gone).
func cpuMS(pid int) float64 {
	if pid <= 0 {
		return 0
	}
	st, err := readProcStat(pid)
	if err != nil {
		return 0
	}
	return float64(st.ticks) * 1000 / clkTck
}

// findChild returns the pid of parent's child whose comm is comm, or 0.
func findChild(parent int, comm string) int {
	ms, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/children", parent))
	for _, m := range ms {
		b, err := os.ReadFile(m)
		if err != nil {
			continue
		}
		for _, f := range strings.Fields(string(b)) {
			pid, _ := strconv.Atoi(f)
			if st, err := readProcStat(pid); err == nil && st.comm == comm {
				return pid
			}
		}
	}
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if st, err := readProcStat(pid); err == nil && st.ppid == parent && st.comm == comm {
			return pid
		}
	}
	return 0
}

// machineBusyMS is the busy CPU time of the whole machine (all CPUs) from
// the first line of /proc/stat: everything but idle and iowait.
func machineBusyMS() float64 {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 9 || f[0] != "cpu" {
		return 0
	}
	var busy uint64
	for i, v := range f[1:9] { // user nice system idle iowait irq softirq steal
		if i == 3 || i == 4 {
			continue
		}
		n, _ := strconv.ParseUint(v, 10, 64)
		busy += n
	}
	return float64(busy) * 1000 / clkTck
}

// cpuSnap is the CPU time (ms) of the gateway under test, its Envoy, the
// bench process, the bench's other (idle) gateway processes and the whole
// machine at one instant.
type cpuSnap struct{ gw, envoy, self, idle, machine float64 }

// cpuPids: the gateway under test, its Envoy child, and the processes of the
// bench's other gateway (idle during this cell; not "other processes").
type cpuPids struct {
	gw, envoy int
	idle      []int
}

func (p cpuPids) snap() cpuSnap {
	s := cpuSnap{gw: cpuMS(p.gw), envoy: cpuMS(p.envoy), self: cpuMS(os.Getpid()), machine: machineBusyMS()}
	for _, pid := range p.idle {
		s.idle += cpuMS(pid)
	}
	return s
}

func (a cpuSnap) sub(b cpuSnap) cpuSnap {
	return cpuSnap{gw: a.gw - b.gw, envoy: a.envoy - b.envoy, self: a.self - b.self, idle: a.idle - b.idle, machine: a.machine - b.machine}
}

func (a cpuSnap) add(b cpuSnap) cpuSnap {
	return cpuSnap{gw: a.gw + b.gw, envoy: a.envoy + b.envoy, self: a.self + b.self, idle: a.idle + b.idle, machine: a.machine + b.machine}
}

// others is the CPU time used by every other process on the machine.
func (a cpuSnap) others() float64 { return max(a.machine-a.gw-a.envoy-a.self-a.idle, 0) }

// waitIdle waits (at most d) until the machine's busy share stays under
// limit for three one-second samples in a row, and returns the last share.
func waitIdle(ctx context.Context, d time.Duration, limit float64, ncpu int) (float64, bool) {
	deadline := time.Now().Add(d)
	quiet, last := 0, 0.0
	lastLog := time.Now()
	for {
		before, t0 := machineBusyMS(), time.Now()
		select {
		case <-ctx.Done():
			return last, false
		case <-time.After(time.Second):
		}
		last = (machineBusyMS() - before) / (float64(time.Since(t0).Milliseconds()) * float64(ncpu))
		if last < limit {
			quiet++
			if quiet >= 3 {
				return last, true
			}
		} else {
			quiet = 0
		}
		if time.Now().After(deadline) {
			return last, false
		}
		if time.Since(lastLog) > 10*time.Second {
			logf("waiting for an idle machine: other processes use %.0f%% of the CPUs", last*100)
			lastLog = time.Now()
		}
	}
}
