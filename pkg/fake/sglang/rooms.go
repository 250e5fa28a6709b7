package sglang

import (
	"sort"
	"sync"
	"time"
)

// joinInfo is what a decode sends to the prefill's POST /_fake/join.
type joinInfo struct {
	Room             uint64 `json:"room"`
	DecodeID         string `json:"decode_id"`
	RID              string `json:"rid,omitempty"`
	PromptTokensHash string `json:"prompt_tokens_hash"`
	PromptLen        int    `json:"prompt_len"`
	PageSize         int    `json:"page_size"`
	KVCacheDtype     string `json:"kv_cache_dtype"`
}

// transferResult is what the prefill hands the decode once the KV "moved".
type transferResult struct {
	Status            string  `json:"status"`
	Room              uint64  `json:"room"`
	PrefillRID        string  `json:"prefill_rid"`
	PromptTokensHash  string  `json:"prompt_tokens_hash"`
	PromptLen         int     `json:"prompt_len"`
	FirstTokenID      int     `json:"first_token_id"`
	FirstTokenWord    string  `json:"first_token_word"`
	FirstTokenLogprob float64 `json:"first_token_logprob"`
	CachedTokens      int     `json:"cached_tokens"`
	Message           string  `json:"message,omitempty"`
}

const (
	stageWaitingJoin    = "waiting_join"    // prefill arrived, no decode yet
	stageWaitingPrefill = "waiting_prefill" // decode joined, prefill not arrived
	stageTransferring   = "transferring"
)

// roomEntry is one room on the prefill side. Channels are closed at most
// once, under roomTable.mu.
type roomEntry struct {
	room    uint64
	since   time.Time
	prefill bool   // the prefill request for this room has arrived
	rid     string // prefill rid
	join    *joinInfo

	joined   chan struct{} // closed when a decode joins
	aborted  chan struct{} // closed on abort (decode gave up, prefill failed)
	done     chan struct{} // closed when transferred
	abortMsg string
	result   *transferResult
	finished bool
}

func (e *roomEntry) stage() string {
	switch {
	case !e.prefill:
		return stageWaitingPrefill
	case e.join == nil:
		return stageWaitingJoin
	default:
		return stageTransferring
	}
}

// roomTable is the prefill's set of pending rooms plus a bounded memory of
// rooms that already transferred: strict, reusing such a room is a
// duplicate (400) and a late join for it is rejected.
type roomTable struct {
	mu        sync.Mutex
	rooms     map[uint64]*roomEntry
	completed roomMemory
}

func newRoomTable(limit int) *roomTable {
	return &roomTable{rooms: make(map[uint64]*roomEntry), completed: newRoomMemory(limit)}
}

func newEntry(room uint64) *roomEntry {
	return &roomEntry{
		room: room, since: time.Now(),
		joined: make(chan struct{}), aborted: make(chan struct{}), done: make(chan struct{}),
	}
}

// registerPrefill registers the prefill side of rooms (all or none). It
// returns the entries (nil for items to skip) or the first room that is
// already pending on this worker.
func (t *roomTable) registerPrefill(items []item, lax bool) ([]*roomEntry, *uint64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for i := range items {
		it := &items[i]
		if it.healthForm || it.stall {
			continue
		}
		used := t.completed.has(it.room)
		if e, ok := t.rooms[it.room]; (ok && e.prefill) || (used && !lax) {
			if lax {
				it.stall = true
				continue
			}
			r := it.room
			return nil, &r
		}
	}
	out := make([]*roomEntry, len(items))
	for i := range items {
		it := &items[i]
		if it.healthForm || it.stall {
			continue
		}
		e, ok := t.rooms[it.room]
		if !ok {
			e = newEntry(it.room)
			t.rooms[it.room] = e
		}
		e.prefill, e.rid, e.since = true, it.rid, time.Now()
		out[i] = e
	}
	return out, nil
}

type joinOutcome int

const (
	joinAccepted joinOutcome = iota
	joinDuplicate
	joinAlreadyTransferred
)

// join records a decode's join for a room. A join may arrive before the
// prefill request (the decode was faster); the entry then waits for it.
func (t *roomTable) join(j *joinInfo, strict bool) (*roomEntry, joinOutcome) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e, ok := t.rooms[j.Room]
	if ok && e.join != nil {
		return e, joinDuplicate
	}
	if !ok {
		if t.completed.has(j.Room) && strict {
			return nil, joinAlreadyTransferred
		}
		e = newEntry(j.Room)
		t.rooms[j.Room] = e
	}
	e.join = j
	close(e.joined)
	return e, joinAccepted
}

// abort fails a room that has not transferred yet. decodeID, when set, must
// match the joined decode (a rejected second decode cannot abort the pair).
func (t *roomTable) abort(room uint64, decodeID, msg string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	e, ok := t.rooms[room]
	if !ok || e.finished {
		return false
	}
	if decodeID != "" && e.join != nil && e.join.DecodeID != decodeID {
		return false
	}
	t.abortLocked(e, msg)
	return true
}

