package sglang_test

import (
	"encoding/json"
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/smg-project/smg-extproc/pkg/fake/sglang"
)

func TestRequestValidation(t *testing.T) {
	t.Parallel()
	d := start(t, fast(sglang.Decode))
	cases := []struct {
		name        string
		path        string
		contentType string
		body        string
		status      int
		typ         string // ErrorResponse "type"; "" for other envelopes
		contains    string
	}{
		{"content type", "/v1/chat/completions", "text/plain", `{"messages":[{"role":"user","content":"a"}]}`, 400, "Bad Request", "Only 'application/json' is allowed"},
		{"content type generate", "/generate", "", `{"text":"a"}`, 400, "Bad Request", "Only 'application/json' is allowed"},
		{"not an object", "/generate", "application/json", `[1,2]`, 400, "Bad Request", "valid dictionary"},
		{"invalid json", "/generate", "application/json", `{"text":`, 400, "Bad Request", "valid dictionary"},
		{"room non-numeric string", "/generate", "application/json", `{"text":"a","bootstrap_room":"abc"}`, 400, "Bad Request", "int_parsing"},
		{"room numeric string is strict", "/generate", "application/json", `{"text":"a","bootstrap_room":"123"}`, 400, "Bad Request", "list_type"},
		{"room float with fraction", "/generate", "application/json", `{"text":"a","bootstrap_room":1.5}`, 400, "Bad Request", "int_parsing"},
		{"room whole float is strict", "/generate", "application/json", `{"text":"a","bootstrap_room":1e3}`, 400, "Bad Request", "int_parsing"},
		{"room object", "/generate", "application/json", `{"text":"a","bootstrap_room":{}}`, 400, "Bad Request", "int_parsing"},
		{"room negative", "/generate", "application/json", `{"text":"a","bootstrap_room":-1}`, 400, "", "bootstrap_room out of range"},
		{"room 2^63", "/v1/completions", "application/json", `{"prompt":"a","bootstrap_room":9223372036854775808}`, 400, "BadRequest", "bootstrap_room out of range"},
		{"room 2^63-1 plus batch overflows", "/v1/completions", "application/json", `{"prompt":["a","b"],"bootstrap_room":9223372036854775807}`, 400, "BadRequest", "bootstrap_room out of range"},
		{"port not int", "/v1/chat/completions", "application/json", `{"messages":[{"role":"user","content":"a"}],"bootstrap_room":5,"bootstrap_port":"x"}`, 400, "Bad Request", "bootstrap_port"},
		{"port out of range", "/generate", "application/json", `{"text":"a","bootstrap_room":5,"bootstrap_port":70000}`, 400, "Bad Request", "bootstrap_port"},
		{"room list longer than batch", "/generate", "application/json", `{"text":["a","b"],"bootstrap_room":[1,2,3]}`, 400, "", "bootstrap_room list length 3 does not match the number of requests 2"},
		{"host list shorter than batch", "/generate", "application/json", `{"text":["a","b"],"bootstrap_room":[1,2],"bootstrap_host":["h"]}`, 400, "", "bootstrap_host list length 1"},
		{"null room in list", "/generate", "application/json", `{"text":["a","b"],"bootstrap_room":[1,null]}`, 400, "", "without bootstrap room id"},
		{"chat without messages", "/v1/chat/completions", "application/json", `{"bootstrap_room":5}`, 400, "Bad Request", "messages: Field required"},
		{"completions without prompt", "/v1/completions", "application/json", `{"bootstrap_room":5}`, 400, "Bad Request", "prompt: Field required"},
		{"generate text and input_ids", "/generate", "application/json", `{"text":"a","input_ids":[1],"bootstrap_room":5}`, 400, "", "Either text, input_ids or input_embeds should be provided."},
		{"generate nothing", "/generate", "application/json", `{"bootstrap_room":5}`, 400, "", "Either text, input_ids or input_embeds should be provided."},
		{"rerank without documents", "/v1/rerank", "application/json", `{"query":"q","bootstrap_room":5}`, 400, "Bad Request", "documents: Field required"},
		{"max_tokens not int", "/v1/completions", "application/json", `{"prompt":"a","max_tokens":"x"}`, 400, "Bad Request", "max_tokens"},
		{"n zero", "/v1/chat/completions", "application/json", `{"messages":[{"role":"user","content":"a"}],"n":0}`, 400, "BadRequest", "n must be"},
		{"stream not bool", "/v1/completions", "application/json", `{"prompt":"a","stream":"yes"}`, 400, "Bad Request", "stream"},
		{"responses uses the nested envelope", "/v1/responses", "application/json", `{"model":"m"}`, 400, "", "input: Field required"},
		{"missing room on messages", "/v1/messages", "application/json", `{"messages":[{"role":"user","content":"a"}],"max_tokens":3}`, 400, "BadRequest", "without bootstrap room id"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			r := doRaw(t.Context(), http.MethodPost, d.URL()+tc.path, tc.contentType, []byte(tc.body))
			require.NoError(t, r.err)
			require.Equal(t, tc.status, r.status, string(r.body))
			assert.Contains(t, r.errMessage(t), tc.contains)
			m := r.json(t)
			if tc.typ != "" {
				assert.Equal(t, "error", m["object"])
				assert.Equal(t, tc.typ, m["type"])
				assert.EqualValues(t, tc.status, m["code"])
			}
			if tc.path == "/v1/responses" {
				assert.Equal(t, "Bad Request", m["error"].(map[string]any)["type"])
			}
		})
	}

	t.Run("method not allowed", func(t *testing.T) {
		t.Parallel()
		r := doRaw(t.Context(), http.MethodGet, d.URL()+"/v1/chat/completions", "", nil)
		assert.Equal(t, http.StatusMethodNotAllowed, r.status)
	})
	t.Run("every request is recorded, valid or not", func(t *testing.T) {
		t.Parallel()
		n := len(d.Requests())
		r := doRaw(t.Context(), http.MethodPost, d.URL()+"/v1/rerank", "application/json", []byte(`{"oops":1}`))
		require.Equal(t, http.StatusBadRequest, r.status)
		var found bool
		for _, rr := range d.Requests() {
			if rr.Path == "/v1/rerank" && string(rr.Body) == `{"oops":1}` {
				found = true
				assert.Equal(t, "application/json", rr.Header.Get("Content-Type"))
			}
		}
		assert.True(t, found)
		assert.Greater(t, len(d.Requests()), n)
	})
}

