// Package envoy renders the Envoy bootstrap the gateway runs with. The same
// text, printed by `smg-extproc envoy-config`, is the configuration for an
// Envoy managed elsewhere.
package envoy

import (
	"bytes"
	_ "embed"
	"fmt"
	"text/template"
)

//go:embed bootstrap.yaml.tmpl
var bootstrapText string

// Params are the values the bootstrap needs.
type Params struct {
	NodeID             string
	Host               string
	Port               int
	EnvoyAdminPort     int
	ControlHost        string
	ExtProcPort        int
	AdminPort          int
	MaxPayloadSize     int64
	RequestTimeoutSecs int
	// RouteTimeoutSecs bounds the decode leg in Envoy.
	RouteTimeoutSecs int
	// MessageTimeoutSecs bounds one ext_proc answer; the processor answers
	// well inside it (it enforces the request timeout itself).
	MessageTimeoutSecs int
	PDRoutes           []string
	// MaxRedirects is the number of retries after the first attempt (0: none).
	MaxRedirects int
	// AccessLogPath enables Envoy's JSON access log ("" = off).
	AccessLogPath string
}

// ControlConnectHost is where Envoy dials the Go servers: a wildcard listen
// address is reached over loopback.
func (p Params) ControlConnectHost() string {
	switch p.ControlHost {
	case "", "0.0.0.0", "::", "[::]":
		return "127.0.0.1"
	}
	return p.ControlHost
}

// Render returns the bootstrap YAML.
func Render(p Params) ([]byte, error) {
	t, err := template.New("bootstrap").Option("missingkey=error").Parse(bootstrapText)
	if err != nil {
		return nil, fmt.Errorf("parse bootstrap template: %w", err)
	}
	var b bytes.Buffer
	if err := t.Execute(&b, p); err != nil {
		return nil, fmt.Errorf("render bootstrap: %w", err)
	}
	return b.Bytes(), nil
}
