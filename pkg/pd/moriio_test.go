package pd

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/smg-project/smg-extproc/pkg/apierr"
)

func moriioWorker(host string, labels ...string) VLLMWorker {
	w := VLLMWorker{URL: "http://" + host + ":8000", KVConnector: MoRIIOConnector, BootstrapHost: host, Labels: map[string]string{}}
	for i := 0; i+1 < len(labels); i += 2 {
		w.Labels[labels[i]] = labels[i+1]
	}
	return w
}

func requireAPIErr(t *testing.T, err error, status int, code string) *apierr.Error {
	t.Helper()
	var ae *apierr.Error
	require.True(t, errors.As(err, &ae), "want *apierr.Error, got %v", err)
	assert.Equal(t, status, ae.Status)
	assert.Equal(t, code, ae.Code)
	return ae
}

func TestParseMoRIIOEndpoint(t *testing.T) {
	cases := []struct {
		name string
		w    VLLMWorker
		want MoRIIOEndpoint
	}{
		{"defaults: URL host and vLLM ports", moriioWorker("10.0.0.7", "moriio_mode", "WRITE"),
			MoRIIOEndpoint{Mode: MoRIIOWrite, Host: "10.0.0.7", HandshakePort: 6301, NotifyPort: 61005, DPSize: 1}},
		{"every label", moriioWorker("decode", "moriio_mode", " Read ", "moriio_host", "10.1.1.1", "moriio_handshake_port", "7301",
			"moriio_notify_port", "62005", "tp_size", "4", "moriio_write_dispatch", "Concurrent", "dp_size", "1"),
			MoRIIOEndpoint{Mode: MoRIIORead, Host: "10.1.1.1", HandshakePort: 7301, NotifyPort: 62005, TPSize: 4, DPSize: 1, Concurrent: true}},
		{"empty labels are unset", moriioWorker("[fd00::1]", "moriio_mode", "write", "moriio_host", " ", "moriio_write_dispatch", "", "tp_size", ""),
			MoRIIOEndpoint{Mode: MoRIIOWrite, Host: "[fd00::1]", HandshakePort: 6301, NotifyPort: 61005, DPSize: 1}},
		{"sequential dispatch", moriioWorker("d", "moriio_mode", "write", "moriio_write_dispatch", "SEQUENTIAL"),
			MoRIIOEndpoint{Mode: MoRIIOWrite, Host: "d", HandshakePort: 6301, NotifyPort: 61005, DPSize: 1}},
	}
	for _, c := range cases {
		got, err := ParseMoRIIOEndpoint(c.w)
		require.NoError(t, err, c.name)
		assert.Equal(t, c.want, got, c.name)
	}

	dp1, dp2, rank := intp(1), intp(2), intp(0)
	refused := []struct {
		name string
		w    VLLMWorker
	}{
		{"not MoRI-IO", VLLMWorker{KVConnector: NixlConnector, BootstrapHost: "h", Labels: map[string]string{"moriio_mode": "read"}}},
		{"missing mode", moriioWorker("h")},
		{"bad mode", moriioWorker("h", "moriio_mode", "both")},
		{"handshake port 0", moriioWorker("h", "moriio_mode", "read", "moriio_handshake_port", "0")},
		{"notify port not numeric", moriioWorker("h", "moriio_mode", "read", "moriio_notify_port", "abc")},
		{"notify port too large", moriioWorker("h", "moriio_mode", "read", "moriio_notify_port", "70000")},
		{"negative port", moriioWorker("h", "moriio_mode", "read", "moriio_handshake_port", "-1")},
		{"tp 0", moriioWorker("h", "moriio_mode", "read", "tp_size", "0")},
		{"tp not numeric", moriioWorker("h", "moriio_mode", "read", "tp_size", "two")},
		{"bad dispatch", moriioWorker("h", "moriio_mode", "write", "moriio_write_dispatch", "parallel")},
		{"bad dispatch on a READ worker", moriioWorker("h", "moriio_mode", "read", "moriio_write_dispatch", "x")},
		{"dp label > 1", moriioWorker("h", "moriio_mode", "read", "dp_size", "8")},
		{"dp label 0", moriioWorker("h", "moriio_mode", "read", "dp_size", "0")},
		{"dp label invalid", moriioWorker("h", "moriio_mode", "read", "dp_size", "one")},
		{"worker dp > 1", func() VLLMWorker { w := moriioWorker("h", "moriio_mode", "read"); w.DPSize = dp2; return w }()},
		{"per-rank worker", func() VLLMWorker {
			w := moriioWorker("h", "moriio_mode", "read")
			w.DPSize, w.DPRank = dp1, rank
			return w
		}()},
		{"no host", moriioWorker("", "moriio_mode", "read")},
	}
	for _, c := range refused {
		_, err := ParseMoRIIOEndpoint(c.w)
		assert.Error(t, err, c.name)
	}
}

