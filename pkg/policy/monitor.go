package policy

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/smg-project/smg-extproc/pkg/workers"
)

// maxLoadBody bounds a load or metrics response the monitor reads.
const maxLoadBody = 4 << 20

// EngineLoadMonitor polls every worker's load endpoint each interval and
// serves the latest reports as a LoadSource:
//
//   - SGLang: GET /v1/loads, falling back to the legacy GET /get_load. Both
//     the newer object shape {"loads":[{dp_rank, num_running_reqs,
//     num_waiting_reqs, num_waiting_uncached_tokens, token_usage,
//     gen_throughput, ...}]} and the legacy per-rank list [{dp_rank,
//     num_reqs, num_waiting_reqs, num_tokens, num_pending_tokens}] are read.
//   - vLLM: GET /metrics (Prometheus text): vllm:num_requests_waiting,
//     vllm:num_requests_running and vllm:kv_cache_usage_perc (or the older
//     vllm:gpu_cache_usage_perc), summed (usage averaged) over series.
//
// A worker whose poll fails has no report until a later poll succeeds, so
// policies score it from the gateway's in-flight count meanwhile. A worker
// registered with an "@rank" suffix reads its own rank's entry.
type EngineLoadMonitor struct {
	client   *http.Client
	interval time.Duration

	snap  atomic.Pointer[map[*workers.Worker]EngineLoad]
	epoch atomic.Uint64
}

// NewEngineLoadMonitor returns a monitor polling every interval (SMG's
// --load-monitor-interval; ≤0 means 10 s) with client (nil means a client
// with a timeout of the interval).
func NewEngineLoadMonitor(client *http.Client, interval time.Duration) *EngineLoadMonitor {
	if interval <= 0 {
		interval = 10 * time.Second
	}
	if client == nil {
		client = &http.Client{Timeout: interval}
	}
	return &EngineLoadMonitor{client: client, interval: interval}
}

// EngineLoad implements LoadSource. A nil monitor knows nothing, so a typed
// nil in Deps.Loads is harmless.
func (m *EngineLoadMonitor) EngineLoad(w *workers.Worker) (EngineLoad, bool) {
	if m == nil {
		return EngineLoad{}, false
	}
	p := m.snap.Load()
	if p == nil {
		return EngineLoad{}, false
	}
	l, ok := (*p)[w]
	return l, ok
}

// Run polls list() now and then every interval until ctx is done.
func (m *EngineLoadMonitor) Run(ctx context.Context, list func() []*workers.Worker) {
	t := time.NewTicker(m.interval)
	defer t.Stop()
	for {
		m.Poll(ctx, list())
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// Poll polls ws once, in parallel, and publishes the results as one snapshot
// replacing the previous one (unless ctx ended meanwhile). Each request is
// bounded by the interval.
func (m *EngineLoadMonitor) Poll(parent context.Context, ws []*workers.Worker) {
	ctx, cancel := context.WithTimeout(parent, m.interval)
	defer cancel()
	epoch := m.epoch.Add(1)

	// DP ranks of one engine share a base URL: fetch it once.
	type job struct {
		runtime, base, apiKey string
		ranks                 []rankLoad
		err                   error
	}
	jobs := map[string]*job{}
	for _, w := range ws {
		if _, ok := jobs[w.BaseURL]; !ok {
			jobs[w.BaseURL] = &job{runtime: w.Runtime, base: w.BaseURL, apiKey: w.APIKey}
		}
	}
	var wg sync.WaitGroup
	for _, j := range jobs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			j.ranks, j.err = m.fetch(ctx, j.runtime, j.base, j.apiKey)
		}()
	}
	wg.Wait()
	if parent.Err() != nil {
		return // shutting down: keep the last complete snapshot
	}

	out := make(map[*workers.Worker]EngineLoad, len(ws))
	for _, w := range ws {
		j := jobs[w.BaseURL]
		if j.err != nil || len(j.ranks) == 0 {
			continue
		}
		l, ok := aggregate(j.ranks, w.DPRank)
		if !ok {
			continue
		}
		l.Epoch = epoch
		out[w] = l
	}
	m.snap.Store(&out)
}

