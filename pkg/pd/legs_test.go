package pd

import (
	"bytes"
	"encoding/json"
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func intp(i int) *int { return &i }

func TestMintRooms(t *testing.T) {
	for _, n := range []int{1, 3, 1000} {
		rooms, err := MintRooms(n)
		require.NoError(t, err)
		require.Len(t, rooms, n)
		seen := make(map[uint64]bool, n)
		for _, r := range rooms {
			assert.True(t, r >= 1 && r <= math.MaxInt64, "room %d out of range", r)
			assert.False(t, seen[r], "duplicate room %d", r)
			seen[r] = true
		}
	}
	// Two consecutive requests get different rooms.
	a, err := MintRooms(1)
	require.NoError(t, err)
	b, err := MintRooms(1)
	require.NoError(t, err)
	assert.NotEqual(t, a, b)
	for _, n := range []int{0, -1} {
		_, err := MintRooms(n)
		assert.Error(t, err)
	}
}

func TestBuildLegs(t *testing.T) {
	port := intp(8998)
	const tail = `"bootstrap_host":"p","bootstrap_port":8998,"bootstrap_room":42`
	cases := []struct {
		name          string
		route, body   string
		bs            Bootstrap
		dp            DPRanks
		prefill, dec  string // dec "" means same as prefill
		wantSharedBuf bool
	}{
		{name: "generate scalar (item 1)", route: "/generate", body: `{"text":"hi"}`,
			bs: Bootstrap{Host: "p", Port: port, Rooms: []uint64{42}}, prefill: `{"text":"hi",` + tail + `}`, wantSharedBuf: true},
		{name: "numbers survive byte for byte (item 12)", route: "/v1/chat/completions",
			body:    `{"messages":[{"role":"user","content":"x"}],"temperature":0.7,"top_p":0.95,"seed":12345678901234567890,"stream_options":{"include_usage":true,"continuous_usage_stats":true},"x_unknown":[1e-9,null]}`,
			bs:      Bootstrap{Host: "p", Port: port, Rooms: []uint64{42}},
			prefill: `{"messages":[{"role":"user","content":"x"}],"temperature":0.7,"top_p":0.95,"seed":12345678901234567890,"stream_options":{"include_usage":true,"continuous_usage_stats":true},"x_unknown":[1e-9,null],` + tail + `}`},
		{name: "port null (item 3)", route: "/generate", body: `{"text":"hi"}`,
			bs: Bootstrap{Host: "p", Rooms: []uint64{7}}, prefill: `{"text":"hi","bootstrap_host":"p","bootstrap_port":null,"bootstrap_room":7}`},
		{name: "client bootstrap fields overwritten in place (item 11)", route: "/generate",
			body:    `{"bootstrap_room":1,"text":"x","bootstrap_host":"evil","bootstrap_port":"1"}`,
			bs:      Bootstrap{Host: "p", Port: port, Rooms: []uint64{42}},
			prefill: `{"bootstrap_room":42,"text":"x","bootstrap_host":"p","bootstrap_port":8998}`},
		{name: "duplicate client room collapsed to one", route: "/generate",
			body:    `{"bootstrap_room":1,"text":"x","bootstrap_room":[2,3]}`,
			bs:      Bootstrap{Host: "p", Port: port, Rooms: []uint64{42}},
			prefill: `{"bootstrap_room":42,"text":"x","bootstrap_host":"p","bootstrap_port":8998}`},
		{name: "escaped client key overwritten", route: "/generate",
			body:    `{"bootstrap\u005froom":1}`,
			bs:      Bootstrap{Host: "p", Port: port, Rooms: []uint64{42}},
			prefill: `{"bootstrap\u005froom":42,"bootstrap_host":"p","bootstrap_port":8998}`},
		{name: "nested bootstrap_room untouched", route: "/generate",
			body:    `{"sampling_params":{"bootstrap_room":5,"temperature":0.95},"text":"x"}`,
			bs:      Bootstrap{Host: "p", Port: port, Rooms: []uint64{42}},
			prefill: `{"sampling_params":{"bootstrap_room":5,"temperature":0.95},"text":"x",` + tail + `}`},
		{name: "whitespace and unicode escapes kept", route: "/generate",
			body:    "{ \"text\" : \"h\\u00e9\\n\u65e5\" ,\n  \"stream\": false\n}\n",
			bs:      Bootstrap{Host: "p", Port: port, Rooms: []uint64{42}},
			prefill: "{ \"text\" : \"h\\u00e9\\n\u65e5\" ,\n  \"stream\": false," + tail + "\n}\n"},
		{name: "empty object", route: "/generate", body: `{}`,
			bs: Bootstrap{Host: "p", Port: port, Rooms: []uint64{42}}, prefill: `{` + tail + `}`},
		{name: "batch of 3 (item 6)", route: "/generate", body: `{"input_ids":[[1,2],[3,4],[5,6]]}`,
			bs:      Bootstrap{Host: "p", Port: port, Rooms: []uint64{1, 2, 3}},
			prefill: `{"input_ids":[[1,2],[3,4],[5,6]],"bootstrap_host":["p","p","p"],"bootstrap_port":[8998,8998,8998],"bootstrap_room":[1,2,3]}`},
		{name: "batch with null port", route: "/generate", body: `{"text":["a","b"]}`,
			bs:      Bootstrap{Host: "[::1]", Rooms: []uint64{5, 6}},
			prefill: `{"text":["a","b"],"bootstrap_host":["[::1]","[::1]"],"bootstrap_port":[null,null],"bootstrap_room":[5,6]}`},
		{name: "chat n=3 lists (item 7)", route: "/v1/chat/completions", body: `{"messages":[],"n":3}`,
			bs:      Bootstrap{Host: "p", Port: port, Rooms: []uint64{1, 2, 3}},
			prefill: `{"messages":[],"n":3,"bootstrap_host":["p","p","p"],"bootstrap_port":[8998,8998,8998],"bootstrap_room":[1,2,3]}`},
		{name: "chat n=1 scalars (item 7)", route: "/v1/chat/completions", body: `{"messages":[],"n":1}`,
			bs: Bootstrap{Host: "p", Port: port, Rooms: []uint64{42}}, prefill: `{"messages":[],"n":1,` + tail + `}`},
		{name: "completions prompt list (item 8)", route: "/v1/completions", body: `{"prompt":["a","b"]}`,
			bs:      Bootstrap{Host: "p", Port: port, Rooms: []uint64{1, 2}},
			prefill: `{"prompt":["a","b"],"bootstrap_host":["p","p"],"bootstrap_port":[8998,8998],"bootstrap_room":[1,2]}`},
		{name: "completions one prompt n=4 scalars (item 8)", route: "/v1/completions", body: `{"prompt":"a","n":4}`,
			bs: Bootstrap{Host: "p", Port: port, Rooms: []uint64{42}}, prefill: `{"prompt":"a","n":4,` + tail + `}`},
		{name: "messages scalar (item 9)", route: "/v1/messages", body: `{"messages":[]}`,
			bs: Bootstrap{Host: "p", Port: port, Rooms: []uint64{42}}, prefill: `{"messages":[],` + tail + `}`},
		{name: "responses scalar (item 9)", route: "/v1/responses", body: `{"input":"x"}`,
			bs: Bootstrap{Host: "p", Port: port, Rooms: []uint64{42}}, prefill: `{"input":"x",` + tail + `}`},
		{name: "rerank gets bootstrap (item 10)", route: "/rerank", body: `{"query":"q","documents":["a"]}`,
			bs: Bootstrap{Host: "p", Port: port, Rooms: []uint64{42}}, prefill: `{"query":"q","documents":["a"],` + tail + `}`},
		{name: "DP ranks both (item 5)", route: "/generate", body: `{"text":"x","routed_dp_rank":9}`,
			bs: Bootstrap{Host: "p", Port: port, Rooms: []uint64{42}}, dp: DPRanks{Prefill: intp(2), Decode: intp(5)},
			prefill: `{"text":"x","routed_dp_rank":2,` + tail + `}`,
			dec:     `{"text":"x","routed_dp_rank":5,` + tail + `,"disagg_prefill_dp_rank":2}`},
		{name: "DP rank prefill only", route: "/generate", body: `{"text":"x"}`,
			bs: Bootstrap{Host: "p", Port: port, Rooms: []uint64{42}}, dp: DPRanks{Prefill: intp(0)},
			prefill: `{"text":"x",` + tail + `,"routed_dp_rank":0}`,
			dec:     `{"text":"x",` + tail + `,"disagg_prefill_dp_rank":0}`},
		{name: "DP rank decode only", route: "/generate", body: `{"text":"x","disagg_prefill_dp_rank":1}`,
			bs: Bootstrap{Host: "p", Port: port, Rooms: []uint64{42}}, dp: DPRanks{Decode: intp(3)},
			prefill: `{"text":"x","disagg_prefill_dp_rank":1,` + tail + `}`,
			dec:     `{"text":"x","disagg_prefill_dp_rank":1,` + tail + `,"routed_dp_rank":3}`},
		{name: "model alias rewritten (item 13)", route: "/v1/chat/completions", body: `{"model":"alias","messages":[]}`,
			bs: Bootstrap{Host: "p", Port: port, Rooms: []uint64{42}, Model: "M"}, prefill: `{"model":"M","messages":[],` + tail + `}`},
		{name: "model never added (item 13)", route: "/v1/chat/completions", body: `{"messages":[]}`,
			bs: Bootstrap{Host: "p", Port: port, Rooms: []uint64{42}, Model: "M"}, prefill: `{"messages":[],` + tail + `}`},
		{name: "canonical model unchanged", route: "/v1/chat/completions", body: `{"model":"M","messages":[]}`,
			bs: Bootstrap{Host: "p", Port: port, Rooms: []uint64{42}, Model: "M"}, prefill: `{"model":"M","messages":[],` + tail + `}`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			req, err := ParseRequest(mustRoute(t, c.route), []byte(c.body))
			require.NoError(t, err)
			p, d, err := BuildLegs(req, c.bs, c.dp)
			require.NoError(t, err)
			wantDec := c.dec
			if wantDec == "" {
				wantDec = c.prefill
			}
			assert.Equal(t, c.prefill, string(p))
			assert.Equal(t, wantDec, string(d))
			assert.True(t, json.Valid(p) && json.Valid(d))
			if c.wantSharedBuf {
				assert.Same(t, &p[0], &d[0], "legs share one buffer without DP ranks")
			}
			assert.Equal(t, c.body, string(req.Raw), "client bytes untouched")

			// The general editor (used for hand-built requests and duplicate
			// owned keys) must agree with the spliced fast path.
			slow := &Request{Route: req.Route, Raw: req.Raw, BatchSize: req.BatchSize, Model: req.Model}
			sp, sd, err := BuildLegs(slow, c.bs, c.dp)
			require.NoError(t, err)
			assert.Equal(t, c.prefill, string(sp), "general editor, prefill")
			assert.Equal(t, wantDec, string(sd), "general editor, decode")
		})
	}
}