func TestResolveMoRIIOPair(t *testing.T) {
	w := func(host string, hs, np string, extra ...string) VLLMWorker {
		return moriioWorker(host, append([]string{"moriio_mode", "write", "moriio_handshake_port", hs, "moriio_notify_port", np}, extra...)...)
	}
	conc := []string{"moriio_write_dispatch", "concurrent"}
	remote := w("10.0.0.1", "6301", "61005")
	cases := []struct {
		name       string
		p, d       VLLMWorker
		refused    bool
		concurrent bool
	}{
		{"distinct hosts", remote, w("10.0.0.2", "6301", "61005"), false, false},
		{"loopback decode", remote, w("127.0.0.1", "6301", "61005"), true, false},
		{"localhost decode", remote, w("LocalHost", "7301", "62005"), true, false},
		{"IPv6 loopback decode", remote, w("[::1]", "7301", "62005"), true, false},
		{"unspecified decode", remote, w("0.0.0.0", "7301", "62005"), true, false},
		{"IPv6 unspecified decode", remote, w("[::]", "7301", "62005"), true, false},
		{"same host, same handshake port", remote, w("10.0.0.1", "6301", "62005"), true, false},
		{"same host, same notify port", remote, w("10.0.0.1", "7301", "61005"), true, false},
		{"same host, distinct ports", remote, w("10.0.0.1", "7301", "62005"), false, false},
		{"both local, distinct ports", w("localhost", "6301", "61005"), w("127.0.0.1", "7301", "62005"), false, false},
		{"both local, shared handshake port", w("localhost", "6301", "61005"), w("127.0.0.1", "6301", "62005"), true, false},
		{"local prefill, sequential", w("127.0.0.1", "6301", "61005"), w("10.0.0.2", "6301", "61005"), false, false},
		{"local prefill, concurrent", w("127.0.0.1", "6301", "61005"), w("10.0.0.2", "6301", "61005", conc...), true, false},
		{"unspecified prefill, concurrent", w("0.0.0.0", "6301", "61005"), w("10.0.0.2", "6301", "61005", conc...), true, false},
		{"unspecified prefill, sequential", w("0.0.0.0", "6301", "61005"), w("10.0.0.2", "6301", "61005"), false, false},
		{"concurrent on the decode", remote, w("10.0.0.2", "6301", "61005", conc...), false, true},
		{"concurrent on the prefill only is ignored", w("10.0.0.2", "6301", "61005", conc...), remote, false, false},
		{"READ skips the reachability rules", moriioWorker("10.0.0.1", "moriio_mode", "read"),
			moriioWorker("127.0.0.1", "moriio_mode", "read", "moriio_write_dispatch", "concurrent"), false, false},
		{"mode mismatch (item 77)", moriioWorker("a", "moriio_mode", "read"), moriioWorker("b", "moriio_mode", "write"), true, false},
		{"missing mode on decode (item 77)", moriioWorker("a", "moriio_mode", "read"), moriioWorker("b"), true, false},
		{"bad dispatch on the prefill", w("10.0.0.2", "6301", "61005", "moriio_write_dispatch", "later"), remote, true, false},
		{"non-MoRI-IO prefill", VLLMWorker{KVConnector: NixlConnector}, remote, true, false},
		{"non-MoRI-IO decode", remote, VLLMWorker{KVConnector: MooncakeConnector}, true, false},
	}
	for _, c := range cases {
		pair, err := ResolveMoRIIOPair(c.p, c.d)
		if !c.refused {
			require.NoError(t, err, c.name)
			assert.Equal(t, c.concurrent, pair.Concurrent, c.name)
			continue
		}
		ae := requireAPIErr(t, err, 503, CodeMoRIIOPairMisconfigured)
		assert.Error(t, ae.Cause, c.name)
		assert.NotContains(t, ae.Message, "10.0.0", "the reason stays in the log")
	}
}

