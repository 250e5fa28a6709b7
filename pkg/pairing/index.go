package pairing

import (
	"slices"
	"strconv"
	"strings"

	"github.com/smg-project/smg-extproc/pkg/workers"
)

// Index is the compatible prefill/decode pairs of one membership snapshot.
// Descriptors never change after a worker is built and membership changes
// rarely, so compatibility is decided here once and every request only reads
// partner lists. An Index is immutable once built.
type Index struct {
	mode Mode
	// snap is the snapshot the index was built from; Sync compares it by
	// identity to notice a new one.
	snap []*workers.Worker
	// prefillPool and decodePool are the legs as the snapshot holds them.
	prefillPool []*workers.Worker
	decodePool  []*workers.Worker
	// prefill lists the prefills with at least one compatible decode, in
	// registry order; partners[i] are prefill[i]'s decodes, in registry order.
	// Prefills with equal descriptors share one list.
	prefill  []*workers.Worker
	partners [][]*workers.Worker
	refusal  *Refusal
}

// Refusal records why no prefill in a snapshot can pair with any decode:
// each leg's distinct keys and the components they disagree on, sorted.
type Refusal struct {
	Prefill    []string
	Decode     []string
	Mismatches []string
	message    string
}

// Message is the 503 no_compatible_pd_pair text, in SMG's wording (Rust's
// Debug rendering of the three lists).
func (r *Refusal) Message() string { return r.message }

// BuildIndex pairs every prefill in ws with its compatible decodes under m.
// Cost is O(P·D) descriptor comparisons, paid once per membership change.
func BuildIndex(ws []*workers.Worker, m Mode) *Index {
	ix := &Index{mode: m, snap: ws}
	for _, w := range ws {
		switch w.Type {
		case workers.Prefill:
			ix.prefillPool = append(ix.prefillPool, w)
		case workers.Decode:
			ix.decodePool = append(ix.decodePool, w)
		}
	}
	if len(ix.prefillPool) == 0 || len(ix.decodePool) == 0 {
		return ix
	}
	pds := make([]Descriptor, len(ix.prefillPool))
	for i, w := range ix.prefillPool {
		pds[i] = DescriptorOf(w)
	}
	dds := make([]Descriptor, len(ix.decodePool))
	for i, w := range ix.decodePool {
		dds[i] = DescriptorOf(w)
	}
	byDesc := make(map[Descriptor][]*workers.Worker, 4)
	for i, p := range ix.prefillPool {
		list, ok := byDesc[pds[i]]
		if !ok {
			if m == Off {
				list = ix.decodePool
			} else {
				for j, d := range ix.decodePool {
					if Mismatch(pds[i], dds[j], m) == "" {
						list = append(list, d)
					}
				}
			}
			byDesc[pds[i]] = list
		}
		if len(list) > 0 {
			ix.prefill = append(ix.prefill, p)
			ix.partners = append(ix.partners, list)
		}
	}
	if len(ix.prefill) == 0 {
		ix.refusal = newRefusal(pds, dds, m)
	}
	return ix
}

func newRefusal(pds, dds []Descriptor, m Mode) *Refusal {
	r := &Refusal{}
	for _, p := range pds {
		r.Prefill = append(r.Prefill, p.Key())
		for _, d := range dds {
			if s := Mismatch(p, d, m); s != "" {
				r.Mismatches = append(r.Mismatches, s)
			}
		}
	}
	for _, d := range dds {
		r.Decode = append(r.Decode, d.Key())
	}
	for _, l := range []*[]string{&r.Prefill, &r.Decode, &r.Mismatches} {
		slices.Sort(*l)
		*l = slices.Compact(*l)
	}
	r.message = "No prefill/decode pair shares a KV transfer protocol (mismatch on " +
		debugList(r.Mismatches) + "; prefill: " + debugList(r.Prefill) + ", decode: " + debugList(r.Decode) + ")"
	return r
}

// debugList renders like Rust's {:?} of a Vec<String>: ["a", "b"].
func debugList(l []string) string {
	var b strings.Builder
	b.WriteByte('[')
	for i, s := range l {
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString(strconv.Quote(s))
	}
	b.WriteByte(']')
	return b.String()
}

// Mode is the pairing mode the index was built under.
func (ix *Index) Mode() Mode { return ix.mode }

// Refusal is non-nil when both legs have workers and no pair is compatible.
func (ix *Index) Refusal() *Refusal { return ix.refusal }

// Partners returns p's compatible decodes (nil when p has none or is not a
// prefill of this snapshot). Do not modify the result.
func (ix *Index) Partners(p *workers.Worker) []*workers.Worker {
	if i := slices.Index(ix.prefill, p); i >= 0 {
		return ix.partners[i]
	}
	return nil
}