// A scalar room expands to room+i; a list of batch x n rooms is used as given.
func TestRoomExpansionOrder(t *testing.T) {
	t.Parallel()
	pair := newPair(t)
	room := newRoom()
	body := map[string]any{
		"prompt": []any{"p zero", "p one"}, "n": 2, "max_tokens": 2,
		"bootstrap_host": "127.0.0.1", "bootstrap_port": pair.p.BootstrapPort(), "bootstrap_room": room,
	}
	pr, dr := parallel(t.Context(), pair.p.URL()+"/v1/completions", body, pair.d.URL()+"/v1/completions", body)
	require.Equal(t, http.StatusOK, pr.status, string(pr.body))
	require.Equal(t, http.StatusOK, dr.status, string(dr.body))
	var rooms []uint64
	for _, e := range pair.p.Events() {
		if e.Outcome == "transferred" && e.Room != nil {
			rooms = append(rooms, *e.Room)
		}
	}
	assert.ElementsMatch(t, []uint64{room, room + 1, room + 2, room + 3}, rooms)
	var out struct {
		Choices []struct {
			Index int    `json:"index"`
			Text  string `json:"text"`
		} `json:"choices"`
	}
	require.NoError(t, json.Unmarshal(dr.body, &out))
	require.Len(t, out.Choices, 4)
	for i, c := range out.Choices {
		assert.Equal(t, i, c.Index)
	}
	assert.NotEqual(t, out.Choices[0].Text, out.Choices[1].Text, "samples of one prompt differ")
}
