package common_test

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/smg-project/smg-extproc/pkg/fake/common"
)

func TestPatchHelpers(t *testing.T) {
	var body string
	for _, tc := range []struct{ in, want string }{
		{`"x y"`, "x y"}, {` null `, ""}, {`{"a":1}`, `{"a":1}`}, {`7`, "7"},
	} {
		require.NoError(t, common.PatchFailBody(json.RawMessage(tc.in), &body))
		assert.Equal(t, tc.want, body, tc.in)
	}
	require.NoError(t, common.PatchFailBody(nil, &body))
	assert.Equal(t, "7", body, "absent: unchanged")

	status := 500
	for _, v := range []int{99, 600, -1} {
		require.Error(t, common.PatchFailStatus(&v, &status))
	}
	assert.Equal(t, 500, status)
	zero := 0
	require.NoError(t, common.PatchFailStatus(&zero, &status))
	assert.Equal(t, 0, status)

	d := time.Second
	common.PatchMS(nil, &d)
	assert.Equal(t, time.Second, d)
	ms := int64(250)
	common.PatchMS(&ms, &d)
	assert.Equal(t, 250*time.Millisecond, d)
}

func TestJSONHelpers(t *testing.T) {
	assert.True(t, common.IsNull(json.RawMessage(" null")))
	assert.True(t, common.IsNull(nil))
	assert.Equal(t, byte('{'), common.FirstByte(json.RawMessage("  {}")))
	for in, want := range map[string]string{`"s"`: "str", `{}`: "dict", `[]`: "list", `true`: "bool", `null`: "NoneType", `1.5`: "float", `1e3`: "float", `12`: "int"} {
		assert.Equal(t, want, common.JSONType(json.RawMessage(in)), in)
	}
	assert.Equal(t, strings.Repeat("a", 80)+"...", common.InputValue(json.RawMessage(strings.Repeat("a", 81))))
	for in, want := range map[string]string{`null`: "", `"hi"`: "hi", `[{"text":"a"},{"type":"image"},{"text":1},{"text":"b"}]`: "a\nb"} {
		got, ok := common.ContentText(json.RawMessage(in))
		assert.True(t, ok, in)
		assert.Equal(t, want, got, in)
	}
	_, ok := common.ContentText(json.RawMessage(`{}`))
	assert.False(t, ok)
}

func TestSettings(t *testing.T) {
	type cfg struct {
		Port   int
		Window time.Duration
	}
	s := common.NewSettings(cfg{Window: time.Hour}, func(c cfg) time.Duration { return c.Window })
	assert.False(t, s.Starting())
	s.Started(func(c *cfg) { c.Port = 7 })
	assert.True(t, s.Starting())
	c, err := s.Update(func(c cfg) (cfg, error) { c.Window = 0; return c, nil }, func(o, n cfg) bool { return o.Window != n.Window })
	require.NoError(t, err)
	assert.Equal(t, cfg{Port: 7}, c)
	assert.False(t, s.Starting())
	_, err = s.Update(func(c cfg) (cfg, error) { return cfg{}, io.EOF }, func(cfg, cfg) bool { return true })
	require.ErrorIs(t, err, io.EOF)
	assert.Equal(t, cfg{Port: 7}, s.Get())
	s.Reset()
	assert.Equal(t, cfg{Port: 7, Window: time.Hour}, s.Get(), "Reset restores the initial config with the pinned port")
	assert.False(t, s.Starting())
}

func TestLifecycle(t *testing.T) {
	hooked := 0
	l := common.NewLifecycle("test fake", func() { hooked++ })
	require.NoError(t, l.Begin())
	require.EqualError(t, l.Begin(), "test fake: already started")
	ln, port, err := common.ListenTCP(t.Context(), "127.0.0.1", 0)
	require.NoError(t, err)
	mux := http.NewServeMux()
	common.HandleIntrospection(mux, common.Introspection[struct{ N *int }]{
		Requests:   func() []common.RecordedRequest { return nil },
		Events:     func() []common.Event { return nil },
		State:      func() any { return "state" },
		Config:     func() any { return "config" },
		Patch:      func(p struct{ N *int }) (any, error) { return *p.N, nil },
		Reset:      func() {},
		BadRequest: func(msg string) any { return common.MessageError(msg) },
	})
	ctx, cancel := context.WithCancel(context.Background())
	l.Serve(ctx, zerolog.Nop(), common.Listener{Ln: ln, Handler: mux})
	url := common.HTTPURL("127.0.0.1", port)

	res, err := http.Post(url+"/_fake/config", "application/json", strings.NewReader(`{"N":3}`))
	require.NoError(t, err)
	b, _ := io.ReadAll(res.Body)
	_ = res.Body.Close()
	assert.Equal(t, "3", string(b))
	res, err = http.Post(url+"/_fake/config", "application/json", strings.NewReader(`{"M":3}`))
	require.NoError(t, err)
	_ = res.Body.Close()
	assert.Equal(t, http.StatusBadRequest, res.StatusCode)

	ran := make(chan struct{})
	require.True(t, l.Go(func(ctx context.Context) { <-ctx.Done(); close(ran) }))
	cancel() // a done context closes the lifecycle
	<-ran
	require.NoError(t, l.Close())
	assert.Equal(t, 1, hooked)
	assert.False(t, l.Go(func(context.Context) {}), "no background work once closed")
	_, err = http.Get(url + "/_fake/state")
	assert.Error(t, err)

	rec := httptest.NewRecorder()
	common.WriteFailBody(rec, 503, "down")
	assert.Equal(t, "text/plain; charset=utf-8", rec.Header().Get("Content-Type"))
}
