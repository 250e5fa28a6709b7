package pairing

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/smg-project/smg-extproc/pkg/workers"
)

// mk builds a healthy worker; kv is the KVConnector field.
func mk(id string, t workers.Type, runtime, kv string, labels map[string]string) *workers.Worker {
	w := &workers.Worker{ID: id, URL: "http://" + id + ":8000", Type: t, Runtime: runtime, KVConnector: kv, Labels: labels}
	w.SetHealthy(true)
	return w
}

type kv = map[string]string

func TestKeyOf(t *testing.T) {
	tests := []struct {
		name   string
		rt, kv string
		labels kv
		want   string
	}{
		// Checklist 58.
		{"vllm nixl field with dtype and block_size", "vllm", "NixlConnector", kv{"kv_cache_dtype": "auto", "block_size": "16"}, "vllm/nixl/dtype=auto,page=16"},
		{"sglang without labels", "sglang", "", nil, "sglang/?/?"},
		{"explicit label", "sglang", "", kv{"pairing_protocol": "blue"}, "blue"},
		// Layout order, lower-casing, version excluded.
		{"vllm full layout", "vllm", "NixlConnector", kv{
			"version": "0.27.1", "kv_cache_dtype": "AUTO", "block_size": "16",
			"attention_backend": "FLASH_ATTN", "model_dtype": "torch.bfloat16",
		}, "vllm/nixl/dtype=auto,page=16,attn=flash_attn,model=torch.bfloat16"},
		{"page_size wins over block_size", "vllm", "NixlConnector", kv{"page_size": "32", "block_size": "16"}, "vllm/nixl/page=32"},
		{"sglang backend and page", "sglang", "", kv{"disaggregation_transfer_backend": "NIXL", "page_size": "64"}, "sglang/nixl/page=64"},
		{"sglang ignores kv_connector", "sglang", "NixlConnector", nil, "sglang/?/?"},
		{"tokenspeed defaults to mooncake", "tokenspeed", "", kv{"version": "0.3.0"}, "tokenspeed/mooncake/?"},
		{"tokenspeed backend label", "tokenspeed", "", kv{"disaggregation_transfer_backend": "nixl"}, "tokenspeed/nixl/?"},
		{"vllm connector only", "vllm", "NixlConnector", nil, "vllm/nixl/?"},
		{"vllm connector label fallback", "vllm", "", kv{"kv_connector": "MooncakeStoreConnector"}, "vllm/mooncake/?"},
		{"vllm field wins over label", "vllm", "NixlConnector", kv{"kv_connector": "MooncakeConnector"}, "vllm/nixl/?"},
		{"vllm other connector lower-cased", "vllm", "LMCacheConnectorV1", nil, "vllm/lmcacheconnectorv1/?"},
		{"vllm moriio read", "vllm", "MoRIIOConnector", kv{"moriio_mode": "read"}, "vllm/moriio-read/?"},
		{"vllm moriio write", "vllm", "MoRIIOConnector", kv{"moriio_mode": "WRITE"}, "vllm/moriio-write/?"},
		{"vllm moriio without mode", "vllm", "MoRIIOConnector", nil, "vllm/moriio/?"},
		{"vllm no connector", "vllm", "", nil, "vllm/?/?"},
		{"other runtime has no transport", "trtllm", "", kv{"disaggregation_transfer_backend": "nixl"}, "trtllm/?/?"},
		{"unknown runtime", "", "", nil, "?/?/?"},
		{"annotation label", "vllm", "", kv{"smg.ai/pairing-protocol": "green"}, "green"},
		{"label wins over annotation", "vllm", "", kv{"pairing_protocol": "blue", "smg.ai/pairing-protocol": "green"}, "blue"},
		{"explicit trimmed", "vllm", "", kv{"pairing_protocol": "  blue "}, "blue"},
		{"blank explicit ignored", "vllm", "", kv{"pairing_protocol": "  ", "smg.ai/pairing-protocol": "green"}, "green"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			assert.Equal(t, tt.want, KeyOf(mk("w", workers.Prefill, tt.rt, tt.kv, tt.labels)))
		})
	}
}

