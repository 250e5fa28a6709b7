// Package vllm is a strict fake vLLM engine for PD (prefill/decode)
// disaggregation tests over HTTP. See reference/engines.md §2, §3 and §5.2.
//
// A server is one vLLM worker with a kv_role (Producer, Consumer, Both) and
// a KV connector (Nixl, Mooncake, MoRIIO or None). Routes:
// POST /v1/chat/completions, /v1/completions, /v1/messages (Anthropic) and
// /v1/responses; GET /health (/ping), /version, /v1/models
// (owned_by "vllm"), /metrics, /load; GET /server_info only with DevMode
// (else 404). ResponsesRequest does not declare kv_transfer_params: on
// /v1/responses the field is ignored (event kv_params_ignored), so that
// route never transfers KV.
//
// Every request: X-Request-Id, else body request_id, else a uuid (response
// id chatcmpl-/cmpl-<id>; the engine-internal id appends a random -<8hex>,
// so it differs per worker). X-data-parallel-rank picks the DP rank (else
// Config.DPRank). kv_transfer_params that is not an object is a 400 with
// vLLM's {"error":{"message","type":"BadRequestError","param":null,
// "code":400}}. Non-stream bodies carry a top-level kv_transfer_params (null
// unless a handoff is returned); stream chunks never do.
//
// Legs are told apart by kv_transfer_params: do_remote_decode=true is a
// prefill leg, do_remote_prefill=true a decode leg, anything else a plain
// run. The wire each connector expects:
//
// NIXL. Prefill: {"do_remote_decode":true} (other keys optional), one
// sequence, capped at one token (max_tokens / max_completion_tokens = 1).
// On a "length" finish it returns {"do_remote_prefill":true,
// "do_remote_decode":false,"remote_block_ids":[[…]],"remote_engine_id",
// "remote_request_id":<internal id>,"remote_host","remote_port":<side
// channel port of the rank>,"tp_size"} and holds the blocks for
// AbortRequestTimeout (480 s; then event handoff_expired). Decode: the
// client's body plus those params verbatim. The decode reads them once
// through the prefill's side channel (POST http://remote_host:remote_port/
// _fake/nixl/read): a wrong engine id, request id, block ids, tp_size, or
// prompt, a second read, or an expired handoff is a load failure. Missing
// remote_block_ids: 400 strict (lax: 500 engine assertion); another missing
// key: 400 strict (lax: recompute). No kv_transfer_params: recomputed.
//
// Mooncake. Prefill: {"do_remote_decode":true,"transfer_id":"…"}; the
// response's kv_transfer_params is always null; blocks are held (by
// transfer_id, also for a streamed leg) after a "length" finish. The
// prefill runs a bootstrap server (POST /register, GET /query →
// {"<rank>":{"engine_id","worker_addr":{"0":{"0":"tcp://host:port"}}}}).
// Decode: {"do_remote_prefill":true,"do_remote_decode":false,
// "transfer_id":<same>,"remote_engine_id":<id, or <id>_dp<rank> with DP>1>,
// "remote_bootstrap_addr":"http://host:port"}. The decode GETs /query at
// that address (unreachable, or engine id unknown: load failure), then
// pulls transfer_id from the worker, waiting for the prefill up to
// TransferTimeout (ordering-agnostic). Unclaimed transfers expire (event
// orphan_transfer).
//
// MoRI-IO (ports: handshake 6301, notify 61005 by default; engine id
// "<host>:<handshake port>"). Any non-empty kv_transfer_params without a
// transfer_id key kills the engine (500, then /health 503 and every request
// 500 until Reset); so do non-integer remote_dp_size / remote_tp_size.
// Prefill: {"do_remote_decode":true,"transfer_id"} plus, strict,
// ignore_eos:true and no stop / stop_token_ids; WRITE also needs the
// decode's remote_host, remote_handshake_port and remote_notify_port (or
// request-id markers). It returns {"do_remote_prefill":true,
// "do_remote_decode":false,"remote_block_ids":[[…]],"remote_engine_id",
// "remote_host","remote_handshake_port","remote_notify_port",
// "remote_dp_size","tp_size","transfer_id"}. Decode: do_remote_prefill,
// transfer_id and the prefill's remote_host, remote_handshake_port,
// remote_notify_port (or markers); READ also remote_engine_id and
// remote_block_ids, and must come after the prefill answered (else "no
// prefill blocks for transfer_id"). WRITE: the decode sends remote_blocks
// to the prefill's notify port and waits (TransferTimeout, 30 s) for the
// prefill's push to the side channel the prefill leg named; legs may be
// concurrent. A MoRI-IO decode never silently recomputes: missing or
// malformed params are a 400 (strict), and a Consumer without params is a
// 400 (strict).
//
// Prefill legs (any connector), strict: n>1, use_beam_search, a prompt
// list or prompt_embeds → 400 "PD prefill leg must be single-sequence"; no
// one-token cap → 400 "PD prefill leg must be capped at one output token".
// Lax runs them (event prefill_generated_gt_1). stream:true runs, the
// handoff is lost (event prefill_streamed). A handoff needs finish_reason
// length: an EOS (Config.EOSAt) without ignore_eos, a stop string or stop
// token id gives "stop" and no handoff.
//
// Load failures follow KVLoadFailurePolicy: "fail" (500 "KV load failed
// for <id>: <reason>") or "recompute". Decode responses carry X-Fake-KV
// (transferred, recomputed, none); prefill responses X-Fake-Handoff (issued,
// none). Every [strict] check switches to the real behaviour with
// Config.Lax ({"strict":false} on POST /_fake/config).
//
// Introspection under /_fake on the engine port: GET /_fake/requests
// [?path=…], GET /_fake/events, GET /_fake/state, GET|POST /_fake/config,
// POST /_fake/reset.
package vllm