func TestBuildLegsPrefillOnly(t *testing.T) {
	body := `{"model":"alias","messages":[{"role":"user","content":"c"}],"bootstrap_room":1}`
	req, err := ParseRequest(mustRoute(t, "/v1/messages/count_tokens"), []byte(body))
	require.NoError(t, err)
	p, d, err := BuildLegs(req, Bootstrap{Host: "p", Rooms: []uint64{1}}, DPRanks{Prefill: intp(1)})
	require.NoError(t, err)
	assert.Nil(t, d)
	assert.Equal(t, body, string(p), "no bootstrap or DP keys on count_tokens")
	p, d, err = BuildLegs(req, Bootstrap{Model: "M"}, DPRanks{})
	require.NoError(t, err)
	assert.Nil(t, d)
	assert.Equal(t, `{"model":"M","messages":[{"role":"user","content":"c"}],"bootstrap_room":1}`, string(p))
}

func TestBuildLegsErrors(t *testing.T) {
	gen := mustRoute(t, "/generate")
	req, err := ParseRequest(gen, []byte(`{"input_ids":[[1],[2]]}`))
	require.NoError(t, err)
	_, _, err = BuildLegs(req, Bootstrap{Host: "p", Rooms: []uint64{1}}, DPRanks{})
	assert.ErrorContains(t, err, "got 1 rooms for batch size 2")
	_, _, err = BuildLegs(nil, Bootstrap{}, DPRanks{})
	assert.Error(t, err)
	// A hand-built request with a body that is not an object.
	_, _, err = BuildLegs(&Request{Route: gen, Raw: []byte(`[1]`)}, Bootstrap{Host: "p", Rooms: []uint64{1}}, DPRanks{})
	assert.Error(t, err)
}