func (t *roomTable) abortLocked(e *roomEntry, msg string) {
	if e.finished {
		return
	}
	e.finished = true
	e.abortMsg = msg
	close(e.aborted)
	if t.rooms[e.room] == e {
		delete(t.rooms, e.room)
	}
}

// fail ends e after a failure on either side (prefill timeout or client
// gone, or the decode's join long-poll ending early); the other side sees
// the abort.
func (t *roomTable) fail(e *roomEntry, msg string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.abortLocked(e, msg)
}

// complete marks e transferred and remembers the room.
func (t *roomTable) complete(e *roomEntry, res *transferResult) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if e.finished {
		return false
	}
	e.finished = true
	e.result = res
	close(e.done)
	if t.rooms[e.room] == e {
		delete(t.rooms, e.room)
	}
	t.completed.add(e.room)
	return true
}

func (t *roomTable) resetMemory() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.completed.reset()
}

func (t *roomTable) snapshot() []RoomState {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]RoomState, 0, len(t.rooms))
	now := time.Now()
	for _, e := range t.rooms {
		rs := RoomState{Room: e.room, RID: e.rid, Stage: e.stage(), PrefillPresent: e.prefill, SinceMS: now.Sub(e.since).Milliseconds()}
		if e.join != nil {
			rs.DecodeID = e.join.DecodeID
		}
		out = append(out, rs)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Room < out[j].Room })
	return out
}

func (t *roomTable) counts() (waitingJoin, transferring int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, e := range t.rooms {
		switch e.stage() {
		case stageWaitingJoin:
			waitingJoin++
		case stageTransferring:
			transferring++
		}
	}
	return
}

// decodeRooms is the decode's set of rooms in flight (duplicate detection
// and /_fake/state) plus a bounded memory of rooms that transferred.
type decodeRooms struct {
	mu    sync.Mutex
	rooms map[uint64]*RoomState
	used  roomMemory
}

func newDecodeRooms(limit int) *decodeRooms {
	return &decodeRooms{rooms: make(map[uint64]*RoomState), used: newRoomMemory(limit)}
}

// roomMemory is a bounded FIFO set of rooms.
type roomMemory struct {
	set   map[uint64]struct{}
	order []uint64
	limit int
}

func newRoomMemory(limit int) roomMemory {
	return roomMemory{set: make(map[uint64]struct{}), limit: limit}
}

func (m *roomMemory) has(room uint64) bool {
	_, ok := m.set[room]
	return ok
}

func (m *roomMemory) add(room uint64) {
	if _, ok := m.set[room]; ok {
		return
	}
	m.set[room] = struct{}{}
	m.order = append(m.order, room)
	for len(m.order) > m.limit {
		delete(m.set, m.order[0])
		m.order = m.order[1:]
	}
}

func (m *roomMemory) reset() {
	m.set = make(map[uint64]struct{})
	m.order = nil
}

func (d *decodeRooms) markUsed(room uint64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.used.add(room)
}

func (d *decodeRooms) resetMemory() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.used.reset()
}

// register adds the items' rooms (all or none); it returns a room that is
// already pending (lax: such items are marked to stall instead).
func (d *decodeRooms) register(items []item, lax bool) *uint64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	for i := range items {
		if items[i].healthForm || items[i].stall {
			continue
		}
		if _, ok := d.rooms[items[i].room]; ok || (!lax && d.used.has(items[i].room)) {
			if lax {
				items[i].stall = true
				continue
			}
			r := items[i].room
			return &r
		}
	}
	now := time.Now()
	for i := range items {
		if items[i].healthForm || items[i].stall {
			continue
		}
		d.rooms[items[i].room] = &RoomState{Room: items[i].room, RID: items[i].rid, Stage: "fetching", SinceMS: now.UnixMilli()}
	}
	return nil
}

func (d *decodeRooms) setStage(room uint64, stage string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if rs, ok := d.rooms[room]; ok {
		rs.Stage = stage
	}
}

func (d *decodeRooms) release(items []item) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for i := range items {
		if items[i].healthForm || items[i].stall {
			continue
		}
		delete(d.rooms, items[i].room)
	}
}

func (d *decodeRooms) snapshot() []RoomState {
	d.mu.Lock()
	defer d.mu.Unlock()
	now := time.Now().UnixMilli()
	out := make([]RoomState, 0, len(d.rooms))
	for _, rs := range d.rooms {
		c := *rs
		c.SinceMS = now - rs.SinceMS
		out = append(out, c)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Room < out[j].Room })
	return out
}

func (d *decodeRooms) counts() (prealloc, transfer int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, rs := range d.rooms {
		if rs.Stage == "waiting_transfer" {
			transfer++
		} else {
			prealloc++
		}
	}
	return
}
