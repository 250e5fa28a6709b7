package pairing

import (
	"fmt"
	"strings"

	"github.com/smg-project/smg-extproc/pkg/workers"
)

// Labels the descriptor is derived from (SMG's names).
const (
	LabelPairingProtocol           = "pairing_protocol"
	LabelPairingProtocolAnnotation = "smg.ai/pairing-protocol"
	LabelKVConnector               = "kv_connector"
	LabelMoriIOMode                = "moriio_mode"
	LabelTransferBackend           = "disaggregation_transfer_backend"
	LabelVersion                   = "version"
	LabelKVCacheDType              = "kv_cache_dtype"
	LabelPageSize                  = "page_size"
	LabelBlockSize                 = "block_size"
	LabelAttentionBackend          = "attention_backend"
	LabelModelDType                = "model_dtype"
)

// Descriptor is what one PD worker offers a KV-handoff partner. An empty
// field is an unknown (unreported) component. It is comparable, so workers
// with equal descriptors can share one partner list.
type Descriptor struct {
	Runtime   string // sglang, vllm, tokenspeed, ...
	Explicit  string // operator-set pairing protocol
	Transport string // nixl, mooncake, moriio-read, ...
	Version   string
	// KV layout facts, lower-cased.
	KVCacheDType     string
	PageSize         string
	AttentionBackend string
	ModelDType       string
}

// DescriptorOf derives w's descriptor from its runtime, KV connector and labels.
func DescriptorOf(w *workers.Worker) Descriptor {
	rt := strings.ToLower(strings.TrimSpace(w.Runtime))
	l := w.Labels
	explicit := label(l, LabelPairingProtocol)
	if explicit == "" {
		explicit = label(l, LabelPairingProtocolAnnotation)
	}
	page := label(l, LabelPageSize)
	if page == "" {
		page = label(l, LabelBlockSize) // vLLM's name for the page size
	}
	return Descriptor{
		Runtime:          rt,
		Explicit:         explicit,
		Transport:        transportOf(rt, w),
		Version:          label(l, LabelVersion),
		KVCacheDType:     strings.ToLower(label(l, LabelKVCacheDType)),
		PageSize:         strings.ToLower(page),
		AttentionBackend: strings.ToLower(label(l, LabelAttentionBackend)),
		ModelDType:       strings.ToLower(label(l, LabelModelDType)),
	}
}

// label is a trimmed label value; "" when absent or blank.
func label(l map[string]string, k string) string {
	return strings.TrimSpace(l[k])
}

// transportOf is the KV transport by runtime: vLLM names a connector, SGLang
// a transfer backend, TokenSpeed speaks only Mooncake unless told otherwise.
func transportOf(rt string, w *workers.Worker) string {
	switch rt {
	case "vllm":
		c := strings.TrimSpace(w.KVConnector)
		if c == "" {
			c = label(w.Labels, LabelKVConnector)
		}
		return normaliseConnector(c, label(w.Labels, LabelMoriIOMode))
	case "sglang":
		return strings.ToLower(label(w.Labels, LabelTransferBackend))
	case "tokenspeed":
		if b := label(w.Labels, LabelTransferBackend); b != "" {
			return strings.ToLower(b)
		}
		return "mooncake"
	default:
		return ""
	}
}

// normaliseConnector folds connector class names (NixlConnector,
// MooncakeStoreConnector, MoRIIOConnector) to the transport they speak. MoRI-IO
// read and write modes cannot hand off to each other, so the mode is part of
// the transport.
func normaliseConnector(c, moriioMode string) string {
	lc := strings.ToLower(c)
	switch {
	case lc == "":
		return ""
	case strings.Contains(lc, "nixl"):
		return "nixl"
	case strings.Contains(lc, "mooncake"):
		return "mooncake"
	case strings.Contains(lc, "moriio"):
		switch strings.ToLower(moriioMode) {
		case "read":
			return "moriio-read"
		case "write":
			return "moriio-write"
		}
		return "moriio"
	default:
		return lc
	}
}