func TestBuildLegsSameValuesOnBothLegs(t *testing.T) {
	req, err := ParseRequest(mustRoute(t, "/generate"), []byte(`{"text":"hi"}`))
	require.NoError(t, err)
	rooms, err := MintRooms(1)
	require.NoError(t, err)
	p, d, err := BuildLegs(req, Bootstrap{Host: "p", Port: intp(8998), Rooms: rooms}, DPRanks{Prefill: intp(2), Decode: intp(5)})
	require.NoError(t, err)
	for _, k := range []string{"bootstrap_host", "bootstrap_port", "bootstrap_room"} {
		pv, ok := TopLevel(p, k)
		require.True(t, ok, k)
		dv, ok := TopLevel(d, k)
		require.True(t, ok, k)
		assert.Equal(t, string(pv), string(dv), k)
	}
	room, _ := TopLevel(p, "bootstrap_room")
	var n json.Number
	require.NoError(t, json.Unmarshal(room, &n))
	v, err := n.Int64()
	require.NoError(t, err, "room is an integer that fits int64")
	assert.Positive(t, v)
}

func TestSplitWorkerURL(t *testing.T) {
	cases := []struct {
		in, base string
		rank     *int
		host     string
	}{
		{"http://worker1:8080", "http://worker1:8080", nil, "worker1"},
		{"http://worker1:8080@3", "http://worker1:8080", intp(3), "worker1"},
		{"worker1:8080", "worker1:8080", nil, "worker1"},
		{"http://10.0.0.5:30000@3", "http://10.0.0.5:30000", intp(3), "10.0.0.5"},
		{"10.0.0.5:30000", "10.0.0.5:30000", nil, "10.0.0.5"},
		{"http://[::1]:8000@2", "http://[::1]:8000", intp(2), "[::1]"},
		{"http://[fd00::1]:8000", "http://[fd00::1]:8000", nil, "[fd00::1]"},
		{"http://user:pw@host:80", "http://user:pw@host:80", nil, "host"},
		{"http://user@1234", "http://user", intp(1234), "user"},
		{"HTTPS://Worker1.Example.com/", "HTTPS://Worker1.Example.com/", nil, "worker1.example.com"},
		{"http://p:8000@0", "http://p:8000", intp(0), "p"},
		{"http://p:8000@", "http://p:8000@", nil, "localhost"},
		{"http://h:1@99999999999999999999999", "http://h:1", nil, "h"},
		{"ipc:///tmp/worker.sock", "ipc:///tmp/worker.sock", nil, ""},
		{"", "", nil, "localhost"},
		{"http://", "http://", nil, "localhost"},
		{"http://:8080", "http://:8080", nil, "localhost"},
	}
	for _, c := range cases {
		t.Run(c.in, func(t *testing.T) {
			base, rank, host := SplitWorkerURL(c.in)
			assert.Equal(t, c.base, base)
			assert.Equal(t, c.rank, rank)
			assert.Equal(t, c.host, host)
		})
	}
}

