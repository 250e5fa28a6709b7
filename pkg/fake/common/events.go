package common

import (
	"sync"
	"time"
)

// Event is one entry of a fake's ordered event log.
type Event struct {
	Seq        uint64    `json:"seq"`
	TS         time.Time `json:"ts"`
	Leg        string    `json:"leg"`
	RID        string    `json:"rid,omitempty"`
	Room       *uint64   `json:"room,omitempty"`
	TransferID string    `json:"transfer_id,omitempty"`
	Outcome    string    `json:"outcome"`
	Detail     string    `json:"detail,omitempty"`
}

// EventLog is a bounded, ordered, concurrency-safe event log. When full, the
// oldest events are dropped (and counted).
type EventLog struct {
	mu      sync.Mutex
	events  ring[Event]
	seq     uint64
	dropped uint64
}

// NewEventLog returns a log keeping at most limit events (limit <= 0: 10000).
func NewEventLog(limit int) *EventLog {
	if limit <= 0 {
		limit = 10000
	}
	return &EventLog{events: newRing[Event](limit)}
}

// Add appends e, filling Seq and (when zero) TS.
func (l *EventLog) Add(e Event) {
	if e.TS.IsZero() {
		e.TS = time.Now()
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.seq++
	e.Seq = l.seq
	if l.events.add(e) {
		l.dropped++
	}
}

// Snapshot returns a copy of the events in order.
func (l *EventLog) Snapshot() []Event {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.events.snapshot()
}

// Dropped is how many events were evicted since the last Reset.
func (l *EventLog) Dropped() uint64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.dropped
}

// Reset empties the log (sequence numbers keep increasing).
func (l *EventLog) Reset() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.events.reset()
	l.dropped = 0
}

// RoomPtr returns a pointer to a copy of room, for Event.Room.
func RoomPtr(room uint64) *uint64 { return &room }
