#!/usr/bin/env bash
# Local stack for `make run`: fake SGLang prefill (:31000, bootstrap :8998),
# fake SGLang decode (:31001) and the gateway on :30000. Ctrl-C stops all.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-30000}
pids=()
cleanup() {
	trap - INT TERM EXIT
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
	wait 2>/dev/null || true
	echo "stopped"
}
trap cleanup INT TERM EXIT
bin/fake-engine sglang --mode prefill --http-port 31000 --bootstrap-port 8998 & pids+=($!)
bin/fake-engine sglang --mode decode --http-port 31001 & pids+=($!)
bin/smg-extproc launch --pd-disaggregation --host 127.0.0.1 --port "$PORT" --prometheus-port 29000 \
	--prefill http://127.0.0.1:31000 8998 --decode http://127.0.0.1:31001 \
	--policy round_robin --log-format console --envoy-access-log - --envoy-path "$ENVOY_BIN" & pids+=($!)
echo "gateway: http://127.0.0.1:$PORT  (metrics :29000/metrics)  — Ctrl-C to stop"
wait -n "${pids[@]}"
