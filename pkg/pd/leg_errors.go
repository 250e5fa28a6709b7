package pd

import (
	"fmt"
	"net/http"
	"strconv"
	"strings"

	"github.com/smg-project/smg-extproc/pkg/apierr"
)

// Leg error codes (SMG §1.7). Statuses 400/404/500/502/503 keep their
// specific code; any other non-2xx becomes 500 with the generic one.
const (
	CodePrefillBadRequest    = "prefill_bad_request"
	CodePrefillNotFound      = "prefill_not_found"
	CodePrefillInternalError = "prefill_internal_error"
	CodePrefillUnavailable   = "prefill_unavailable"
	CodePrefillBadGateway    = "prefill_bad_gateway"
	CodePrefillError         = "prefill_error"

	CodeDecodeBadRequest    = "decode_bad_request"
	CodeDecodeNotFound      = "decode_not_found"
	CodeDecodeInternalError = "decode_internal_error"
	CodeDecodeUnavailable   = "decode_unavailable"
	CodeDecodeBadGateway    = "decode_bad_gateway"
	CodeDecodeError         = "decode_error"
	CodeDecodeReadFailed    = "decode_read_failed"
)

// legCode maps an upstream status to the status we answer and its code.
func legCode(status int, prefill bool) (int, string) {
	type pair struct{ prefill, decode string }
	var p pair
	switch status {
	case http.StatusBadRequest:
		p = pair{CodePrefillBadRequest, CodeDecodeBadRequest}
	case http.StatusNotFound:
		p = pair{CodePrefillNotFound, CodeDecodeNotFound}
	case http.StatusInternalServerError:
		p = pair{CodePrefillInternalError, CodeDecodeInternalError}
	case http.StatusServiceUnavailable:
		p = pair{CodePrefillUnavailable, CodeDecodeUnavailable}
	case http.StatusBadGateway:
		p = pair{CodePrefillBadGateway, CodeDecodeBadGateway}
	default:
		status, p = http.StatusInternalServerError, pair{CodePrefillError, CodeDecodeError}
	}
	if prefill {
		return status, p.prefill
	}
	return status, p.decode
}

// lossy renders an upstream body as text, replacing invalid UTF-8.
func lossy(body []byte) string { return strings.ToValidUTF8(string(body), "\uFFFD") }

// PrefillError maps a non-2xx prefill response. The message keeps the
// original status even when the answer is remapped to 500.
func PrefillError(status int, body []byte) *apierr.Error {
	st, code := legCode(status, true)
	return apierr.Newf(st, code, "Prefill server error (%d %s): %s", status, apierr.ReasonPhrase(status), lossy(body))
}

// DecodeError maps a non-2xx decode response to a non-streamed request. The
// message is the upstream error.message, else a top-level message, else the
// raw body text.
func DecodeError(status int, body []byte) *apierr.Error {
	st, code := legCode(status, false)
	return apierr.New(st, code, upstreamMessage(body))
}

// DecodeReadError is DecodeError when the non-2xx decode body could not be read.
func DecodeReadError(status int, err error) *apierr.Error {
	st, _ := legCode(status, false)
	return apierr.Wrap(err, st, CodeDecodeReadFailed, fmt.Sprintf("Decode server error: %v", err))
}

func upstreamMessage(body []byte) string {
	if i := skipWS(body, 0); i < len(body) && body[i] == '{' && validDoc(body) {
		if e, ok := topLevel(body, "error", true); ok && e[0] == '{' {
			if m, ok := topLevel(e, "message", true); ok && m[0] == '"' {
				return decodeString(m)
			}
		}
		if m, ok := topLevel(body, "message", true); ok && m[0] == '"' {
			return decodeString(m)
		}
	}
	return lossy(body)
}

// DecodeStreamErrorFrame is the single SSE frame sent (with the decode's own
// status) when the decode leg of a streamed request fails:
// `data: {"error":{"message":<body as JSON if it parses, else as a string>,"status":<int>}}` + "\n\n".
// A JSON body is compacted so it stays on one SSE line.
func DecodeStreamErrorFrame(status int, body []byte) []byte {
	out := make([]byte, 0, len(body)+64)
	out = append(out, `data: {"error":{"message":`...)
	if validDoc(body) {
		out = appendCompact(out, body)
	} else {
		out = appendJSONString(out, string(body))
	}
	out = append(out, `,"status":`...)
	out = strconv.AppendInt(out, int64(status), 10)
	return append(out, "}}\n\n"...)
}

// TransportError is the 502 for a connect/send failure on either leg.
func TransportError(err error) *apierr.Error {
	msg := "Transport error: <nil>"
	if err != nil {
		msg = "Transport error: " + err.Error()
	}
	return apierr.Wrap(err, http.StatusBadGateway, apierr.CodeTransportFailed, msg)
}

// appendCompact appends validated JSON src without insignificant whitespace,
// copying strings and numbers verbatim.
func appendCompact(dst, src []byte) []byte {
	for i := 0; i < len(src); {
		switch src[i] {
		case ' ', '\t', '\n', '\r':
			i++
		case '"':
			end, _, err := scanString(src, i)
			if err != nil { // not reachable for validated input; keep the rest
				return append(dst, src[i:]...)
			}
			dst = append(dst, src[i:end]...)
			i = end
		default:
			start := i
			for i < len(src) {
				c := src[i]
				if c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '"' {
					break
				}
				i++
			}
			dst = append(dst, src[start:i]...)
		}
	}
	return dst
}
