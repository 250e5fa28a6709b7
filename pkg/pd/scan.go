package pd

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"strings"
	"unicode/utf16"
	"unicode/utf8"
)

// This file holds a small validating JSON scanner. It never builds a tree: it
// reports byte spans so callers can edit the client's bytes in place, which
// keeps numbers, key order and unknown fields exactly as the client sent them.

// maxDepth bounds nesting like encoding/json does, so hostile input cannot
// grow the container stack without limit.
const maxDepth = 10000

// syntaxError reports malformed JSON and where it was detected.
type syntaxError struct {
	msg string
	off int
}

func (e *syntaxError) Error() string { return fmt.Sprintf("%s at offset %d", e.msg, e.off) }

func errAt(msg string, off int) error { return &syntaxError{msg: msg, off: off} }

func errEOF(off int) error { return errAt("unexpected end of JSON input", off) }

func errChar(c byte, context string, off int) error {
	return errAt(fmt.Sprintf("invalid character %q %s", c, context), off)
}

func skipWS(b []byte, i int) int {
	for i < len(b) {
		switch b[i] {
		case ' ', '\t', '\n', '\r':
			i++
		default:
			return i
		}
	}
	return i
}

func isDigit(c byte) bool { return '0' <= c && c <= '9' }

func isHex(c byte) bool {
	return isDigit(c) || ('a' <= c && c <= 'f') || ('A' <= c && c <= 'F')
}

// SWAR helpers: test 8 string bytes at once for anything that needs the slow
// path (quote, backslash, control byte, non-ASCII). Long prompts are mostly
// plain ASCII, so this is where ParseRequest spends its time.
const (
	swarOnes = 0x0101010101010101
	swarHigh = 0x8080808080808080
)

func swarZero(x uint64) uint64 { return (x - swarOnes) & ^x & swarHigh }

func swarSpecial(x uint64) uint64 {
	return ((x - swarOnes*0x20) & ^x & swarHigh) | // byte < 0x20
		swarZero(x^(swarOnes*'"')) |
		swarZero(x^(swarOnes*'\\')) |
		(x & swarHigh) // non-ASCII
}

// scanString validates the string starting at b[i] == '"' and returns the
// index just past its closing quote and whether it contains escapes.
func scanString(b []byte, i int) (end int, esc bool, err error) {
	i++ // opening quote
	for {
		for i+8 <= len(b) && swarSpecial(binary.LittleEndian.Uint64(b[i:])) == 0 {
			i += 8
		}
		if i >= len(b) {
			return i, esc, errEOF(i)
		}
		c := b[i]
		switch {
		case c == '"':
			return i + 1, esc, nil
		case c == '\\':
			esc = true
			if i+1 >= len(b) {
				return i, esc, errEOF(i + 1)
			}
			switch b[i+1] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				i += 2
			case 'u':
				if i+6 > len(b) {
					return i, esc, errEOF(len(b))
				}
				for k := i + 2; k < i+6; k++ {
					if !isHex(b[k]) {
						return k, esc, errChar(b[k], "in \\u hexadecimal character escape", k)
					}
				}
				i += 6
			default:
				return i + 1, esc, errChar(b[i+1], "in string escape code", i+1)
			}
		case c < 0x20:
			return i, esc, errChar(c, "in string literal", i)
		case c < utf8.RuneSelf:
			i++
		default:
			r, size := utf8.DecodeRune(b[i:])
			if r == utf8.RuneError && size <= 1 {
				return i, esc, errAt("invalid UTF-8 in string", i)
			}
			i += size
		}
	}
}

func scanNumber(b []byte, i int) (int, error) {
	if b[i] == '-' {
		i++
	}
	if i >= len(b) {
		return i, errEOF(i)
	}
	switch c := b[i]; {
	case c == '0':
		i++
	case '1' <= c && c <= '9':
		for i++; i < len(b) && isDigit(b[i]); i++ {
		}
	default:
		return i, errChar(c, "in numeric literal", i)
	}
	if i < len(b) && b[i] == '.' {
		i++
		if i >= len(b) || !isDigit(b[i]) {
			return i, errAt("missing digits after decimal point", i)
		}
		for i < len(b) && isDigit(b[i]) {
			i++
		}
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		if i >= len(b) || !isDigit(b[i]) {
			return i, errAt("missing digits in exponent", i)
		}
		for i < len(b) && isDigit(b[i]) {
			i++
		}
	}
	return i, nil
}

