package common

import (
	"bytes"
	"encoding/json"
	"strings"
)

// Helpers for validating raw JSON request fields the way the Python engines
// (pydantic) do.

// IsNull reports whether raw is empty or the JSON null.
func IsNull(raw json.RawMessage) bool {
	raw = bytes.TrimSpace(raw)
	return len(raw) == 0 || string(raw) == "null"
}

// FirstByte is the first non-space byte of raw (0 if none).
func FirstByte(raw json.RawMessage) byte {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 {
		return 0
	}
	return raw[0]
}

// JSONType is the Python type name of the JSON value raw (pydantic's
// input_type): str, dict, list, bool, NoneType, float or int.
func JSONType(raw json.RawMessage) string {
	switch c := FirstByte(raw); {
	case c == '"':
		return "str"
	case c == '{':
		return "dict"
	case c == '[':
		return "list"
	case c == 't' || c == 'f':
		return "bool"
	case c == 'n' || c == 0:
		return "NoneType"
	case strings.ContainsAny(string(bytes.TrimSpace(raw)), ".eE"):
		return "float"
	default:
		return "int"
	}
}

// InputValue is raw as pydantic's input_value: its text, cut to 80 bytes
// followed by "..." when longer.
func InputValue(raw json.RawMessage) string {
	in := string(bytes.TrimSpace(raw))
	if len(in) > 80 {
		in = in[:80] + "..."
	}
	return in
}

// ContentText is the text of a chat message content: a string, or the
// "text" fields of a list of content parts joined by newlines (null: "").
// ok is false when raw is neither.
func ContentText(raw json.RawMessage) (text string, ok bool) {
	if IsNull(raw) {
		return "", true
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s, true
	}
	var parts []map[string]json.RawMessage
	if json.Unmarshal(raw, &parts) != nil {
		return "", false
	}
	var texts []string
	for _, p := range parts {
		var t string
		if v, ok := p["text"]; ok && !IsNull(v) && json.Unmarshal(v, &t) == nil {
			texts = append(texts, t)
		}
	}
	return strings.Join(texts, "\n"), true
}