func TestMoRIIORequestRefusals(t *testing.T) {
	p, d := moriioWorker("10.0.0.1", "moriio_mode", "write"), moriioWorker("10.0.0.2", "moriio_mode", "write")
	const msgs = `"messages":[{"role":"user","content":"hi"}]`
	cases := []struct {
		name, path, body string
		xRequestIDs      []string
		pair             [2]VLLMWorker
		status           int
		code             string
	}{
		{name: "messages route (item 74)", path: "/v1/messages", body: `{` + msgs + `,"max_tokens":5}`, status: 501, code: CodeMoRIIORouteUnsupported},
		{name: "responses route", path: "/v1/responses", body: `{"input":"x"}`, status: 501, code: CodeMoRIIORouteUnsupported},
		{name: "generate route", path: "/generate", body: `{"text":"x"}`, status: 501, code: CodeMoRIIORouteUnsupported},
		{name: "route before a misconfigured pair", path: "/v1/rerank", body: `{"query":"x"}`, pair: [2]VLLMWorker{p, {}}, status: 501, code: CodeMoRIIORouteUnsupported},
		{name: "n 2 (item 75)", path: "/v1/chat/completions", body: `{` + msgs + `,"n":2}`, status: 400, code: CodeMoRIIOFanoutUnsupported},
		{name: "completions n 4", path: "/v1/completions", body: `{"prompt":"a","n":4}`, status: 400, code: CodeMoRIIOFanoutUnsupported},
		{name: "batched prompt", path: "/v1/completions", body: `{"prompt":["a","b"]}`, status: 400, code: CodeMoRIIOFanoutUnsupported},
		{name: "batched token prompts", path: "/v1/completions", body: `{"prompt":[[1],[2]]}`, status: 400, code: CodeMoRIIOFanoutUnsupported},
		{name: "batched prompt_embeds", path: "/v1/completions", body: `{"prompt_embeds":["AA==","AA=="]}`, status: 400, code: CodeMoRIIOFanoutUnsupported},
		{name: "beam search", path: "/v1/completions", body: `{"prompt":"a","use_beam_search":true}`, status: 400, code: CodeMoRIIOFanoutUnsupported},
		{name: "fanout before a misconfigured pair", path: "/v1/completions", body: `{"prompt":"a","n":2}`, pair: [2]VLLMWorker{p, {}}, status: 400, code: CodeMoRIIOFanoutUnsupported},
		{name: "X-Request-Id prefill marker (item 76)", path: "/v1/chat/completions", body: `{` + msgs + `}`,
			xRequestIDs: []string{"ok", "___prefill_addr_x"}, status: 400, code: CodeMoRIIORequestIDReserved},
		{name: "X-Request-Id decode marker", path: "/v1/completions", body: `{"prompt":"a"}`,
			xRequestIDs: []string{"a___decode_addr_b"}, status: 400, code: CodeMoRIIORequestIDReserved},
		{name: "body request_id marker", path: "/v1/completions", body: `{"prompt":"a","request_id":"r___decode_addr_1"}`, status: 400, code: CodeMoRIIORequestIDReserved},
		{name: "escaped body request_id marker", path: "/v1/completions", body: `{"prompt":"a","request_id":"\u005f__prefill_addr_1"}`, status: 400, code: CodeMoRIIORequestIDReserved},
		{name: "mode mismatch (item 77)", path: "/v1/completions", body: `{"prompt":"a"}`,
			pair: [2]VLLMWorker{moriioWorker("a", "moriio_mode", "read"), d}, status: 503, code: CodeMoRIIOPairMisconfigured},
		{name: "missing mode (item 77)", path: "/v1/completions", body: `{"prompt":"a"}`,
			pair: [2]VLLMWorker{moriioWorker("a"), d}, status: 503, code: CodeMoRIIOPairMisconfigured},
		{name: "MoRI-IO decode with a NIXL prefill", path: "/v1/completions", body: `{"prompt":"a"}`,
			pair: [2]VLLMWorker{nixlWorker(), d}, status: 503, code: CodeMoRIIOPairMisconfigured},
		// Accepted.
		{name: "n 1", path: "/v1/chat/completions", body: `{` + msgs + `,"n":1}`},
		{name: "one prompt in a list", path: "/v1/completions", body: `{"prompt":["a"]}`},
		{name: "token prompt", path: "/v1/completions", body: `{"prompt":[1,2,3]}`},
		{name: "one prompt_embeds", path: "/v1/completions", body: `{"prompt":"a","prompt_embeds":"AA=="}`},
		{name: "beam search off", path: "/v1/completions", body: `{"prompt":"a","use_beam_search":false}`},
		{name: "prompt list on chat is not a completions prompt", path: "/v1/chat/completions", body: `{` + msgs + `,"prompt":["a","b"]}`},
		{name: "harmless ids", path: "/v1/completions", body: `{"prompt":"a","request_id":"___prefill_add"}`, xRequestIDs: []string{"req-1"}},
		{name: "non-string request_id", path: "/v1/completions", body: `{"prompt":"a","request_id":7}`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			pair := c.pair
			if pair[0].KVConnector == "" && pair[1].KVConnector == "" {
				pair = [2]VLLMWorker{p, d}
			} else if pair[1].KVConnector == "" {
				pair[1] = VLLMWorker{KVConnector: MoRIIOConnector} // decode decides the path
			}
			req := mustRequest(t, c.path, c.body)
			plan, err := BuildVLLMLegs(req, VLLMAttempt{Prefill: pair[0], Decode: pair[1], TransferID: testXfer, XRequestIDs: c.xRequestIDs})
			if c.code == "" {
				require.NoError(t, err)
				assert.Equal(t, ModeMoRIIO, plan.Mode)
				assert.NoError(t, CheckMoRIIORequest(req, c.xRequestIDs))
				return
			}
			assert.Nil(t, plan)
			requireAPIErr(t, err, c.status, c.code)
			if c.code != CodeMoRIIOPairMisconfigured {
				requireAPIErr(t, CheckMoRIIORequest(req, c.xRequestIDs), c.status, c.code)
			}
		})
	}
}

