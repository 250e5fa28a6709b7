package fleet

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

type cannedResponse struct {
	status int
	body   string
}

// engineServer mimics an engine: paths not in routes answer 404.
func engineServer(t *testing.T, routes map[string]cannedResponse) (*httptest.Server, func() []string) {
	var mu sync.Mutex
	var seen []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		seen = append(seen, r.URL.Path+" "+r.Header.Get("Authorization"))
		mu.Unlock()
		resp, ok := routes[r.URL.Path]
		if !ok {
			http.NotFound(w, r)
			return
		}
		w.WriteHeader(resp.status)
		_, _ = w.Write([]byte(resp.body))
	}))
	t.Cleanup(srv.Close)
	return srv, func() []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), seen...)
	}
}

func models(ownedBy ...string) cannedResponse {
	body := `{"object":"list","data":[`
	for i, o := range ownedBy {
		if i > 0 {
			body += ","
		}
		body += `{"id":"m` + o + `","object":"model","owned_by":"` + o + `"}`
	}
	return cannedResponse{200, body + `]}`}
}

func TestDetectRuntime(t *testing.T) {
	ok := cannedResponse{200, `{}`}
	tests := []struct {
		name      string
		routes    map[string]cannedResponse
		want      string
		wantPaths []string
	}{
		{"sglang owned_by", map[string]cannedResponse{"/v1/models": models("sglang")},
			RuntimeSGLang, []string{"/v1/models"}},
		{"nvidia owned_by means sglang", map[string]cannedResponse{"/v1/models": models("nvidia")},
			RuntimeSGLang, []string{"/v1/models"}},
		{"vllm owned_by", map[string]cannedResponse{"/v1/models": models("vllm"), "/server_info": ok},
			RuntimeVLLM, []string{"/v1/models"}},
		{"first recognised owner wins", map[string]cannedResponse{"/v1/models": models("someone", "VLLM")},
			RuntimeVLLM, []string{"/v1/models"}},
		{"unknown owner then /version means vllm", map[string]cannedResponse{"/v1/models": models("openai"), "/version": ok, "/server_info": ok},
			RuntimeVLLM, []string{"/v1/models", "/version"}},
		{"no models then /version means vllm", map[string]cannedResponse{"/version": ok},
			RuntimeVLLM, []string{"/v1/models", "/version"}},
		{"bad models JSON falls through", map[string]cannedResponse{"/v1/models": {200, "not json"}, "/version": ok},
			RuntimeVLLM, []string{"/v1/models", "/version"}},
		{"non-2xx models ignored even with owned_by", map[string]cannedResponse{"/v1/models": {500, models("vllm").body}, "/server_info": ok},
			RuntimeSGLang, []string{"/v1/models", "/version", "/server_info"}},
		{"/server_info means sglang", map[string]cannedResponse{"/version": {500, ""}, "/server_info": ok},
			RuntimeSGLang, []string{"/v1/models", "/version", "/server_info"}},
		{"nothing answers: default sglang", map[string]cannedResponse{},
			RuntimeSGLang, []string{"/v1/models", "/version", "/server_info"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv, seen := engineServer(t, tt.routes)
			got, err := DetectRuntime(t.Context(), srv.Client(), srv.URL+"/", "k1")
			require.NoError(t, err)
			assert.Equal(t, tt.want, got)
			var want []string
			for _, p := range tt.wantPaths {
				want = append(want, p+" Bearer k1")
			}
			assert.Equal(t, want, seen())
		})
	}
}

func TestDetectRuntimeNoAPIKey(t *testing.T) {
	srv, seen := engineServer(t, map[string]cannedResponse{"/v1/models": models("sglang")})
	got, err := DetectRuntime(t.Context(), srv.Client(), srv.URL, "")
	require.NoError(t, err)
	assert.Equal(t, RuntimeSGLang, got)
	assert.Equal(t, []string{"/v1/models "}, seen())
}

func TestDetectRuntimeUnreachable(t *testing.T) {
	srv := httptest.NewServer(http.NotFoundHandler())
	url := srv.URL
	srv.Close()

	got, err := DetectRuntime(t.Context(), &http.Client{Timeout: 2 * time.Second}, url, "")
	assert.Equal(t, RuntimeSGLang, got)
	require.Error(t, err)
	for _, want := range []string{"unreachable", "/v1/models", "/version", "/server_info"} {
		assert.ErrorContains(t, err, want)
	}
}

func TestDetectRuntimeCancelled(t *testing.T) {
	srv, _ := engineServer(t, map[string]cannedResponse{"/version": {200, ""}})
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	got, err := DetectRuntime(ctx, srv.Client(), srv.URL, "")
	assert.Equal(t, RuntimeSGLang, got)
	assert.ErrorIs(t, err, context.Canceled)
}