// rankLoad is one DP rank's report (rank -1 when the source has no ranks).
type rankLoad struct {
	rank int
	l    EngineLoad
	kvN  int // series averaged into l.KVUsage (vLLM)
}

// aggregate sums ranks (KV usage averaged), or picks one rank.
func aggregate(ranks []rankLoad, rank *int) (EngineLoad, bool) {
	if rank != nil {
		for _, r := range ranks {
			if r.rank == *rank {
				return r.l, true
			}
		}
		if len(ranks) != 1 || ranks[0].rank >= 0 {
			return EngineLoad{}, false
		}
	}
	var out EngineLoad
	for _, r := range ranks {
		out.QueuedTokens += r.l.QueuedTokens
		out.WaitingRequests += r.l.WaitingRequests
		out.RunningRequests += r.l.RunningRequests
		out.Throughput += r.l.Throughput
		out.KVUsage += r.l.KVUsage
	}
	out.KVUsage /= float64(len(ranks))
	return out, true
}

func (m *EngineLoadMonitor) fetch(ctx context.Context, runtime, base, apiKey string) ([]rankLoad, error) {
	if runtime == "vllm" {
		body, err := m.get(ctx, base+"/metrics", apiKey)
		if err != nil {
			return nil, err
		}
		return parseVLLMMetrics(body)
	}
	body, err := m.get(ctx, base+"/v1/loads", apiKey)
	if errors.Is(err, errNotFound) {
		body, err = m.get(ctx, base+"/get_load", apiKey)
	}
	if err != nil {
		return nil, err
	}
	return parseSGLangLoads(body)
}

var errNotFound = errors.New("not found")

func (m *EngineLoadMonitor) get(ctx context.Context, url, apiKey string) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	if apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+apiKey)
	}
	resp, err := m.client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxLoadBody))
	if err != nil {
		return nil, err
	}
	switch {
	case resp.StatusCode == http.StatusNotFound:
		return nil, errNotFound
	case resp.StatusCode/100 != 2:
		return nil, fmt.Errorf("GET %s: status %d", url, resp.StatusCode)
	}
	return body, nil
}

// parseSGLangLoads reads /v1/loads or /get_load, new or legacy shape.
func parseSGLangLoads(body []byte) ([]rankLoad, error) {
	type snapshot struct {
		DPRank *int `json:"dp_rank"`
		// Newer fields.
		NumRunningReqs           *float64 `json:"num_running_reqs"`
		NumWaitingReqs           float64  `json:"num_waiting_reqs"`
		NumWaitingUncachedTokens float64  `json:"num_waiting_uncached_tokens"`
		TokenUsage               float64  `json:"token_usage"`
		GenThroughput            float64  `json:"gen_throughput"`
		// Legacy fields.
		NumReqs          *float64 `json:"num_reqs"`
		NumPendingTokens float64  `json:"num_pending_tokens"`
	}
	var list []snapshot
	body = bytes.TrimSpace(body)
	switch {
	case len(body) > 0 && body[0] == '[':
		if err := json.Unmarshal(body, &list); err != nil {
			return nil, fmt.Errorf("load list: %w", err)
		}
	case len(body) > 0 && body[0] == '{':
		var obj struct {
			Loads []snapshot `json:"loads"`
		}
		if err := json.Unmarshal(body, &obj); err != nil {
			return nil, fmt.Errorf("load object: %w", err)
		}
		list = obj.Loads
	default:
		return nil, fmt.Errorf("load response is neither a list nor an object")
	}
	out := make([]rankLoad, 0, len(list))
	for i, s := range list {
		r := rankLoad{rank: i}
		if s.DPRank != nil {
			r.rank = *s.DPRank
		}
		r.l.WaitingRequests = int64(s.NumWaitingReqs)
		r.l.QueuedTokens = s.NumWaitingUncachedTokens
		if r.l.QueuedTokens == 0 {
			r.l.QueuedTokens = s.NumPendingTokens
		}
		switch {
		case s.NumRunningReqs != nil:
			r.l.RunningRequests = int64(*s.NumRunningReqs)
		case s.NumReqs != nil:
			r.l.RunningRequests = int64(*s.NumReqs)
		}
		r.l.KVUsage = s.TokenUsage
		r.l.Throughput = s.GenThroughput
		out = append(out, r)
	}
	return out, nil
}

