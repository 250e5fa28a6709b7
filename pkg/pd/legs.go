package pd

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"net/url"
	"strconv"
	"strings"
)

// MintRooms returns n uniformly random rooms in [1, 2^63-1] from crypto/rand.
// The range is SGLang's (rooms live in int64 slots and are used modulo the DP
// size); 0 is skipped because room 0 is SGLang's health-check/warmup form.
// Rooms are not deduplicated: a collision among n rooms has probability
// about n²/2^64.
func MintRooms(n int) ([]uint64, error) {
	if n < 1 {
		return nil, fmt.Errorf("pd: mint rooms: n must be positive, got %d", n)
	}
	rooms := make([]uint64, n)
	var buf [8 * 32]byte
	for i := 0; i < n; {
		chunk := buf[:8*min(n-i, 32)]
		if _, err := rand.Read(chunk); err != nil {
			return nil, fmt.Errorf("pd: mint rooms: %w", err)
		}
		for j := 0; j < len(chunk) && i < n; j += 8 {
			if r := binary.LittleEndian.Uint64(chunk[j:]) & math.MaxInt64; r != 0 {
				rooms[i] = r
				i++
			}
		}
	}
	return rooms, nil
}

// Bootstrap holds the per-attempt values both legs carry.
type Bootstrap struct {
	Host  string   // prefill URL host, IPv6 keeps brackets
	Port  *int     // nil -> JSON null
	Rooms []uint64 // len 1 for scalar requests (BatchSize 0), else BatchSize
	// Model, when non-empty and different from Request.Model, replaces the
	// value of an existing top-level "model" key on every leg (SMG's
	// alias -> canonical id rewrite). It is never added.
	Model string
}

// DPRanks are the data-parallel ranks parsed from worker URLs "http://h:p@rank".
type DPRanks struct{ Prefill, Decode *int }

// BuildLegs returns the prefill and decode bodies: the client's bytes with
// bootstrap_host/bootstrap_port/bootstrap_room set (lists of BatchSize for
// batches), plus routed_dp_rank=<prefill rank> on the prefill leg and
// disagg_prefill_dp_rank=<prefill rank>, routed_dp_rank=<decode rank> on the
// decode leg, each only when that rank is known. Client values of keys we set
// are overwritten; every other byte is the client's. Without DP ranks both
// results are the same slice. On a PrefillOnly route there is no decode leg
// (nil) and no bootstrap key: the prefill body is Raw, with only the model
// rewrite applied.
func BuildLegs(req *Request, b Bootstrap, dp DPRanks) (prefill, decode []byte, err error) {
	if req == nil || req.Route == nil {
		return nil, nil, errors.New("pd: build legs: request without route")
	}
	replaceModel := b.Model != "" && b.Model != req.Model && req.hasKey(ownModel)
	if req.Route.PrefillOnly {
		if !replaceModel {
			return req.Raw, nil, nil
		}
		out, err := req.buildLeg([]ownedValue{{ownModel, appendJSONString(nil, b.Model)}})
		if err != nil {
			return nil, nil, fmt.Errorf("pd: build legs: %w", err)
		}
		return out, nil, nil
	}
	n := 1
	if req.BatchSize > 0 {
		n = req.BatchSize
	}
	if len(b.Rooms) != n {
		return nil, nil, fmt.Errorf("pd: build legs: got %d rooms for batch size %d", len(b.Rooms), req.BatchSize)
	}
	list := req.BatchSize > 0

	// Encode every value once into one scratch buffer; value k is
	// sc[at[k]:at[k+1]], sliced only after the last append (append may move sc).
	const (
		vHost = iota
		vPort
		vRoom
		vModel
		vPrefillRank
		vDecodeRank
		numVals
	)
	// Room ≤ 19 digits, port ≤ 11 bytes or null, plus quotes and commas.
	sc := make([]byte, 0, n*(len(b.Host)+36)+len(b.Model)+48)
	var at [numVals + 1]int
	at[vHost] = len(sc)
	sc = appendRepeated(sc, list, n, func(dst []byte) []byte { return appendJSONString(dst, b.Host) })
	at[vPort] = len(sc)
	sc = appendRepeated(sc, list, n, func(dst []byte) []byte {
		if b.Port == nil {
			return append(dst, "null"...)
		}
		return strconv.AppendInt(dst, int64(*b.Port), 10)
	})
	at[vRoom] = len(sc)
	if list {
		sc = append(sc, '[')
	}
	for i, r := range b.Rooms {
		if i > 0 {
			sc = append(sc, ',')
		}
		sc = strconv.AppendUint(sc, r, 10)
	}
	if list {
		sc = append(sc, ']')
	}
	at[vModel] = len(sc)
	if replaceModel {
		sc = appendJSONString(sc, b.Model)
	}
	at[vPrefillRank] = len(sc)
	if dp.Prefill != nil {
		sc = strconv.AppendInt(sc, int64(*dp.Prefill), 10)
	}
	at[vDecodeRank] = len(sc)
	if dp.Decode != nil {
		sc = strconv.AppendInt(sc, int64(*dp.Decode), 10)
	}
	at[numVals] = len(sc)
	val := func(k int) []byte { return sc[at[k]:at[k+1]:at[k+1]] }

	var setsBuf [numOwned + 2]ownedValue
	sets := append(setsBuf[:0],
		ownedValue{ownHost, val(vHost)},
		ownedValue{ownPort, val(vPort)},
		ownedValue{ownRoom, val(vRoom)})
	if replaceModel {
		sets = append(sets, ownedValue{ownModel, val(vModel)})
	}
	prefillRank, decodeRank := val(vPrefillRank), val(vDecodeRank)
	if dp.Prefill == nil && dp.Decode == nil {
		out, err := req.buildLeg(sets)
		if err != nil {
			return nil, nil, fmt.Errorf("pd: build legs: %w", err)
		}
		return out, out, nil
	}
	base := len(sets)
	if dp.Prefill != nil {
		sets = append(sets, ownedValue{ownRoutedRank, prefillRank})
	}
	if prefill, err = req.buildLeg(sets); err != nil {
		return nil, nil, fmt.Errorf("pd: build prefill leg: %w", err)
	}
	sets = sets[:base]
	if dp.Prefill != nil {
		sets = append(sets, ownedValue{ownPrefillRank, prefillRank})
	}
	if dp.Decode != nil {
		sets = append(sets, ownedValue{ownRoutedRank, decodeRank})
	}
	if decode, err = req.buildLeg(sets); err != nil {
		return nil, nil, fmt.Errorf("pd: build decode leg: %w", err)
	}
	return prefill, decode, nil
}

