package common

import (
	"bytes"
	"encoding/json"
	"fmt"
	"time"
)

// Helpers for applying the optional fields of a POST /_fake/config patch.

// PatchValue sets *dst to *v when v is not nil.
func PatchValue[T any](v *T, dst *T) {
	if v != nil {
		*dst = *v
	}
}

// PatchMS sets *dst to *v milliseconds when v is not nil.
func PatchMS(v *int64, dst *time.Duration) {
	if v != nil {
		*dst = time.Duration(*v) * time.Millisecond
	}
}

// PatchFailStatus sets *dst to *v when v is not nil; *v must be 0 (no
// injected failure) or an HTTP status (100-599).
func PatchFailStatus(v *int, dst *int) error {
	if v == nil {
		return nil
	}
	if *v != 0 && (*v < 100 || *v > 599) {
		return fmt.Errorf("fail_status %d is not an HTTP status", *v)
	}
	*dst = *v
	return nil
}

// PatchFailBody sets *dst from a fail_body value when one is given: a JSON
// string is used as is, null clears it, and any other JSON value is kept as
// its JSON text.
func PatchFailBody(v json.RawMessage, dst *string) error {
	if len(v) == 0 {
		return nil
	}
	raw := bytes.TrimSpace(v)
	switch {
	case len(raw) > 0 && raw[0] == '"':
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return fmt.Errorf("fail_body: %w", err)
		}
		*dst = s
	case string(raw) == "null":
		*dst = ""
	default:
		*dst = string(raw)
	}
	return nil
}