// Key names the pairing group, as GET /workers shows it in pd_pairing: the
// explicit protocol, else runtime/transport/layout with "?" for unknown parts.
// The version is never part of the key.
func (d Descriptor) Key() string {
	if d.Explicit != "" {
		return d.Explicit
	}
	var b strings.Builder
	b.WriteString(orUnknown(d.Runtime))
	b.WriteByte('/')
	b.WriteString(orUnknown(d.Transport))
	b.WriteByte('/')
	n := b.Len()
	for _, f := range [...]struct{ short, v string }{
		{"dtype", d.KVCacheDType}, {"page", d.PageSize}, {"attn", d.AttentionBackend}, {"model", d.ModelDType},
	} {
		if f.v == "" {
			continue
		}
		if b.Len() > n {
			b.WriteByte(',')
		}
		b.WriteString(f.short)
		b.WriteByte('=')
		b.WriteString(f.v)
	}
	if b.Len() == n {
		b.WriteByte('?')
	}
	return b.String()
}

func orUnknown(s string) string {
	if s == "" {
		return "?"
	}
	return s
}

// KeyOf is w's pd_pairing key for GET /workers.
func KeyOf(w *workers.Worker) string { return DescriptorOf(w).Key() }

// Mode is --pd-pairing-mode. The zero value is Lenient, SMG's default, so a
// Selector built without one pairs as SMG does out of the box.
type Mode uint8

const (
	Lenient Mode = iota
	Strict
	Off
)

// ParseMode parses the CLI spelling (off, lenient, strict).
func ParseMode(s string) (Mode, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "lenient":
		return Lenient, nil
	case "strict":
		return Strict, nil
	case "off":
		return Off, nil
	}
	return Lenient, fmt.Errorf("invalid pd pairing mode %q: want off, lenient or strict", s)
}

func (m Mode) String() string {
	switch m {
	case Lenient:
		return "lenient"
	case Strict:
		return "strict"
	case Off:
		return "off"
	}
	return fmt.Sprintf("Mode(%d)", uint8(m))
}

// Mismatch returns "" when prefill p may hand its KV cache to decode d under
// m, else the first failing component as SMG names it ("transport",
// "unknown transport", "kv_cache_dtype", ...).
func Mismatch(p, d Descriptor, m Mode) string {
	if m == Off {
		return ""
	}
	strict := m == Strict
	switch {
	case p.Runtime == "" || d.Runtime == "":
		if strict {
			return "unknown runtime"
		}
	case p.Runtime != d.Runtime:
		return "runtime"
	}
	// An explicit protocol is the operator's assertion: compared whole, and
	// nothing derived is consulted.
	switch {
	case p.Explicit != "" && d.Explicit != "":
		if p.Explicit != d.Explicit {
			return "pairing_protocol"
		}
		return ""
	case p.Explicit != "" || d.Explicit != "":
		if strict {
			return "unknown pairing_protocol"
		}
	}
	facts := [...]struct{ name, a, b string }{
		{"transport", p.Transport, d.Transport},
		{LabelKVCacheDType, p.KVCacheDType, d.KVCacheDType},
		{LabelPageSize, p.PageSize, d.PageSize},
		{LabelAttentionBackend, p.AttentionBackend, d.AttentionBackend},
		{LabelModelDType, p.ModelDType, d.ModelDType},
	}
	for i, f := range facts {
		switch {
		case f.a != "" && f.b != "":
			if f.a != f.b {
				return f.name
			}
		case f.a == "" && f.b == "" && i > 0:
			// A layout fact neither leg reports is not compared at all;
			// an unknown transport is still a strict-mode mismatch.
		default:
			if strict {
				return "unknown " + f.name
			}
		}
	}
	// Versions only matter under strict, and only when both legs report one,
	// so a rolling upgrade keeps pairing in lenient mode.
	if strict && p.Version != "" && d.Version != "" && p.Version != d.Version {
		return "version"
	}
	return ""
}
