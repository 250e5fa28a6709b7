package main

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/smg-project/smg-extproc/pkg/fake/vllm"
)

// TestVLLMPrefillLeg: the sanitized NIXL prefill leg of a streaming client
// body with every field vLLM's prefill must not see.
func TestVLLMPrefillLeg(t *testing.T) {
	body := []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":9,"max_tokens":7,"stream":true,"stream_options":{"include_usage":true},"min_tokens":2,"min_completion_tokens":2,"n":1}`)
	leg, err := vllmPrefillLeg(body)
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(leg, &m); err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"max_completion_tokens": "1", "stream": "false", "n": "1", "kv_transfer_params": nixlPrefillTag}
	for k, v := range want {
		if string(m[k]) != v {
			t.Errorf("%s = %s, want %s", k, m[k], v)
		}
	}
	for _, k := range []string{"max_tokens", "stream_options", "min_tokens", "min_completion_tokens"} {
		if _, ok := m[k]; ok {
			t.Errorf("%s kept: %s", k, leg)
		}
	}
	if got := string(withKV([]byte(`{"a":1}`), []byte(`{"x":2}`))); got != `{"a":1,"kv_transfer_params":{"x":2}}` {
		t.Errorf("withKV = %s", got)
	}
}

// TestDirectSeq: the direct mode's sequential handoff passes the strict fake
// vLLM NIXL engines (the decode answers X-Fake-KV: transferred), streaming
// and not.
func TestDirectSeq(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	p, err := startVLLMFake(ctx, vllm.Producer)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	d, err := startVLLMFake(ctx, vllm.Consumer)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	tg := &target{client: newHTTPClient(), prefill: p.URL(), decode: d.URL()}
	for _, w := range []*workload{
		vllmWorkload(chatBody(1024, 8, false), false, 0),
		vllmWorkload(chatBody(1024, 64, true), true, 64),
	} {
		for range 3 {
			rctx, rcancel := context.WithTimeout(ctx, 10*time.Second)
			s, err := tg.directSeq(rctx, w)
			rcancel()
			if err != nil {
				t.Fatalf("stream=%v: %v", w.stream, err)
			}
			if w.stream && s.ttfb <= 0 {
				t.Errorf("stream without a first-byte time")
			}
		}
	}
}