func scanLiteral(b []byte, i int, lit string) (int, error) {
	if len(b)-i < len(lit) {
		return i, errEOF(len(b))
	}
	if string(b[i:i+len(lit)]) != lit {
		return i, errChar(b[i], "looking for beginning of value", i)
	}
	return i + len(lit), nil
}

// scanKeyColon reads `"key" :` at b[i] (whitespace already skipped) and
// returns the index after the colon.
func scanKeyColon(b []byte, i int) (int, error) {
	if i >= len(b) {
		return i, errEOF(i)
	}
	if b[i] != '"' {
		return i, errChar(b[i], "looking for beginning of object key string", i)
	}
	i, _, err := scanString(b, i)
	if err != nil {
		return i, err
	}
	i = skipWS(b, i)
	if i >= len(b) {
		return i, errEOF(i)
	}
	if b[i] != ':' {
		return i, errChar(b[i], "after object key", i)
	}
	return i + 1, nil
}

// skipValue validates one JSON value starting at or after b[i] (leading
// whitespace allowed) and returns the index just past it. It is iterative so
// deep nesting costs a byte of stack per level, not a goroutine frame.
func skipValue(b []byte, i int) (int, error) {
	var stackBuf [64]byte
	stack := stackBuf[:0]
	var err error
	for {
		i = skipWS(b, i)
		if i >= len(b) {
			return i, errEOF(i)
		}
		switch c := b[i]; {
		case c == '"':
			if i, _, err = scanString(b, i); err != nil {
				return i, err
			}
		case c == '{':
			if len(stack) >= maxDepth {
				return i, errAt("exceeded max nesting depth", i)
			}
			i = skipWS(b, i+1)
			if i < len(b) && b[i] == '}' {
				i++
				break
			}
			stack = append(stack, '{')
			if i, err = scanKeyColon(b, i); err != nil {
				return i, err
			}
			continue
		case c == '[':
			if len(stack) >= maxDepth {
				return i, errAt("exceeded max nesting depth", i)
			}
			i = skipWS(b, i+1)
			if i < len(b) && b[i] == ']' {
				i++
				break
			}
			stack = append(stack, '[')
			continue
		case c == 't':
			if i, err = scanLiteral(b, i, "true"); err != nil {
				return i, err
			}
		case c == 'f':
			if i, err = scanLiteral(b, i, "false"); err != nil {
				return i, err
			}
		case c == 'n':
			if i, err = scanLiteral(b, i, "null"); err != nil {
				return i, err
			}
		case c == '-' || isDigit(c):
			if i, err = scanNumber(b, i); err != nil {
				return i, err
			}
		default:
			return i, errChar(c, "looking for beginning of value", i)
		}
		// A value ended: close finished containers, or step to the next
		// element and go parse it.
	closing:
		for {
			if len(stack) == 0 {
				return i, nil
			}
			i = skipWS(b, i)
			if i >= len(b) {
				return i, errEOF(i)
			}
			top, c := stack[len(stack)-1], b[i]
			switch {
			case c == ',':
				i++
				if top == '{' {
					if i, err = scanKeyColon(b, skipWS(b, i)); err != nil {
						return i, err
					}
				}
				break closing
			case top == '{' && c == '}', top == '[' && c == ']':
				stack = stack[:len(stack)-1]
				i++
			default:
				return i, errChar(c, "after element", i)
			}
		}
	}
}

// validDoc reports whether b is exactly one JSON value (surrounding
// whitespace allowed) with valid UTF-8 strings.
func validDoc(b []byte) bool {
	end, err := skipValue(b, 0)
	return err == nil && skipWS(b, end) == len(b)
}

// checkDoc is validDoc with the reason.
func checkDoc(b []byte) error {
	end, err := skipValue(b, 0)
	if err != nil {
		return err
	}
	if j := skipWS(b, end); j != len(b) {
		return errChar(b[j], "after top-level value", j)
	}
	return nil
}

