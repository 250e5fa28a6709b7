package config

import (
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"
)

// FileWorker is one worker in the config file; the same fields as POST /workers.
type FileWorker struct {
	URL           string            `yaml:"url"`
	WorkerType    string            `yaml:"worker_type"`
	BootstrapPort *int              `yaml:"bootstrap_port"`
	RuntimeType   string            `yaml:"runtime_type"`
	Labels        map[string]string `yaml:"labels"`
	APIKey        string            `yaml:"api_key"`
	KVConnector   string            `yaml:"kv_connector"`
	KVRole        string            `yaml:"kv_role"`
	KVEngineID    string            `yaml:"kv_engine_id"`
	DPRank        *int              `yaml:"dp_rank"`
	DPSize        *int              `yaml:"dp_size"`
}

// File is a parsed config file: flag settings plus the worker list.
type File struct {
	Args    []string // settings rendered as flags, applied before the command line
	Workers []FileWorker
}

// LoadFile reads a YAML config file. Top-level keys are SMG's flag names
// (underscores or dashes); `workers` lists workers in POST /workers form, and
// `prefill`/`decode` accept the command line's short forms.
func LoadFile(path string) (*File, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read config %s: %w", path, err)
	}
	var raw map[string]yaml.Node
	if err := yaml.Unmarshal(b, &raw); err != nil {
		return nil, fmt.Errorf("parse config %s: %w", path, err)
	}
	f := &File{}
	keys := make([]string, 0, len(raw))
	for k := range raw {
		keys = append(keys, k)
	}
	sort.Strings(keys) // deterministic flag order
	t := (&Config{}).table()
	for _, k := range keys {
		node := raw[k]
		name := strings.ReplaceAll(k, "_", "-")
		switch name {
		case "workers":
			var ws []FileWorker
			if err := node.Decode(&ws); err != nil {
				return nil, fmt.Errorf("config %s: workers: %w", path, err)
			}
			f.Workers = append(f.Workers, ws...) // alongside prefill:/decode: short forms
			continue
		case "prefill":
			var ps []struct {
				URL           string `yaml:"url"`
				BootstrapPort *int   `yaml:"bootstrap_port"`
			}
			if err := node.Decode(&ps); err != nil {
				return nil, fmt.Errorf("config %s: prefill: %w", path, err)
			}
			for _, p := range ps {
				f.Workers = append(f.Workers, FileWorker{URL: p.URL, WorkerType: "prefill", BootstrapPort: p.BootstrapPort})
			}
			continue
		case "decode":
			var ds []string
			if err := node.Decode(&ds); err != nil {
				return nil, fmt.Errorf("config %s: decode: %w", path, err)
			}
			for _, d := range ds {
				f.Workers = append(f.Workers, FileWorker{URL: d, WorkerType: "decode"})
			}
			continue
		case "config":
			return nil, fmt.Errorf("config %s: a config file cannot name another config file", path)
		}
		s, ok := t[name]
		if !ok {
			return nil, fmt.Errorf("config %s: unknown setting %q", path, k)
		}
		if node.Kind != yaml.ScalarNode {
			return nil, fmt.Errorf("config %s: %s must be a scalar", path, k)
		}
		switch s.kind {
		case kBool, kIgnoreBool:
			v, err := strconv.ParseBool(node.Value)
			if err != nil {
				return nil, fmt.Errorf("config %s: %s: %w", path, k, err)
			}
			f.Args = append(f.Args, "--"+name+"="+strconv.FormatBool(v))
		default:
			f.Args = append(f.Args, "--"+name+"="+node.Value)
		}
	}
	for i, w := range f.Workers {
		if strings.TrimSpace(w.URL) == "" {
			return nil, fmt.Errorf("config %s: worker %d has no url", path, i)
		}
		switch w.WorkerType {
		case "prefill", "decode", "regular", "":
		default:
			return nil, fmt.Errorf("config %s: worker %s: worker_type %q", path, w.URL, w.WorkerType)
		}
	}
	// A file must be valid on its own (a reload has no command line to lean on).
	if _, err := Parse(f.Args); err != nil {
		return nil, fmt.Errorf("config %s: %w", path, err)
	}
	return f, nil
}

// ParseWithFile parses args; when they name --config, the file's settings
// apply first and the command line overrides them.
func ParseWithFile(args []string) (Config, *File, error) {
	c, err := Parse(args)
	if err != nil || c.ConfigFile == "" {
		return c, nil, err
	}
	f, err := LoadFile(c.ConfigFile)
	if err != nil {
		return c, nil, err
	}
	merged := append(append([]string{}, f.Args...), args...)
	c, err = Parse(merged)
	return c, f, err
}
