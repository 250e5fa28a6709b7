package common

// ring is a bounded FIFO that overwrites its oldest entry when full.
type ring[T any] struct {
	buf   []T
	start int
	limit int
}

func newRing[T any](limit int) ring[T] { return ring[T]{limit: limit} }

// add appends v and reports whether an old entry was evicted.
func (r *ring[T]) add(v T) bool {
	if len(r.buf) < r.limit {
		r.buf = append(r.buf, v)
		return false
	}
	r.buf[r.start] = v
	r.start = (r.start + 1) % r.limit
	return true
}

func (r *ring[T]) snapshot() []T {
	out := make([]T, 0, len(r.buf))
	out = append(out, r.buf[r.start:]...)
	return append(out, r.buf[:r.start]...)
}

func (r *ring[T]) reset() {
	r.buf = nil
	r.start = 0
}