// skipStringTrusted returns the index after the string at b[i] == '"' in
// already-validated JSON: memchr to each quote, then backslash parity.
func skipStringTrusted(b []byte, i int) int {
	i++
	for {
		j := bytes.IndexByte(b[i:], '"')
		if j < 0 {
			return len(b)
		}
		i += j
		k := i - 1
		for b[k] == '\\' { // the opening quote bounds this walk
			k--
		}
		if (i-1-k)%2 == 0 {
			return i + 1
		}
		i++
	}
}

// skipTrusted returns the end of the value at or after b[i] in JSON that has
// already been validated. It is the fast path for second walks over a body.
func skipTrusted(b []byte, i int) int {
	i = skipWS(b, i)
	if i >= len(b) {
		return i
	}
	switch b[i] {
	case '"':
		return skipStringTrusted(b, i)
	case '{', '[':
		depth := 0
		for i < len(b) {
			switch b[i] {
			case '"':
				i = skipStringTrusted(b, i)
				continue
			case '{', '[':
				depth++
			case '}', ']':
				if depth--; depth == 0 {
					return i + 1
				}
			}
			i++
		}
		return i
	}
	for i < len(b) { // number or literal
		switch b[i] {
		case ',', '}', ']', ' ', '\t', '\n', '\r':
			return i
		}
		i++
	}
	return i
}

// member is one top-level "key": value pair as byte offsets.
type member struct {
	ks, ke int  // key including quotes: b[ks:ke]
	esc    bool // key contains escapes
	vs, ve int  // value: b[vs:ve]
}

func (m member) rawKey(b []byte) []byte { return b[m.ks+1 : m.ke-1] }

// keyBytes returns the decoded key; only escaped keys allocate.
func (m member) keyBytes(b []byte) []byte {
	raw := m.rawKey(b)
	if !m.esc {
		return raw
	}
	var sb strings.Builder
	unescapeTo(&sb, raw)
	return []byte(sb.String())
}

// objIter walks the members of the object at b[open] == '{', validating
// each value unless trusted (the bytes were validated before). After next
// returns false, err is set or close/end are valid.
type objIter struct {
	b       []byte
	trusted bool
	i       int
	n       int // members seen
	m       member
	close   int // index of '}'
	end     int // index after '}'
	done    bool
	err     error
}

func newObjIter(b []byte, open int) objIter { return objIter{b: b, i: open + 1} }

// trustedObjIter walks an object inside already-validated JSON.
func trustedObjIter(b []byte, open int) objIter {
	return objIter{b: b, i: open + 1, trusted: true}
}

func (it *objIter) next() bool {
	if it.done || it.err != nil {
		return false
	}
	b := it.b
	i := skipWS(b, it.i)
	if i >= len(b) {
		it.err = errEOF(i)
		return false
	}
	if b[i] == '}' {
		it.done, it.close, it.end = true, i, i+1
		return false
	}
	if it.n > 0 {
		if b[i] != ',' {
			it.err = errChar(b[i], "after object key:value pair", i)
			return false
		}
		i = skipWS(b, i+1)
		if i >= len(b) {
			it.err = errEOF(i)
			return false
		}
	}
	if b[i] != '"' {
		it.err = errChar(b[i], "looking for beginning of object key string", i)
		return false
	}
	m := member{ks: i}
	var err error
	if it.trusted {
		i = skipStringTrusted(b, i)
		m.esc = bytes.IndexByte(b[m.ks:i], '\\') >= 0
	} else if i, m.esc, err = scanString(b, i); err != nil {
		it.err = err
		return false
	}
	m.ke = i
	i = skipWS(b, i)
	if i >= len(b) {
		it.err = errEOF(i)
		return false
	}
	if b[i] != ':' {
		it.err = errChar(b[i], "after object key", i)
		return false
	}
	m.vs = skipWS(b, i+1)
	if it.trusted {
		m.ve = skipTrusted(b, m.vs)
	} else if m.ve, err = skipValue(b, m.vs); err != nil {
		it.err = err
		return false
	}
	it.m, it.i = m, m.ve
	it.n++
	return true
}