func chatBody(size int) []byte {
	var b bytes.Buffer
	b.WriteString(`{"model":"meta-llama/Llama-3.1-8B-Instruct","messages":[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"`)
	line := `The quick brown fox jumps over the lazy dog.\n Quoted \"text\" and unicode \u00e9 caf\u00e9. `
	for b.Len() < size-120 {
		b.WriteString(line)
	}
	b.WriteString(`"}],"temperature":0.7,"top_p":0.95,"max_tokens":256,"stream":true}`)
	return b.Bytes()
}

func BenchmarkBuildLegs(b *testing.B) {
	route, _ := LookupRoute("/v1/chat/completions")
	for _, size := range []struct {
		name string
		n    int
	}{{"1KB", 1 << 10}, {"400KB", 400 << 10}} {
		body := chatBody(size.n)
		req, err := ParseRequest(route, body)
		require.NoError(b, err)
		bs := Bootstrap{Host: "10.0.0.5", Port: intp(8998), Rooms: []uint64{0x1234567890abcdef}}
		for _, dp := range []struct {
			name string
			r    DPRanks
		}{{"noDP", DPRanks{}}, {"DP", DPRanks{Prefill: intp(2), Decode: intp(5)}}} {
			b.Run(size.name+"/"+dp.name, func(b *testing.B) {
				b.SetBytes(int64(len(body)))
				b.ReportAllocs()
				for b.Loop() {
					if _, _, err := BuildLegs(req, bs, dp.r); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}

func BenchmarkParseRequest(b *testing.B) {
	route, _ := LookupRoute("/v1/chat/completions")
	for _, size := range []struct {
		name string
		n    int
	}{{"1KB", 1 << 10}, {"400KB", 400 << 10}, {"10MB", 10 << 20}} {
		body := chatBody(size.n)
		b.Run(size.name, func(b *testing.B) {
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for b.Loop() {
				if _, err := ParseRequest(route, body); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func BenchmarkJSONValidBaseline(b *testing.B) {
	body := chatBody(400 << 10)
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		if !json.Valid(body) {
			b.Fatal("invalid")
		}
	}
}

func FuzzBuildLegs(f *testing.F) {
	seeds := []string{
		`{"text":"hi"}`, `{"input_ids":[[1],[2]],"bootstrap_room":1}`, `{"messages":[{"role":"user","content":"x"}],"n":3}`,
		`{"prompt":["a","b"],"bootstrap_room":[1],"bootstrap_room":2}`, ` { } `, `{"model":"m","routed_dp_rank":3}`,
		`{"\u0062ootstrap_host":"x","text":["a"]}`, `[1]`, `{"a":`,
	}
	for i, s := range seeds {
		f.Add([]byte(s), uint8(i))
	}
	port, pr, dr := 8998, 2, 5
	owned := map[string]bool{}
	for _, k := range ownedNames {
		owned[k] = true
	}
	f.Fuzz(func(t *testing.T, body []byte, ri uint8) {
		route := Routes()[int(ri)%len(routeTable)]
		req, err := ParseRequest(route, body)
		if err != nil {
			return
		}
		var in map[string]json.RawMessage
		if err := json.Unmarshal(body, &in); err != nil {
			t.Fatalf("accepted invalid body %q: %v", body, err)
		}
		rooms := make([]uint64, max(req.BatchSize, 1))
		for i := range rooms {
			rooms[i] = uint64(i + 1)
		}
		bs := Bootstrap{Host: "h", Port: &port, Rooms: rooms, Model: "canon"}
		dp := DPRanks{Prefill: &pr, Decode: &dr}
		p, d, err := BuildLegs(req, bs, dp)
		if err != nil {
			t.Fatalf("BuildLegs(%q): %v", body, err)
		}
		slow := &Request{Route: req.Route, Raw: req.Raw, BatchSize: req.BatchSize, Model: req.Model}
		sp, sd, err := BuildLegs(slow, bs, dp)
		if err != nil || !bytes.Equal(p, sp) || !bytes.Equal(d, sd) {
			t.Fatalf("fast and general paths differ for %q:\n%s\n%s\n%v", body, p, sp, err)
		}
		for _, leg := range [][]byte{p, d} {
			if leg == nil {
				continue
			}
			var out map[string]json.RawMessage
			if err := json.Unmarshal(leg, &out); err != nil {
				t.Fatalf("invalid leg %q from %q: %v", leg, body, err)
			}
			for k, v := range in {
				if !owned[k] && !bytes.Equal(out[k], v) {
					t.Fatalf("key %q changed: %q -> %q", k, v, out[k])
				}
			}
			if !route.PrefillOnly {
				room, _ := TopLevel(leg, "bootstrap_room")
				if req.BatchSize == 0 && string(room) != "1" {
					t.Fatalf("room %q in %q", room, leg)
				}
			}
		}
	})
}
