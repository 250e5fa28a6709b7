package pd

import (
	"bytes"
	"unicode/utf8"
)

// The /generate logprob merge (SMG §1.6): the decode's
// meta_info.input_token_logprobs becomes prefill ++ decode. Only
// SGLang-shaped (meta_info) bodies are merged; OpenAI-shaped logprobs never
// are. Edits are byte splices, so every other field and number of the decode
// body is kept exactly; the result is then compacted, as SMG re-serializes.

// MergeLogprobs merges a non-streamed /generate response. Batched responses
// (JSON lists) are merged element-wise when both lists have the same length.
// ok reports whether anything was merged; otherwise (either body not JSON,
// shapes differ, or an array is missing) decodeBody is returned unchanged.
func MergeLogprobs(prefillBody, decodeBody []byte) (merged []byte, ok bool) {
	if !validDoc(prefillBody) || !validDoc(decodeBody) {
		return decodeBody, false
	}
	p := prefillBody[skipWS(prefillBody, 0):]
	d := decodeBody[skipWS(decodeBody, 0):]
	switch {
	case p[0] == '{' && d[0] == '{':
		arr := logprobsArray(p)
		if arr == nil {
			return decodeBody, false
		}
		out, ok := mergeInto(arr, d)
		if !ok {
			return decodeBody, false
		}
		return appendCompact(make([]byte, 0, len(out)), out), true
	case p[0] == '[' && d[0] == '[':
		return mergeLists(p, d, decodeBody)
	}
	return decodeBody, false
}

func mergeLists(p, d, decodeBody []byte) ([]byte, bool) {
	var pBuf, dBuf [16]span
	pe, de := elems(p, pBuf[:0]), elems(d, dBuf[:0])
	if len(pe) != len(de) {
		return decodeBody, false
	}
	out := make([]byte, 0, len(d)+len(p))
	out = append(out, '[')
	mergedAny := false
	for i := range de {
		if i > 0 {
			out = append(out, ',')
		}
		pv, dv := p[pe[i].s:pe[i].e], d[de[i].s:de[i].e]
		if pv[0] == '{' && dv[0] == '{' {
			if arr := logprobsArray(pv); arr != nil {
				if m, ok := mergeInto(arr, dv); ok {
					out = append(out, m...)
					mergedAny = true
					continue
				}
			}
		}
		out = append(out, dv...)
	}
	if !mergedAny {
		return decodeBody, false
	}
	out = append(out, ']')
	return appendCompact(make([]byte, 0, len(out)), out), true
}

// elems lists the element spans of the validated array b.
func elems(b []byte, dst []span) []span {
	it := trustedArrIter(b, skipWS(b, 0))
	for it.next() {
		dst = append(dst, span{it.vs, it.ve})
	}
	return dst
}

// logprobsArray returns meta_info.input_token_logprobs of the validated JSON
// object doc if it is an array, else nil.
func logprobsArray(doc []byte) []byte {
	meta, ok := topLevel(doc, "meta_info", true)
	if !ok || meta[0] != '{' {
		return nil
	}
	arr, ok := topLevel(meta, "input_token_logprobs", true)
	if !ok || arr[0] != '[' {
		return nil
	}
	return arr
}

// mergeInto prepends the elements of prefillArr to the validated doc's
// meta_info.input_token_logprobs; the result is not compacted.
func mergeInto(prefillArr, doc []byte) ([]byte, bool) {
	meta, ok := topLevel(doc, "meta_info", true)
	if !ok || meta[0] != '{' {
		return nil, false
	}
	arr, ok := topLevel(meta, "input_token_logprobs", true)
	if !ok || arr[0] != '[' {
		return nil, false
	}
	newMeta, err := editObject(meta, []KV{{Key: "input_token_logprobs", Value: concatArrays(prefillArr, arr)}}, nil, true)
	if err != nil {
		return nil, false
	}
	out, err := editObject(doc, []KV{{Key: "meta_info", Value: newMeta}}, nil, true)
	if err != nil {
		return nil, false
	}
	return out, true
}

// concatArrays joins two JSON arrays' elements: [a..., b...].
func concatArrays(a, b []byte) []byte {
	ai := bytes.TrimSpace(a[1 : len(a)-1])
	bi := bytes.TrimSpace(b[1 : len(b)-1])
	out := make([]byte, 0, len(ai)+len(bi)+3)
	out = append(out, '[')
	out = append(out, ai...)
	if len(ai) > 0 && len(bi) > 0 {
		out = append(out, ',')
	}
	out = append(out, bi...)
	return append(out, ']')
}

// PrefillLogprobs extracts meta_info.input_token_logprobs (a copy) from a
// prefill body that is exactly one JSON object, for MergeLogprobsChunk. It
// returns nil otherwise, notably for an SSE prefill body, which is what a
// streamed request gets, since both legs share the "stream" flag.
func PrefillLogprobs(prefillBody []byte) []byte {
	if !validDoc(prefillBody) {
		return nil
	}
	p := prefillBody[skipWS(prefillBody, 0):]
	if p[0] != '{' {
		return nil
	}
	return bytes.Clone(logprobsArray(p))
}

// MergeLogprobsChunk applies the prefill array (from PrefillLogprobs) to one
// decode network chunk: if the chunk starts with "data: ", is valid UTF-8,
// and the rest (trimmed) is one JSON object whose
// meta_info.input_token_logprobs is an array, it is re-emitted as
// "data: <compact json>\n\n" with the prefill entries prepended. Any other
// chunk ([DONE], several events, a split event) is returned unchanged.
func MergeLogprobsChunk(prefillArr []byte, chunk []byte) []byte {
	const prefix = "data: "
	if len(prefillArr) < 2 || prefillArr[0] != '[' || prefillArr[len(prefillArr)-1] != ']' {
		return chunk
	}
	if !bytes.HasPrefix(chunk, []byte(prefix)) || !utf8.Valid(chunk) {
		return chunk
	}
	rest := bytes.TrimSpace(chunk[len(prefix):])
	if len(rest) == 0 || rest[0] != '{' || !validDoc(rest) {
		return chunk
	}
	doc, ok := mergeInto(prefillArr, rest)
	if !ok {
		return chunk
	}
	out := make([]byte, 0, len(prefix)+len(doc)+2)
	out = append(out, prefix...)
	out = appendCompact(out, doc)
	return append(out, "\n\n"...)
}