// arrIter walks the elements of the array at b[open] == '['.
type arrIter struct {
	b       []byte
	trusted bool
	i       int
	n       int
	vs, ve  int
	end     int
	done    bool
	err     error
}

// trustedArrIter walks an array inside already-validated JSON.
func trustedArrIter(b []byte, open int) arrIter {
	return arrIter{b: b, i: open + 1, trusted: true}
}

func (it *arrIter) next() bool {
	if it.done || it.err != nil {
		return false
	}
	b := it.b
	i := skipWS(b, it.i)
	if i >= len(b) {
		it.err = errEOF(i)
		return false
	}
	if b[i] == ']' {
		it.done, it.end = true, i+1
		return false
	}
	if it.n > 0 {
		if b[i] != ',' {
			it.err = errChar(b[i], "after array element", i)
			return false
		}
		i = skipWS(b, i+1)
	}
	var ve int
	if it.trusted {
		ve = skipTrusted(b, i)
	} else {
		var err error
		if ve, err = skipValue(b, i); err != nil {
			it.err = err
			return false
		}
	}
	it.vs, it.ve, it.i = i, ve, ve
	it.n++
	return true
}

func hex4(b []byte) rune {
	var r rune
	for _, c := range b[:4] {
		switch {
		case isDigit(c):
			c -= '0'
		case 'a' <= c && c <= 'f':
			c = c - 'a' + 10
		default:
			c = c - 'A' + 10
		}
		r = r<<4 | rune(c)
	}
	return r
}

// unescapeTo writes the decoded content of a validated JSON string body
// (without quotes). Lone surrogates become U+FFFD, as in encoding/json. It
// takes the concrete builder so callers' builders stay on the stack.
func unescapeTo(w *strings.Builder, raw []byte) {
	for len(raw) > 0 {
		j := bytes.IndexByte(raw, '\\')
		if j < 0 {
			_, _ = w.Write(raw)
			return
		}
		_, _ = w.Write(raw[:j])
		if j+1 >= len(raw) { // cannot happen for validated input
			return
		}
		c := raw[j+1]
		raw = raw[j+2:]
		switch c {
		case 'b':
			_ = w.WriteByte('\b')
		case 'f':
			_ = w.WriteByte('\f')
		case 'n':
			_ = w.WriteByte('\n')
		case 'r':
			_ = w.WriteByte('\r')
		case 't':
			_ = w.WriteByte('\t')
		case 'u':
			if len(raw) < 4 {
				return
			}
			r := hex4(raw)
			raw = raw[4:]
			if utf16.IsSurrogate(r) {
				r2 := utf8.RuneError
				if len(raw) >= 6 && raw[0] == '\\' && raw[1] == 'u' {
					if d := utf16.DecodeRune(r, hex4(raw[2:])); d != utf8.RuneError {
						r2 = d
						raw = raw[6:]
					}
				}
				r = r2
			}
			_, _ = w.WriteRune(r)
		default: // '"', '\\', '/'
			_ = w.WriteByte(c)
		}
	}
}

// appendJSONString appends s as a JSON string. Invalid UTF-8 becomes U+FFFD
// (like Rust's from_utf8_lossy); HTML characters are left alone.
func appendJSONString(dst []byte, s string) []byte {
	const hexDigits = "0123456789abcdef"
	dst = append(dst, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c >= 0x20 && c != '"' && c != '\\' && c < utf8.RuneSelf {
			i++
			continue
		}
		if c < utf8.RuneSelf {
			dst = append(dst, s[start:i]...)
			switch c {
			case '"', '\\':
				dst = append(dst, '\\', c)
			case '\n':
				dst = append(dst, '\\', 'n')
			case '\r':
				dst = append(dst, '\\', 'r')
			case '\t':
				dst = append(dst, '\\', 't')
			default:
				dst = append(dst, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xf])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			dst = append(dst, s[start:i]...)
			dst = append(dst, "\ufffd"...)
			i++
			start = i
			continue
		}
		i += size
	}
	dst = append(dst, s[start:]...)
	return append(dst, '"')
}
