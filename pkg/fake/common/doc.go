// Package common holds the pieces shared by the strict fake engines under
// pkg/fake (SGLang and vLLM): a deterministic whitespace tokenizer and token
// generator, a bounded log of received requests, a bounded event log, JSON
// and SSE writing helpers (including the Anthropic and Responses event
// sequences), context-aware sleeping, the server lifecycle (Lifecycle:
// listeners, in-flight tracking, the forced close), the configuration holder
// with its startup window (Settings), the /_fake introspection routes
// (HandleIntrospection), POST /_fake/config patch helpers and pydantic-style
// raw JSON field helpers.
//
// Nothing here keeps package-level mutable state: every log, lifecycle and
// configuration is a value owned by the server that created it.
package common
