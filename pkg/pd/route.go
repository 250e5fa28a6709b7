// Package pd implements the request-path pieces of SMG's HTTP
// prefill/decode (PD) router for SGLang workers: route table, request
// scanning, bootstrap-field injection by byte-level JSON edits, header
// allowlist, request ids, leg error mapping and the /generate logprob merge.
//
// Bodies are never decoded into maps and re-encoded: the gateway forwards the
// client's bytes and only replaces or appends the keys it owns, so client
// numbers (0.95 stays 0.95), key order and unknown fields survive exactly.
package pd

// Route describes a client-facing PD route.
type Route struct {
	ClientPath   string // e.g. "/rerank"
	UpstreamPath string // path used on both legs, e.g. "/v1/rerank"
	Endpoint     string // metrics label: chat, generate, completions, rerank, responses, messages, other
	IDPrefix     string // generated request-id prefix: "chatcmpl-", "cmpl-", "gnt-", "resp-", "msg_", "req-"
	PrefillOnly  bool   // /v1/messages/count_tokens: one prefill worker, no decode leg, no bootstrap fields
	NeverStream  bool   // rerank (and count_tokens): the "stream" key is not interpreted
}

// routeTable is a constant table; callers must treat the *Route values they
// get from LookupRoute and Routes as read-only.
var routeTable = [...]Route{
	{ClientPath: "/generate", UpstreamPath: "/generate", Endpoint: "generate", IDPrefix: "gnt-"},
	{ClientPath: "/v1/chat/completions", UpstreamPath: "/v1/chat/completions", Endpoint: "chat", IDPrefix: "chatcmpl-"},
	{ClientPath: "/v1/completions", UpstreamPath: "/v1/completions", Endpoint: "completions", IDPrefix: "cmpl-"},
	{ClientPath: "/v1/messages", UpstreamPath: "/v1/messages", Endpoint: "messages", IDPrefix: "msg_"},
	{ClientPath: "/v1/responses", UpstreamPath: "/v1/responses", Endpoint: "responses", IDPrefix: "resp-"},
	{ClientPath: "/v1/rerank", UpstreamPath: "/v1/rerank", Endpoint: "rerank", IDPrefix: "req-", NeverStream: true},
	{ClientPath: "/rerank", UpstreamPath: "/v1/rerank", Endpoint: "rerank", IDPrefix: "req-", NeverStream: true},
	// SMG labels routes outside its six generation endpoints "other"; the id
	// prefix follows the /v1/messages family.
	{ClientPath: "/v1/messages/count_tokens", UpstreamPath: "/v1/messages/count_tokens", Endpoint: "other", IDPrefix: "msg_", PrefillOnly: true, NeverStream: true},
}

// LookupRoute finds the route for a client path (without query string) by
// exact match.
func LookupRoute(path string) (*Route, bool) {
	for i := range routeTable {
		if routeTable[i].ClientPath == path {
			return &routeTable[i], true
		}
	}
	return nil, false
}

// Routes returns all routes, for building Envoy route configuration.
func Routes() []*Route {
	out := make([]*Route, len(routeTable))
	for i := range routeTable {
		out[i] = &routeTable[i]
	}
	return out
}

// routeKind selects the body schema a route is scanned with.
type routeKind uint8

const (
	kindOther routeKind = iota
	kindGenerate
	kindChat
	kindCompletions
	kindMessages
	kindResponses
	kindRerank
	kindCountTokens
)

// kind derives the schema from the upstream path, so hand-built Routes work too.
func (r *Route) kind() routeKind {
	switch r.UpstreamPath {
	case "/generate":
		return kindGenerate
	case "/v1/chat/completions":
		return kindChat
	case "/v1/completions":
		return kindCompletions
	case "/v1/messages":
		return kindMessages
	case "/v1/responses":
		return kindResponses
	case "/v1/rerank":
		return kindRerank
	case "/v1/messages/count_tokens":
		return kindCountTokens
	}
	return kindOther
}