func validHandoff(extra string) string {
	h := `{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[484,485]],"remote_engine_id":"10.24.112.125:6301",` +
		`"remote_host":"10.24.112.125","remote_handshake_port":"6301","remote_notify_port":"61005","remote_dp_rank":0,` +
		`"remote_dp_rank_override":true,"remote_dp_size":1,"tp_size":1,"transfer_id":"` + testXfer + `"`
	return h + extra + `}`
}

func TestMoRIIOLegs(t *testing.T) {
	const body = `{"messages":[{"role":"user","content":"hi"}],"max_tokens":50,"stop":["\n"],"stop_token_ids":[7],"ignore_eos":false,"stream":true}`
	const prefillBase = `{"messages":[{"role":"user","content":"hi"}],"max_tokens":1,"ignore_eos":true,"stream":false,"kv_transfer_params":`
	cases := []struct {
		name         string
		p, d         VLLMWorker
		wantPrefill  string
		wantParams   string // decode params minted up front, "" none
		concurrent   bool
		handoffPorts string // handoff port override, "" = valid ones
		wantErr      bool
	}{
		{name: "WRITE sequential (item 78)",
			p: moriioWorker("10.0.0.1", "moriio_mode", "write"), d: moriioWorker("10.0.0.2", "moriio_mode", "write"),
			wantPrefill: prefillBase + `{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"transfer_id":"` + testXfer +
				`","remote_dp_size":1,"remote_host":"10.0.0.2","remote_handshake_port":6301,"remote_notify_port":61005}}`},
		{name: "READ with a decode tp_size",
			p: moriioWorker("10.0.0.1", "moriio_mode", "read", "tp_size", "2"), d: moriioWorker("10.0.0.2", "moriio_mode", "read", "tp_size", "8"),
			wantPrefill: prefillBase + `{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"transfer_id":"` + testXfer +
				`","remote_dp_size":1,"remote_tp_size":8}}`},
		{name: "WRITE concurrent mints decode params with the prefill side channel",
			p: moriioWorker("10.0.0.1", "moriio_mode", "write", "tp_size", "4"),
			d: moriioWorker("10.0.0.2", "moriio_mode", "write", "moriio_write_dispatch", "concurrent", "moriio_host", "d.svc", "moriio_notify_port", "62005"),
			wantPrefill: prefillBase + `{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"transfer_id":"` + testXfer +
				`","remote_dp_size":1,"remote_host":"d.svc","remote_handshake_port":6301,"remote_notify_port":62005}}`,
			wantParams: `{"do_remote_decode":false,"do_remote_prefill":true,"remote_engine_id":null,"remote_block_ids":null,"transfer_id":"` + testXfer +
				`","remote_dp_size":1,"remote_tp_size":4,"remote_host":"10.0.0.1","remote_handshake_port":6301,"remote_notify_port":61005}`,
			concurrent: true},
		{name: "concurrent handoff with other ports",
			p:            moriioWorker("10.0.0.1", "moriio_mode", "write"),
			d:            moriioWorker("10.0.0.2", "moriio_mode", "write", "moriio_write_dispatch", "concurrent"),
			concurrent:   true,
			handoffPorts: `"remote_handshake_port":6301,"remote_notify_port":"61006"`, wantErr: true},
		{name: "sequential handoff ports are not compared with the labels",
			p:            moriioWorker("10.0.0.1", "moriio_mode", "read", "moriio_handshake_port", "9000"),
			d:            moriioWorker("10.0.0.2", "moriio_mode", "read"),
			handoffPorts: `"remote_handshake_port":6301,"remote_notify_port":"61006"`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			plan, err := BuildVLLMLegs(mustRequest(t, "/v1/chat/completions", body), VLLMAttempt{Prefill: c.p, Decode: c.d, TransferID: testXfer})
			require.NoError(t, err)
			assert.Equal(t, ModeMoRIIO, plan.Mode)
			assert.Equal(t, HandoffMoRIIO, plan.Handoff)
			assert.Equal(t, c.concurrent, plan.Concurrent)
			assert.Equal(t, testXfer, plan.TransferID)
			require.NotNil(t, plan.MoRIIO)
			if c.wantPrefill != "" {
				assert.Equal(t, c.wantPrefill, string(plan.Prefill))
			}
			if c.wantParams != "" {
				assert.Equal(t, c.wantParams, string(plan.DecodeParams))
			}
			wantDecode := body
			if c.concurrent {
				wantDecode = strings.TrimSuffix(body, "}") + `,"kv_transfer_params":` + string(plan.DecodeParams) + `}`
			} else {
				assert.Nil(t, plan.DecodeParams)
			}
			assert.Equal(t, wantDecode, string(plan.Decode), "decode keeps the client's stop, stream and cap")

			handoff := validHandoff("")
			if c.handoffPorts != "" {
				handoff = strings.Replace(handoff, `"remote_handshake_port":"6301","remote_notify_port":"61005"`, c.handoffPorts, 1)
			}
			dec, failed, err := plan.DecodeAfterPrefill([]byte(`{"id":"p","kv_transfer_params":` + handoff + `}`))
			assert.False(t, failed)
			if c.wantErr {
				requireAPIErr(t, err, 502, CodeMoRIIOHandoffInvalid)
				return
			}
			require.NoError(t, err)
			if c.concurrent {
				assert.Equal(t, string(plan.Decode), string(dec))
			} else {
				assert.Equal(t, strings.TrimSuffix(body, "}")+`,"kv_transfer_params":`+handoff+`}`, string(dec), "the handoff is relayed verbatim")
			}
			assert.True(t, json.Valid(dec))

			// A foreign transfer id, or no handoff at all, never reaches decode (item 78).
			for _, resp := range []string{
				`{"kv_transfer_params":` + strings.Replace(handoff, testXfer, "xfer-other", 1) + `}`,
				`{"id":"p"}`, `{"kv_transfer_params":null}`, `not json`,
			} {
				_, _, err := plan.DecodeAfterPrefill([]byte(resp))
				requireAPIErr(t, err, 502, CodeMoRIIOHandoffInvalid)
			}
		})
	}
}

