package common

import (
	"encoding/json"
	"io"
	"net/http"
)

// Introspection is what a fake exposes on its /_fake/{requests,events,state,
// config,reset} routes; P is the body of POST /_fake/config.
type Introspection[P any] struct {
	Requests func() []RecordedRequest
	Events   func() []Event
	State    func() any
	// Config is the JSON of GET /_fake/config.
	Config func() any
	// Patch applies a decoded POST /_fake/config body and returns the JSON to
	// answer (the new configuration).
	Patch func(P) (any, error)
	Reset func()
	// BadRequest is the 400 body for msg (the fake's error envelope).
	BadRequest func(msg string) any
}

// HandleIntrospection registers the /_fake routes of x on mux:
//
//	GET  /_fake/requests[?path=P]  the recorded requests (only those on P)
//	GET  /_fake/events             the event log
//	GET  /_fake/state              x.State()
//	GET  /_fake/config             x.Config()
//	POST /_fake/config             a strict (unknown fields rejected) patch
//	POST /_fake/reset              x.Reset(), answering {"ok":true}
func HandleIntrospection[P any](mux *http.ServeMux, x Introspection[P]) {
	mux.HandleFunc("GET /_fake/requests", func(w http.ResponseWriter, r *http.Request) {
		reqs := x.Requests()
		if p := r.URL.Query().Get("path"); p != "" {
			kept := reqs[:0]
			for _, rr := range reqs {
				if rr.Path == p {
					kept = append(kept, rr)
				}
			}
			reqs = kept
		}
		WriteJSON(w, http.StatusOK, reqs)
	})
	mux.HandleFunc("GET /_fake/events", func(w http.ResponseWriter, _ *http.Request) {
		WriteJSON(w, http.StatusOK, x.Events())
	})
	mux.HandleFunc("GET /_fake/state", func(w http.ResponseWriter, _ *http.Request) {
		WriteJSON(w, http.StatusOK, x.State())
	})
	mux.HandleFunc("GET /_fake/config", func(w http.ResponseWriter, _ *http.Request) {
		WriteJSON(w, http.StatusOK, x.Config())
	})
	mux.HandleFunc("POST /_fake/config", func(w http.ResponseWriter, r *http.Request) {
		var p P
		dec := json.NewDecoder(io.LimitReader(r.Body, 1<<20))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&p); err != nil {
			WriteJSON(w, http.StatusBadRequest, x.BadRequest("bad config patch: "+err.Error()))
			return
		}
		v, err := x.Patch(p)
		if err != nil {
			WriteJSON(w, http.StatusBadRequest, x.BadRequest(err.Error()))
			return
		}
		WriteJSON(w, http.StatusOK, v)
	})
	mux.HandleFunc("POST /_fake/reset", func(w http.ResponseWriter, _ *http.Request) {
		x.Reset()
		WriteJSON(w, http.StatusOK, map[string]bool{"ok": true})
	})
}
