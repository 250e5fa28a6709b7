package fleet

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
)

// Runtime names returned by DetectRuntime.
const (
	RuntimeSGLang = "sglang"
	RuntimeVLLM   = "vllm"
)

// maxModelsBody bounds the /v1/models document we parse; a listing larger
// than this is treated as unparseable and detection falls through.
const maxModelsBody = 1 << 20

// DetectRuntime identifies a worker's engine the way SMG does at HTTP
// registration (reference §1.1):
//
//  1. GET /v1/models: an owned_by of "sglang" or "nvidia" means sglang,
//     "vllm" means vllm (the first recognised entry wins);
//  2. otherwise GET /version: any 2xx means vllm;
//  3. otherwise GET /server_info: any 2xx means sglang;
//  4. otherwise sglang.
//
// Every probe carries the worker's bearer token when apiKey is set. The
// error is non-nil only when every probe failed at the transport level (the
// worker is unreachable); the runtime is then still "sglang" and the error
// lists each attempt so the caller can log why detection fell back. Bound the
// whole detection with ctx (or the client's Timeout).
func DetectRuntime(ctx context.Context, client *http.Client, baseURL, apiKey string) (string, error) {
	if client == nil {
		client = &http.Client{}
	}
	base := strings.TrimRight(baseURL, "/")
	var transportErrs []error

	status, body, err := getBody(ctx, client, base+"/v1/models", apiKey, maxModelsBody)
	switch {
	case err != nil:
		transportErrs = append(transportErrs, fmt.Errorf("GET /v1/models: %w", err))
	case is2xx(status):
		if rt := runtimeFromModels(body); rt != "" {
			return rt, nil
		}
	}

	status, _, err = getBody(ctx, client, base+"/version", apiKey, 0)
	switch {
	case err != nil:
		transportErrs = append(transportErrs, fmt.Errorf("GET /version: %w", err))
	case is2xx(status):
		return RuntimeVLLM, nil
	}

	status, _, err = getBody(ctx, client, base+"/server_info", apiKey, 0)
	switch {
	case err != nil:
		transportErrs = append(transportErrs, fmt.Errorf("GET /server_info: %w", err))
	case is2xx(status):
		return RuntimeSGLang, nil
	}

	if len(transportErrs) == 3 {
		return RuntimeSGLang, fmt.Errorf("detect runtime of %s: worker unreachable, defaulting to %s: %w",
			base, RuntimeSGLang, errors.Join(transportErrs...))
	}
	return RuntimeSGLang, nil
}

func is2xx(status int) bool { return status >= 200 && status <= 299 }

// runtimeFromModels reads owned_by from an OpenAI model list; "" when the
// document says nothing recognisable.
func runtimeFromModels(body []byte) string {
	var doc struct {
		Data []struct {
			OwnedBy string `json:"owned_by"`
		} `json:"data"`
	}
	if err := json.Unmarshal(body, &doc); err != nil {
		return ""
	}
	for _, m := range doc.Data {
		switch strings.ToLower(strings.TrimSpace(m.OwnedBy)) {
		case "sglang", "nvidia":
			return RuntimeSGLang
		case "vllm":
			return RuntimeVLLM
		}
	}
	return ""
}
