package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// workload is one client request shape.
type workload struct {
	path   string
	body   []byte // the client's JSON object, ending in '}'
	stream bool
	tokens int // max_tokens: an SSE answer has at least this many data events before [DONE]
	// prefillLeg (vLLM cells) is the sanitized one-token NIXL prefill leg of
	// body, built once: the direct mode is a zero-cost gateway.
	prefillLeg []byte
}

// sample is one successful request.
type sample struct {
	total time.Duration // start to the last byte of the (decode) response
	ttfb  time.Duration // start to the first SSE data event (streams only)
	// phases (ext_proc only mode): request headers round trip, request body
	// round trip, decode leg to its response head, response headers round trip.
	phases [nPhases]time.Duration
}

const nPhases = 4

var phaseNames = [nPhases]string{"request headers round trip", "request body round trip (parse, pick, mint, edit, start prefill)",
	"decode leg to its response head", "response headers round trip (waits for the prefill body)"}

// vllmPhaseNames: on the sequential path the request body round trip holds
// the whole prefill leg.
var vllmPhaseNames = [nPhases]string{"request headers round trip", "request body round trip (parse, pick, prefill leg to its answer, relay the handoff)",
	"decode leg to its response head", "response headers round trip"}

// target is what the bench talks to.
type target struct {
	client   *http.Client
	prefill  string // base URLs
	decode   string
	bootPort int
	gateway  string
	ep       *extprocClient // nil unless the ext_proc-only mode runs
}

func newHTTPClient() *http.Client {
	return &http.Client{Transport: &http.Transport{
		Proxy:               nil,
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:        2048,
		MaxIdleConnsPerHost: 512,
		IdleConnTimeout:     120 * time.Second,
		DisableCompression:  true,
		ForceAttemptHTTP2:   false,
		WriteBufferSize:     64 << 10,
		ReadBufferSize:      64 << 10,
	}}
}

// withBootstrap is the ideal gateway's body edit: the client's object plus
// the three SGLang handoff keys appended before its closing brace.
func withBootstrap(body []byte, port int, room uint64) []byte {
	end := bytes.LastIndexByte(body, '}')
	out := make([]byte, 0, len(body)+96)
	out = append(out, body[:end]...)
	out = append(out, `,"bootstrap_host":"127.0.0.1","bootstrap_port":`...)
	out = strconv.AppendInt(out, int64(port), 10)
	out = append(out, `,"bootstrap_room":`...)
	out = strconv.AppendUint(out, room, 10)
	return append(out, '}')
}

func newPost(ctx context.Context, url string, body []byte) (*http.Request, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	return req, nil
}

// direct does what a zero-cost gateway would: mint a room, add the bootstrap
// keys, send both legs at once, drain the prefill, read the decode.
func (t *target) direct(ctx context.Context, w *workload) (sample, error) {
	start := time.Now()
	room := rand.Uint64N(math.MaxInt64) + 1 // [1, 2^63-1]
	body := withBootstrap(w.body, t.bootPort, room)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	perr := make(chan error, 1)
	go func() { perr <- t.drainPrefill(ctx, w.path, body) }()
	s, err := t.postAndRead(ctx, t.decode+w.path, body, w, start)
	if err != nil {
		cancel() // the prefill would otherwise wait for its decode until the bootstrap timeout
		<-perr
		return s, fmt.Errorf("decode: %w", err)
	}
	if err := <-perr; err != nil {
		return s, fmt.Errorf("prefill: %w", err)
	}
	return s, nil
}

func (t *target) drainPrefill(ctx context.Context, path string, body []byte) error {
	req, err := newPost(ctx, t.prefill+path, body)
	if err != nil {
		return err
	}
	resp, err := t.client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 300))
		return fmt.Errorf("status %d: %s", resp.StatusCode, b)
	}
	_, err = io.Copy(io.Discard, resp.Body)
	return err
}

// nixlPrefillTag is the kv_transfer_params of a NIXL prefill leg.
const nixlPrefillTag = `{"do_remote_decode":true,"do_remote_prefill":false}`

// vllmPrefillLeg sanitizes a client body into vLLM's NIXL prefill leg: one
// output token (max_completion_tokens:1 when the client set it, else
// max_tokens:1), stream:false, no stream_options / min_tokens /
// min_completion_tokens, an existing n set to 1, and the NIXL tag.
func vllmPrefillLeg(body []byte) ([]byte, error) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(body, &m); err != nil {
		return nil, err
	}
	one := json.RawMessage("1")
	m["stream"] = json.RawMessage("false")
	for _, k := range []string{"stream_options", "min_tokens", "min_completion_tokens"} {
		delete(m, k)
	}
	if _, ok := m["n"]; ok {
		m["n"] = one
	}
	if _, ok := m["max_completion_tokens"]; ok {
		m["max_completion_tokens"] = one
		delete(m, "max_tokens")
	} else {
		m["max_tokens"] = one
	}
	m["kv_transfer_params"] = json.RawMessage(nixlPrefillTag)
	return json.Marshal(m)
}

// withKV is the decode leg: the client's object plus kv_transfer_params
// (the prefill's bytes, verbatim) before its closing brace.
func withKV(body, kv []byte) []byte {
	end := bytes.LastIndexByte(body, '}')
	out := make([]byte, 0, len(body)+len(kv)+24)
	out = append(out, body[:end]...)
	out = append(out, `,"kv_transfer_params":`...)
	out = append(out, kv...)
	return append(out, '}')
}