func TestDescriptorOf(t *testing.T) {
	d := DescriptorOf(mk("w", workers.Decode, "VLLM", " NixlConnector ", kv{
		"version": " 1.2 ", "kv_cache_dtype": "FP8", "block_size": "16", "attention_backend": "Flash", "model_dtype": "BF16",
	}))
	assert.Equal(t, Descriptor{
		Runtime: "vllm", Transport: "nixl", Version: "1.2",
		KVCacheDType: "fp8", PageSize: "16", AttentionBackend: "flash", ModelDType: "bf16",
	}, d)
}

func TestParseMode(t *testing.T) {
	tests := []struct {
		in      string
		want    Mode
		wantErr bool
	}{
		{"off", Off, false},
		{"lenient", Lenient, false},
		{"strict", Strict, false},
		{" Strict ", Strict, false},
		{"", Lenient, true},
		{"loose", Lenient, true},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			m, err := ParseMode(tt.in)
			if tt.wantErr {
				require.Error(t, err)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.want, m)
			assert.Equal(t, tt.want.String(), m.String())
		})
	}
	var zero Mode
	assert.Equal(t, "lenient", zero.String(), "the zero Mode is SMG's default")
}

func TestMismatch(t *testing.T) {
	nixl := Descriptor{Runtime: "vllm", Transport: "nixl"}
	with := func(d Descriptor, f func(*Descriptor)) Descriptor { f(&d); return d }
	tests := []struct {
		name string
		p, d Descriptor
		want [3]string // off, lenient, strict
	}{
		{"identical", nixl, nixl, [3]string{"", "", ""}},
		{"different runtimes", Descriptor{Runtime: "sglang"}, Descriptor{Runtime: "vllm"}, [3]string{"", "runtime", "runtime"}},
		{"unknown runtime", with(nixl, func(d *Descriptor) { d.Runtime = "" }), nixl, [3]string{"", "", "unknown runtime"}},
		{"explicit equal, transports differ", with(nixl, func(d *Descriptor) { d.Explicit = "blue" }),
			Descriptor{Runtime: "vllm", Transport: "mooncake", Explicit: "blue", Version: "9"}, [3]string{"", "", ""}},
		{"explicit differ", with(nixl, func(d *Descriptor) { d.Explicit = "blue" }), with(nixl, func(d *Descriptor) { d.Explicit = "red" }),
			[3]string{"", "pairing_protocol", "pairing_protocol"}},
		{"explicit equal, runtimes differ", Descriptor{Runtime: "sglang", Explicit: "blue"}, Descriptor{Runtime: "vllm", Explicit: "blue"},
			[3]string{"", "runtime", "runtime"}},
		{"explicit one side, facts agree", with(nixl, func(d *Descriptor) { d.Explicit = "blue" }), nixl,
			[3]string{"", "", "unknown pairing_protocol"}},
		{"explicit one side, facts differ", with(nixl, func(d *Descriptor) { d.Explicit = "blue" }),
			Descriptor{Runtime: "vllm", Transport: "mooncake"}, [3]string{"", "transport", "unknown pairing_protocol"}},
		{"transport differ", nixl, Descriptor{Runtime: "vllm", Transport: "mooncake"}, [3]string{"", "transport", "transport"}},
		{"transport unknown on prefill", Descriptor{Runtime: "vllm"}, nixl, [3]string{"", "", "unknown transport"}},
		{"transport unknown on both", Descriptor{Runtime: "sglang"}, Descriptor{Runtime: "sglang"}, [3]string{"", "", "unknown transport"}},
		{"dtype differ", with(nixl, func(d *Descriptor) { d.KVCacheDType = "fp8" }), with(nixl, func(d *Descriptor) { d.KVCacheDType = "auto" }),
			[3]string{"", "kv_cache_dtype", "kv_cache_dtype"}},
		{"page differ", with(nixl, func(d *Descriptor) { d.PageSize = "16" }), with(nixl, func(d *Descriptor) { d.PageSize = "32" }),
			[3]string{"", "page_size", "page_size"}},
		{"attn differ", with(nixl, func(d *Descriptor) { d.AttentionBackend = "a" }), with(nixl, func(d *Descriptor) { d.AttentionBackend = "b" }),
			[3]string{"", "attention_backend", "attention_backend"}},
		{"model differ", with(nixl, func(d *Descriptor) { d.ModelDType = "a" }), with(nixl, func(d *Descriptor) { d.ModelDType = "b" }),
			[3]string{"", "model_dtype", "model_dtype"}},
		{"dtype on one side", with(nixl, func(d *Descriptor) { d.KVCacheDType = "auto" }), nixl, [3]string{"", "", "unknown kv_cache_dtype"}},
		{"page on one side", nixl, with(nixl, func(d *Descriptor) { d.PageSize = "16" }), [3]string{"", "", "unknown page_size"}},
		{"attn on one side", nixl, with(nixl, func(d *Descriptor) { d.AttentionBackend = "x" }), [3]string{"", "", "unknown attention_backend"}},
		{"model on one side", nixl, with(nixl, func(d *Descriptor) { d.ModelDType = "x" }), [3]string{"", "", "unknown model_dtype"}},
		{"first failing component wins", with(nixl, func(d *Descriptor) { d.KVCacheDType = "fp8"; d.PageSize = "1" }),
			Descriptor{Runtime: "vllm", Transport: "mooncake", KVCacheDType: "auto", PageSize: "2"}, [3]string{"", "transport", "transport"}},
		{"dtype before page", with(nixl, func(d *Descriptor) { d.KVCacheDType = "fp8"; d.PageSize = "1" }),
			with(nixl, func(d *Descriptor) { d.KVCacheDType = "auto"; d.PageSize = "2" }), [3]string{"", "kv_cache_dtype", "kv_cache_dtype"}},
		{"versions differ", with(nixl, func(d *Descriptor) { d.Version = "1" }), with(nixl, func(d *Descriptor) { d.Version = "0" }),
			[3]string{"", "", "version"}},
		{"version on one side", with(nixl, func(d *Descriptor) { d.Version = "1" }), nixl, [3]string{"", "", ""}},
		{"layout before version", with(nixl, func(d *Descriptor) { d.Version = "1"; d.PageSize = "1" }),
			with(nixl, func(d *Descriptor) { d.Version = "0" }), [3]string{"", "", "unknown page_size"}},
	}
	modes := [3]Mode{Off, Lenient, Strict}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for i, m := range modes {
				assert.Equal(t, tt.want[i], Mismatch(tt.p, tt.d, m), "mode %s", m)
			}
		})
	}
}