func TestMoRIIOParams(t *testing.T) {
	ep := MoRIIOEndpoint{Mode: MoRIIOWrite, Host: "[fd00::2]", HandshakePort: 7301, NotifyPort: 62005, TPSize: 8, DPSize: 1}
	assert.Equal(t, `{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"transfer_id":"t\"1","remote_dp_size":1,"remote_dp_rank":3,"remote_tp_size":8,"remote_host":"[fd00::2]","remote_handshake_port":7301,"remote_notify_port":62005}`,
		string(MoRIIOPrefillParams(`t"1`, ep, intp(3))))
	ep.Mode, ep.TPSize = MoRIIORead, 0
	assert.Equal(t, `{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"transfer_id":"t","remote_dp_size":1}`,
		string(MoRIIOPrefillParams("t", ep, nil)))
	assert.Equal(t, `{"do_remote_decode":false,"do_remote_prefill":true,"remote_engine_id":null,"remote_block_ids":null,"transfer_id":"t","remote_dp_size":1,"remote_dp_rank":0,"remote_host":"[fd00::2]","remote_handshake_port":7301,"remote_notify_port":62005}`,
		string(MoRIIODecodeParams("t", ep, intp(0))))
}

func TestValidateMoRIIOHandoff(t *testing.T) {
	set := func(key, value string) string {
		var m map[string]json.RawMessage
		require.NoError(t, json.Unmarshal([]byte(validHandoff("")), &m))
		if value == "<absent>" {
			delete(m, key)
		} else {
			m[key] = json.RawMessage(value)
		}
		out, err := json.Marshal(m)
		require.NoError(t, err)
		return string(out)
	}
	type handoffCase struct {
		name, raw string
		ports     *[2]int
		pinned    *int
		ok        bool
	}
	cases := []handoffCase{
		{name: "vLLM producer shape", raw: validHandoff(""), ok: true},
		{name: "minimal", raw: `{"do_remote_prefill":true,"transfer_id":"` + testXfer + `","remote_engine_id":"e","remote_block_ids":[1],"remote_host":"h","remote_handshake_port":1,"remote_notify_port":65535}`, ok: true},
		{name: "whitespace around", raw: " \n" + validHandoff("") + " ", ok: true},
		{name: "not an object", raw: `[1]`},
		{name: "invalid JSON", raw: `{"do_remote_prefill":true`},
		{name: "empty", raw: ``},
		{name: "duplicate key: last wins", raw: validHandoff(`,"transfer_id":"xfer-other"`)},
		{name: "do_remote_prefill false", raw: set("do_remote_prefill", `false`)},
		{name: "do_remote_prefill string", raw: set("do_remote_prefill", `"true"`)},
		{name: "do_remote_prefill absent", raw: set("do_remote_prefill", `<absent>`)},
		{name: "transfer_id foreign", raw: set("transfer_id", `"xfer-other"`)},
		{name: "transfer_id absent", raw: set("transfer_id", `<absent>`)},
		{name: "transfer_id number", raw: set("transfer_id", `1`)},
		{name: "transfer_id escaped equal", raw: set("transfer_id", `"`+strings.Replace(testXfer, "x", `\u0078`, 1)+`"`), ok: true},
	}
	for _, key := range []string{"remote_engine_id", "remote_block_ids", "remote_host", "remote_handshake_port", "remote_notify_port"} {
		cases = append(cases,
			handoffCase{name: key + " null", raw: set(key, `null`)},
			handoffCase{name: key + " absent", raw: set(key, `<absent>`)})
	}
	fields := []struct {
		key, value string
		ok         bool
	}{
		{"remote_engine_id", `42`, false},
		{"remote_engine_id", `""`, false},
		{"remote_engine_id", `["10.24.112.125:6301"]`, false},
		{"remote_engine_id", `"e"`, true},
		{"remote_block_ids", `"484,485"`, false},
		{"remote_block_ids", `{"0":[484]}`, false},
		{"remote_block_ids", `[["484"]]`, false},
		{"remote_block_ids", `[[-1]]`, false},
		{"remote_block_ids", `[[1.5]]`, false},
		{"remote_block_ids", `[[1e2]]`, false},
		{"remote_block_ids", `[484,[485]]`, false},
		{"remote_block_ids", `[]`, false},
		{"remote_block_ids", `[[]]`, false},
		{"remote_block_ids", `[[],[]]`, false},
		{"remote_block_ids", `[[[1]]]`, false},
		{"remote_block_ids", `[484,485]`, true}, // flat list (doc)
		{"remote_block_ids", `[[484],[]]`, true},
		{"remote_block_ids", `[[0,1],[2]]`, true},
		{"remote_host", `""`, false},
		{"remote_host", `42`, false},
		{"remote_host", `"10.24.112.125 "`, false},
		{"remote_host", `"a\tb"`, false},
		{"remote_host", `"a\u00a0b"`, false},
		{"remote_host", `"prefill-0.pd.svc"`, true},
		{"remote_host", `"[fd00::1]"`, true},
		{"remote_handshake_port", `"abc"`, false},
		{"remote_handshake_port", `0`, false},
		{"remote_handshake_port", `"0"`, false},
		{"remote_handshake_port", `6301.0`, false},
		{"remote_handshake_port", `-1`, false},
		{"remote_handshake_port", `true`, false},
		{"remote_handshake_port", `[6301]`, false},
		{"remote_handshake_port", `6301`, true},
		{"remote_handshake_port", `" 6301 "`, true},
		{"remote_notify_port", `70000`, false},
		{"remote_notify_port", `"65536"`, false},
		{"remote_notify_port", `true`, false},
		{"remote_notify_port", `65535`, true},
		{"remote_dp_size", `"abc"`, false},
		{"remote_dp_size", `"1"`, true}, // decimal string (doc)
		{"remote_dp_size", `1`, true},
		{"remote_dp_size", `null`, true},
		{"remote_dp_size", `<absent>`, true},
		{"remote_dp_size", `1.5`, false},
		{"remote_dp_size_local", `-1`, false},
		{"remote_dp_size_local", `0`, true},
		{"remote_dp_rank", `[0]`, false},
		{"remote_dp_rank", `"0"`, true},
		{"remote_dp_rank", `"-0"`, false},
		{"tp_size", `"two"`, false},
		{"tp_size", `"8"`, true},
		{"tp_size", `8`, true},
		{"tp_size", `{}`, false},
		{"remote_tp_size", `1.5`, false},
		{"remote_tp_size", `1e0`, false},
		{"remote_tp_size", `null`, true},
		{"unknown_field", `[1,{"x":null}]`, true},
	}
	for _, f := range fields {
		cases = append(cases, handoffCase{name: f.key + "=" + f.value, raw: set(f.key, f.value), ok: f.ok})
	}
	cases = append(cases, []handoffCase{
		{name: "expected ports match (strings)", raw: validHandoff(""), ports: &[2]int{6301, 61005}, ok: true},
		{name: "expected ports match (numbers)", raw: set("remote_notify_port", `61005`), ports: &[2]int{6301, 61005}, ok: true},
		{name: "expected handshake differs", raw: validHandoff(""), ports: &[2]int{7301, 61005}},
		{name: "expected notify differs", raw: validHandoff(""), ports: &[2]int{6301, 61006}},
		{name: "pinned rank matches", raw: set("remote_dp_rank", `3`), pinned: intp(3), ok: true},
		{name: "pinned rank differs", raw: set("remote_dp_rank", `0`), pinned: intp(3)},
		{name: "pinned rank absent", raw: set("remote_dp_rank", `<absent>`), pinned: intp(3)},
		{name: "pinned rank null", raw: set("remote_dp_rank", `null`), pinned: intp(0)},
		{name: "pinned rank as a string", raw: set("remote_dp_rank", `"3"`), pinned: intp(3)},
		{name: "unpinned, no rank", raw: set("remote_dp_rank", `<absent>`), ok: true},
	}...)
	for _, c := range cases {
		err := ValidateMoRIIOHandoff([]byte(c.raw), testXfer, c.ports, c.pinned)
		if c.ok {
			assert.NoError(t, err, "%s: %s", c.name, c.raw)
			continue
		}
		if assert.Error(t, err, "%s: %s", c.name, c.raw) {
			ae := requireAPIErr(t, err, 502, CodeMoRIIOHandoffInvalid)
			assert.Error(t, ae.Cause, c.name)
		}
	}
}