// directSeq does vLLM's sequential NIXL handoff itself, as a zero-cost
// gateway would: POST the one-token prefill leg, take the top-level
// kv_transfer_params of its JSON answer, POST the client's body plus those
// params to the decode and read the decode answer. Latency covers both legs.
func (t *target) directSeq(ctx context.Context, w *workload) (sample, error) {
	start := time.Now()
	kv, err := t.prefillHandoff(ctx, w)
	if err != nil {
		return sample{}, fmt.Errorf("prefill: %w", err)
	}
	s, err := t.postAndRead(ctx, t.decode+w.path, withKV(w.body, kv), w, start)
	if err != nil {
		return s, fmt.Errorf("decode: %w", err)
	}
	return s, nil
}

// prefillHandoff sends the prefill leg and returns the raw bytes of the
// answer's top-level kv_transfer_params object.
func (t *target) prefillHandoff(ctx context.Context, w *workload) ([]byte, error) {
	req, err := newPost(ctx, t.prefill+w.path, w.prefillLeg)
	if err != nil {
		return nil, err
	}
	resp, err := t.client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("status %d: %.300s", resp.StatusCode, b)
	}
	var out struct {
		KV json.RawMessage `json:"kv_transfer_params"`
	}
	if err := json.Unmarshal(b, &out); err != nil {
		return nil, fmt.Errorf("answer is not JSON: %v: %.200s", err, b)
	}
	if len(out.KV) == 0 || out.KV[0] != '{' {
		return nil, fmt.Errorf("no kv_transfer_params handoff in the answer: %.300s", b)
	}
	return out.KV, nil
}

// viaGateway sends the client's body to Envoy.
func (t *target) viaGateway(ctx context.Context, w *workload) (sample, error) {
	return t.postAndRead(ctx, t.gateway+w.path, w.body, w, time.Now())
}

func (t *target) postAndRead(ctx context.Context, url string, body []byte, w *workload, start time.Time) (sample, error) {
	req, err := newPost(ctx, url, body)
	if err != nil {
		return sample{}, err
	}
	resp, err := t.client.Do(req)
	if err != nil {
		return sample{}, err
	}
	defer resp.Body.Close()
	return readAnswer(resp, w, start)
}

// readAnswer validates and times a decode answer: 200, the PD handoff really
// happened (X-Fake-KV: transferred), and a JSON document or a complete SSE stream.
func readAnswer(resp *http.Response, w *workload, start time.Time) (sample, error) {
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 300))
		return sample{}, fmt.Errorf("status %d: %s", resp.StatusCode, b)
	}
	if kv := resp.Header.Get("X-Fake-KV"); kv != "transferred" {
		return sample{}, fmt.Errorf("X-Fake-KV %q, want transferred", kv)
	}
	if !w.stream {
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			return sample{}, err
		}
		s := sample{total: time.Since(start)}
		if !json.Valid(b) || !bytes.Contains(b, []byte(`"choices"`)) {
			return s, fmt.Errorf("not a chat completion: %.200s", b)
		}
		return s, nil
	}
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/event-stream") {
		return sample{}, fmt.Errorf("content-type %q, want text/event-stream", ct)
	}
	var s sample
	r := bufio.NewReaderSize(resp.Body, 32<<10)
	events, done := 0, false
	for {
		line, err := r.ReadSlice('\n')
		if bytes.HasPrefix(line, []byte("data:")) {
			if events == 0 {
				s.ttfb = time.Since(start)
			}
			events++
			if bytes.Equal(bytes.TrimSpace(line), []byte("data: [DONE]")) {
				done = true
			}
		}
		if errors.Is(err, bufio.ErrBufferFull) {
			continue
		}
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return s, err
		}
	}
	s.total = time.Since(start)
	if !done {
		return s, fmt.Errorf("stream ended without [DONE] after %d events", events)
	}
	if events-1 < w.tokens {
		return s, fmt.Errorf("stream had %d data events, want at least %d", events-1, w.tokens)
	}
	return s, nil
}

// reqFunc is one request in one mode.
type reqFunc func(context.Context, *workload) (sample, error)

// batch is the outcome of running requests in one mode.
type batch struct {
	samples  []sample
	errs     int
	firstErr string
	wall     time.Duration
	cpu      cpuSnap
}

func (b *batch) merge(o *batch) {
	b.samples = append(b.samples, o.samples...)
	if b.firstErr == "" {
		b.firstErr = o.firstErr
	}
	b.errs += o.errs
	b.wall += o.wall
	b.cpu = b.cpu.add(o.cpu)
}

// runClosed runs count requests (or until deadline) with conc workers, each
// sending its next request as soon as the previous one completes.
func runClosed(ctx context.Context, fn reqFunc, w *workload, conc, count int, deadline time.Time, pids cpuPids) *batch {
	var next atomic.Int64
	var mu sync.Mutex
	out := &batch{}
	var wg sync.WaitGroup
	before := pids.snap()
	start := time.Now()
	for range conc {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var local []sample
			var errs int
			var first string
			for ctx.Err() == nil && int(next.Add(1)) <= count && time.Now().Before(deadline) {
				rctx, cancel := context.WithTimeout(ctx, 60*time.Second)
				s, err := fn(rctx, w)
				cancel()
				if err != nil {
					if ctx.Err() != nil {
						break
					}
					errs++
					if first == "" {
						first = err.Error()
					}
					continue
				}
				local = append(local, s)
			}
			mu.Lock()
			out.samples = append(out.samples, local...)
			out.errs += errs
			if out.firstErr == "" {
				out.firstErr = first
			}
			mu.Unlock()
		}()
	}
	wg.Wait()
	out.wall = time.Since(start)
	out.cpu = pids.snap().sub(before)
	return out
}