// TestMismatchFromWorkers covers checklist 60, 61 and 63 from registered
// workers rather than hand-built descriptors.
func TestMismatchFromWorkers(t *testing.T) {
	tests := []struct {
		name         string
		p, d         *workers.Worker
		off, le, str string
	}{
		{"60: unknown transport vs nixl",
			mk("p", workers.Prefill, "vllm", "", nil), mk("d", workers.Decode, "vllm", "NixlConnector", nil),
			"", "", "unknown transport"},
		{"61: versions 1 and 0",
			mk("p", workers.Prefill, "vllm", "NixlConnector", kv{"version": "1"}), mk("d", workers.Decode, "vllm", "NixlConnector", kv{"version": "0"}),
			"", "", "version"},
		{"62: across transports",
			mk("p", workers.Prefill, "vllm", "NixlConnector", nil), mk("d", workers.Decode, "vllm", "MooncakeConnector", nil),
			"", "transport", "transport"},
		{"63: blue/blue across transports",
			mk("p", workers.Prefill, "vllm", "NixlConnector", kv{"pairing_protocol": "blue"}), mk("d", workers.Decode, "vllm", "MooncakeConnector", kv{"pairing_protocol": "blue"}),
			"", "", ""},
		{"63: blue/red",
			mk("p", workers.Prefill, "vllm", "NixlConnector", kv{"pairing_protocol": "blue"}), mk("d", workers.Decode, "vllm", "NixlConnector", kv{"pairing_protocol": "red"}),
			"", "pairing_protocol", "pairing_protocol"},
		{"63: explicit on one side",
			mk("p", workers.Prefill, "vllm", "NixlConnector", kv{"pairing_protocol": "blue"}), mk("d", workers.Decode, "vllm", "NixlConnector", nil),
			"", "", "unknown pairing_protocol"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, d := DescriptorOf(tt.p), DescriptorOf(tt.d)
			assert.Equal(t, tt.off, Mismatch(p, d, Off))
			assert.Equal(t, tt.le, Mismatch(p, d, Lenient))
			assert.Equal(t, tt.str, Mismatch(p, d, Strict))
		})
	}
}
