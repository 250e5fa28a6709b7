// Package common holds the pieces shared by the strict fake engines under
// pkg/fake (SGLang today, vLLM later): a deterministic whitespace tokenizer and
// token generator, a bounded log of received requests, a bounded event log,
// JSON and SSE writing helpers, and context-aware sleeping.
//
// Nothing here keeps package-level mutable state: every log is a value owned
// by the server that created it.
package common
