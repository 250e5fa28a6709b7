package pd

import (
	"errors"
	"fmt"
)

// KV is one top-level key and the raw JSON text of its value.
type KV struct {
	Key   string
	Value []byte
}

var errNotObject = errors.New("body is not a JSON object")

// objectStart returns the index of the opening brace of the object in b.
func objectStart(b []byte) (int, error) {
	i := skipWS(b, 0)
	if i >= len(b) {
		return i, errEOF(i)
	}
	if b[i] != '{' {
		return i, errNotObject
	}
	return i, nil
}

// SetTopLevel sets top-level keys of the JSON object body to raw JSON values.
// The first occurrence of a key has its value replaced in place, later
// duplicates of it are removed (JSON parsers disagree on which duplicate wins,
// so we leave exactly one), and absent keys are appended before the closing
// brace in kvs order. If kvs names a key twice the later value wins. Every
// other byte of body is preserved. The result never aliases body.
func SetTopLevel(body []byte, kvs ...KV) ([]byte, error) {
	return EditTopLevel(body, kvs, nil)
}

// RemoveTopLevel deletes every occurrence of the given top-level keys,
// preserving every other byte. The result never aliases body.
func RemoveTopLevel(body []byte, keys ...string) ([]byte, error) {
	return EditTopLevel(body, nil, keys)
}

// EditTopLevel applies SetTopLevel(set) and RemoveTopLevel(remove) in one
// pass and one copy (a key in both is set). Use it to rewrite large bodies.
func EditTopLevel(body []byte, set []KV, remove []string) ([]byte, error) {
	for _, kv := range set {
		if err := checkDoc(kv.Value); err != nil {
			return nil, fmt.Errorf("pd: value for key %q: %w", kv.Key, err)
		}
	}
	return editObject(body, set, remove, false)
}

// TopLevel returns the raw value of a top-level key of the JSON object body.
// With duplicate keys the last one is returned, as most JSON parsers
// (Python's, Go's, serde_json's maps) keep the last. ok is false if the key
// is absent or body is not a valid JSON object.
func TopLevel(body []byte, key string) (raw []byte, ok bool) {
	return topLevel(body, key, false)
}

// topLevel is TopLevel; trusted skips validation of bytes validated before.
func topLevel(body []byte, key string, trusted bool) (raw []byte, ok bool) {
	open, err := objectStart(body)
	if err != nil {
		return nil, false
	}
	it := newObjIter(body, open)
	it.trusted = trusted
	for it.next() {
		if keyEquals(body, it.m, key) {
			raw, ok = body[it.m.vs:it.m.ve], true
		}
	}
	if it.err != nil || skipWS(body, it.end) != len(body) {
		return nil, false
	}
	return raw, ok
}

func keyEquals(b []byte, m member, key string) bool {
	if !m.esc {
		return string(m.rawKey(b)) == key
	}
	return string(m.keyBytes(b)) == key
}

// lastSet returns the index of the last kv in set named key, or -1.
func lastSet(set []KV, key []byte) int {
	for j := len(set) - 1; j >= 0; j-- {
		if set[j].Key == string(key) {
			return j
		}
	}
	return -1
}

// laterDup reports whether a later kv in set has the same key as set[j].
func laterDup(set []KV, j int) bool {
	for k := j + 1; k < len(set); k++ {
		if set[k].Key == set[j].Key {
			return true
		}
	}
	return false
}

func inList(list []string, key []byte) bool {
	for _, k := range list {
		if k == string(key) {
			return true
		}
	}
	return false
}

// editObject is the general single-pass editor. It copies body into a new
// buffer, cutting and splicing at member boundaries so the separators that
// remain are the client's own bytes. trusted skips re-validating values of a
// body validated before.
func editObject(b []byte, set []KV, remove []string, trusted bool) ([]byte, error) {
	open, err := objectStart(b)
	if err != nil {
		return nil, fmt.Errorf("pd: edit JSON object: %w", err)
	}
	var foundBuf [16]bool
	var found []bool
	if len(set) > len(foundBuf) {
		found = make([]bool, len(set))
	} else {
		found = foundBuf[:len(set)]
	}
	extra := 0
	for _, kv := range set {
		extra += len(kv.Key) + len(kv.Value) + 8
	}
	out := make([]byte, 0, len(b)+extra)

	cursor := 0         // b[:cursor] has been handled
	prevEnd := open + 1 // end of the previous member's value, or just after '{'
	first, emitted := true, false
	it := newObjIter(b, open)
	it.trusted = trusted
	for it.next() {
		m := it.m
		key := m.keyBytes(b)
		j := lastSet(set, key)
		drop := false
		switch {
		case j >= 0 && !found[j]:
			found[j] = true
		case j >= 0:
			drop = true // later duplicate of a key we set
		case inList(remove, key):
			drop = true
		}
		if drop {
			// Cut the member together with the separator before it. The
			// first member has no separator before it; the one after it is
			// cut when the next kept member is reached (below).
			if first {
				out = append(out, b[cursor:m.ks]...)
			} else {
				out = append(out, b[cursor:prevEnd]...)
			}
			cursor = m.ve
		} else {
			if !first && !emitted {
				// Everything before was cut: drop the ',' separator too.
				out = append(out, b[cursor:prevEnd]...)
				cursor = m.ks
			}
			if j >= 0 {
				out = append(out, b[cursor:m.vs]...)
				out = append(out, set[j].Value...)
				cursor = m.ve
			}
			emitted = true
		}
		prevEnd, first = m.ve, false
	}
	if it.err != nil {
		return nil, fmt.Errorf("pd: edit JSON object: %w", it.err)
	}
	if j := skipWS(b, it.end); j != len(b) {
		return nil, fmt.Errorf("pd: edit JSON object: %w", errChar(b[j], "after top-level value", j))
	}
	out = append(out, b[cursor:prevEnd]...)
	cursor = prevEnd
	for j, kv := range set {
		if found[j] || laterDup(set, j) {
			continue
		}
		if emitted {
			out = append(out, ',')
		}
		out = appendJSONString(out, kv.Key)
		out = append(out, ':')
		out = append(out, kv.Value...)
		emitted = true
	}
	return append(out, b[cursor:]...), nil
}