// parseVLLMMetrics reads the vLLM gauges from Prometheus text format. Series
// carrying an engine="N" label are kept per rank N; others sum into rank -1.
func parseVLLMMetrics(body []byte) ([]rankLoad, error) {
	ranks := map[int]*rankLoad{}
	get := func(rank int) *rankLoad {
		r := ranks[rank]
		if r == nil {
			r = &rankLoad{rank: rank}
			ranks[rank] = r
		}
		return r
	}
	var newKV bool // kv_cache_usage_perc seen: ignore the deprecated gauge
	found := false
	sc := bufio.NewScanner(bytes.NewReader(body))
	sc.Buffer(make([]byte, 0, 64<<10), maxLoadBody)
	type sample struct {
		name  string
		rank  int
		value float64
	}
	var samples []sample
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || line[0] == '#' || !strings.HasPrefix(line, "vllm:") {
			continue
		}
		name, labels, value, ok := parsePromLine(line)
		if !ok {
			continue
		}
		switch name {
		case "vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:gpu_cache_usage_perc":
		case "vllm:kv_cache_usage_perc":
			newKV = true
		default:
			continue
		}
		rank := -1
		if e, ok := promLabel(labels, "engine"); ok {
			if n, err := strconv.Atoi(e); err == nil {
				rank = n
			}
		}
		samples = append(samples, sample{name, rank, value})
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	for _, s := range samples {
		r := get(s.rank)
		switch s.name {
		case "vllm:num_requests_waiting":
			r.l.WaitingRequests += int64(s.value)
		case "vllm:num_requests_running":
			r.l.RunningRequests += int64(s.value)
		case "vllm:kv_cache_usage_perc":
			r.l.KVUsage += s.value
			r.kvN++
		case "vllm:gpu_cache_usage_perc":
			if newKV {
				continue
			}
			r.l.KVUsage += s.value
			r.kvN++
		}
		found = true
	}
	if !found {
		return nil, fmt.Errorf("no vllm load gauges in /metrics")
	}
	out := make([]rankLoad, 0, len(ranks))
	for _, r := range ranks {
		if r.kvN > 1 {
			r.l.KVUsage /= float64(r.kvN)
		}
		out = append(out, *r)
	}
	return out, nil
}

// parsePromLine splits `name{labels} value [timestamp]`.
func parsePromLine(line string) (name, labels string, value float64, ok bool) {
	rest := line
	if i := strings.IndexByte(line, '{'); i >= 0 {
		j := strings.LastIndexByte(line, '}')
		if j < i {
			return "", "", 0, false
		}
		name, labels, rest = line[:i], line[i+1:j], line[j+1:]
	} else {
		i := strings.IndexAny(line, " \t")
		if i < 0 {
			return "", "", 0, false
		}
		name, rest = line[:i], line[i:]
	}
	fields := strings.Fields(rest)
	if len(fields) == 0 {
		return "", "", 0, false
	}
	v, err := strconv.ParseFloat(fields[0], 64)
	if err != nil {
		return "", "", 0, false
	}
	return strings.TrimSpace(name), labels, v, true
}

// promLabel finds key="value" in a label list (escapes are not expected in
// the labels read here).
func promLabel(labels, key string) (string, bool) {
	for len(labels) > 0 {
		eq := strings.IndexByte(labels, '=')
		if eq < 0 || eq+1 >= len(labels) || labels[eq+1] != '"' {
			return "", false
		}
		k := strings.TrimSpace(strings.TrimLeft(labels[:eq], ","))
		rest := labels[eq+2:]
		end := strings.IndexByte(rest, '"')
		if end < 0 {
			return "", false
		}
		if k == key {
			return rest[:end], true
		}
		labels = strings.TrimLeft(rest[end+1:], ", ")
	}
	return "", false
}