func appendRepeated(dst []byte, list bool, n int, one func([]byte) []byte) []byte {
	if !list {
		return one(dst)
	}
	dst = append(dst, '[')
	start := len(dst)
	dst = one(dst)
	item := len(dst) - start
	for i := 1; i < n; i++ {
		dst = append(dst, ',')
		dst = append(dst, dst[start:start+item]...)
	}
	return append(dst, ']')
}

// ownedValue is a value for one of the owned top-level keys.
type ownedValue struct {
	o   int
	val []byte
}

// hasKey reports whether the body has top-level key ownedNames[o].
func (req *Request) hasKey(o int) bool {
	if req.lay.ok {
		return req.lay.own[o].set()
	}
	_, ok := TopLevel(req.Raw, ownedNames[o])
	return ok
}

// buildLeg writes one leg body. With the layout from ParseRequest it splices
// at known offsets (one allocation, no rescan); otherwise, or when an owned
// key is duplicated, it falls back to the general editor.
func (req *Request) buildLeg(sets []ownedValue) ([]byte, error) {
	lay := &req.lay
	if !lay.ok || lay.dup {
		kvs := make([]KV, len(sets))
		for i, s := range sets {
			kvs[i] = KV{Key: ownedNames[s.o], Value: s.val}
		}
		return editObject(req.Raw, kvs, nil, lay.ok) // lay.ok: validated by ParseRequest
	}
	type splice struct {
		s, e int
		v    ownedValue
		add  bool // append a new member at s (== e)
	}
	var buf [numOwned + 2]splice
	eds := buf[:0]
	raw := req.Raw
	total := len(raw)
	for _, sv := range sets {
		if sp := lay.own[sv.o]; sp.set() {
			eds = append(eds, splice{s: sp.s, e: sp.e, v: sv})
			total += len(sv.val) - (sp.e - sp.s)
		} else {
			eds = append(eds, splice{s: lay.insert, e: lay.insert, v: sv, add: true})
			total += len(ownedNames[sv.o]) + len(sv.val) + 4 // ,"":
		}
	}
	// Insertion sort by offset; appends (at lay.insert, after every value)
	// stay in order behind the replacements.
	for i := 1; i < len(eds); i++ {
		for j := i; j > 0 && eds[j].s < eds[j-1].s; j-- {
			eds[j], eds[j-1] = eds[j-1], eds[j]
		}
	}
	out := make([]byte, 0, total)
	cursor := 0
	nonEmpty := !lay.empty
	for _, ed := range eds {
		out = append(out, raw[cursor:ed.s]...)
		if ed.add {
			if nonEmpty {
				out = append(out, ',')
			}
			out = append(out, '"')
			out = append(out, ownedNames[ed.v.o]...)
			out = append(out, '"', ':')
			nonEmpty = true
		}
		out = append(out, ed.v.val...)
		cursor = ed.e
	}
	return append(out, raw[cursor:]...), nil
}

// SplitWorkerURL parses "http://host:port@rank" into the base URL to call
// (without "@rank"), the DP rank (nil if none) and the bootstrap host by SMG's
// rules: a trailing "@<digits>" is a rank, not userinfo; the host is parsed
// from the URL with IPv6 brackets kept; a URL without "://" is retried as
// http://; ipc:// workers get ""; anything unparsable gives "localhost".
func SplitWorkerURL(u string) (base string, rank *int, host string) {
	base = u
	if at := strings.LastIndexByte(u, '@'); at >= 0 && at+1 < len(u) && allDigits(u[at+1:]) {
		base = u[:at]
		if r, err := strconv.Atoi(u[at+1:]); err == nil {
			rank = &r
		}
	}
	return base, rank, bootstrapHost(base)
}

func allDigits(s string) bool {
	for i := 0; i < len(s); i++ {
		if !isDigit(s[i]) {
			return false
		}
	}
	return s != ""
}

func bootstrapHost(u string) string {
	if len(u) >= 6 && strings.EqualFold(u[:6], "ipc://") {
		return ""
	}
	if h, ok := urlHost(u); ok {
		return h
	}
	if !strings.Contains(u, "://") {
		if h, ok := urlHost("http://" + u); ok {
			return h
		}
	}
	return "localhost"
}

func urlHost(u string) (string, bool) {
	p, err := url.Parse(u)
	if err != nil || p.Host == "" {
		return "", false
	}
	if strings.HasPrefix(p.Host, "[") {
		if j := strings.IndexByte(p.Host, ']'); j > 0 {
			return strings.ToLower(p.Host[:j+1]), true
		}
		return "", false
	}
	h := p.Hostname()
	if h == "" {
		return "", false
	}
	// Rust's url crate lowercases hosts of http(s) URLs.
	return strings.ToLower(h), true
}
