// Package sglang is a strict fake SGLang engine for PD (prefill/decode)
// disaggregation tests. See reference/engines.md §1 and §5.1.
//
// A prefill fake runs two listeners: the engine API and a real bootstrap
// HTTP server (PUT/GET /route, GET /health, POST /register_dp_rank,
// POST /query_dp_ranks, plus the fake-only POST /_fake/join and
// POST /_fake/abort). A decode fake reaches its prefill only over HTTP, at
// bootstrap_host:bootstrap_port taken from each request; there is no
// process-wide registry.
//
// Per room R, both legs block on each other exactly like SGLang:
//
//   - decode: GET /route?...=-1 (retried FetchRetryInterval × FetchAttempts),
//     page_size / kv_cache_dtype check, POST /_fake/join (a long poll) that
//     returns when the prefill marked R transferred, waiting at most
//     WaitingTimeout, with GET /health heartbeats; then the prompt hash and
//     length are compared (strict: 500 "KV mismatch for room R") and the
//     decode generates, its first token being the prefill's.
//   - prefill: registers R, sleeps PrefillDelay, waits for the join at most
//     BootstrapTimeout, sleeps TransferDelay, marks R transferred and only
//     then answers, with exactly one token (finish_reason length).
//
// So a gateway that dispatches sequentially deadlocks until the prefill's
// bootstrap timeout, one that sends different rooms or prompts, or the wrong
// bootstrap port, fails, and a room reused while pending is a 400.
//
// Request checks on every generation route (/generate, /v1/chat/completions,
// /v1/completions, /v1/messages, /v1/responses, /v1/rerank): Content-Type
// application/json; schema (bootstrap_room must be a JSON integer, strict);
// in PD modes a room for every expanded request (400 "Invalid request:
// Disaggregated request received without bootstrap room id. req.rid='…'");
// room in [0, 2^63-1]; SGLang's batch/n expansion (a scalar room becomes
// room+i; a list of length batch×n is used as given; a list of length batch
// is repeated n times, as SGLang does, which yields duplicate rooms; other
// lengths are a 400); duplicate rooms (in the request, or already pending on
// the worker) are a 400; a missing bootstrap_port means the worker's own
// bootstrap port. Room 0 with host 2.2.2.2 completes locally (health form).
// /v1/messages/count_tokens never needs bootstrap fields and, strict,
// rejects them.
//
// Expanded requests are ordered as SGLang does: k = sample*batch + prompt.
// Validation failures are answered before any response head, also for
// streams (unless EarlyStreamHead). Decode responses carry X-Fake-KV
// (transferred, recomputed or none).
//
// Every [strict] behaviour switches to the real engine's with Config.Lax
// (or {"strict": false} on POST /_fake/config): numeric-string rooms are
// accepted, duplicate rooms stall until the timeout, a short room list is a
// 500 IndexError, a KV mismatch recomputes (X-Fake-KV: recomputed), a second
// join hangs, count_tokens ignores bootstrap fields.
//
// Generation is deterministic (see package common): the same prompt gives
// the same output on a Null fake and on a prefill/decode pair.
//
// Test-only introspection lives under /_fake on the engine port:
// GET /_fake/requests[?path=…], GET /_fake/events, GET /_fake/state,
// GET|POST /_fake/config, POST /_fake/reset.
package sglang
