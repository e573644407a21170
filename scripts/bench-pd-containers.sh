#!/usr/bin/env bash
# P/D disaggregation against the same two engines as plain replicas, each engine a podman container of the
# runtime image pinned to its own core, behind `pagoda router` (docs/benchmarks.md, "P/D disaggregation").
#
#   bash scripts/bench-pd-containers.sh MODEL_DIR [RESULTS_DIR]
#
# 1. P/D: container pd-prefill (kv_producer) and pd-decode (kv_consumer), the router with --prefill-backend;
#    the KV of every prompt over --pd-threshold moves between the two containers over NIXL (UCX on the bridge).
# 2. Plain: the same two containers without --kv-transfer-config, the router's prefix policy over both.
# Each under one load of long prompts mixed with long answers (`pagoda bench serve`); the decode container's
# pagoda:nixl_* metrics give the transfer's GB/s between the containers. Needs `make images` and podman.
set -euo pipefail
MODEL_DIR=$(realpath "${1:?usage: bench-pd-containers.sh MODEL_DIR [RESULTS_DIR]}")
OUT=${2:-pd-bench}
IMAGE=${RUNTIME_IMAGE:-pagoda-runtime:0.1.0}
PAGODA=${PAGODA:-.venv/bin/pagoda}
NET=pagoda-pd-bench
ROUTER_PORT=${ROUTER_PORT:-8100}
# long prompts mixed with long answers (issue 55): prompts 512-1,536 tokens, answers 128-384
LOAD=(--input-len 1024 --output-len 256 --range-ratio 0.5 --num-prompts "${NUM_PROMPTS:-24}" --max-concurrency 8
      --warmup 2 --tokenizer "$MODEL_DIR")
mkdir -p "$OUT"
ROUTER_PID=

cleanup() {
  [ -n "$ROUTER_PID" ] && kill "$ROUTER_PID" 2>/dev/null || true
  podman rm -f -t 0 pd-prefill pd-decode >/dev/null 2>&1 || true
  podman network rm -f "$NET" >/dev/null 2>&1 || true
}
SHARED_MODEL=
finish() { cleanup; [ -z "$SHARED_MODEL" ] || rm -rf "$SHARED_MODEL"; }
trap finish EXIT
cleanup
# the image runs as uid 10001: a copy it can read (a model under /root is not), removed on exit
SHARED_MODEL=$(mktemp -d /tmp/pd-bench-model.XXXXXX)
cp -r "$MODEL_DIR/." "$SHARED_MODEL/"
chmod -R a+rX "$SHARED_MODEL"
podman network create "$NET" >/dev/null

engine() {  # NAME CPU [serve args...]: a container serving the model on one core
  local name=$1 cpu=$2
  shift 2
  podman run -d --runtime runc --ulimit nofile=1024:1024 --ulimit nproc=1024:1024 --network "$NET" \
    --name "$name" --cpuset-cpus "$cpu" -v "$SHARED_MODEL:/model:ro" -e VLLM_NIXL_SIDE_CHANNEL_HOST="$name" \
    "$IMAGE" serve /model --host 0.0.0.0 --port 8000 "$@" >/dev/null
}

address() { podman inspect --format "{{(index .NetworkSettings.Networks \"$NET\").IPAddress}}" "$1"; }

wait_ready() {  # URL [CONTAINER]: /health answers 200 (the image has prebuilt kernels: nothing compiles)
  for _ in $(seq 300); do
    curl -sf -m 5 "$1/health" >/dev/null && return 0
    if [ -n "${2:-}" ] && [ "$(podman inspect --format '{{.State.Running}}' "$2")" != true ]; then
      podman logs --tail 20 "$2" >&2
      echo "bench-pd-containers: container $2 exited" >&2
      return 1
    fi
    sleep 1
  done
  echo "bench-pd-containers: $1 not ready after 300 s" >&2
  return 1
}

measure() {  # NAME [router args...]
  local name=$1
  shift
  "$PAGODA" router --port "$ROUTER_PORT" "$@" >"$OUT/router-$name.log" 2>&1 &
  ROUTER_PID=$!
  wait_ready "http://127.0.0.1:$ROUTER_PORT"
  "$PAGODA" bench serve --base-url "http://127.0.0.1:$ROUTER_PORT" "${LOAD[@]}" \
    --result-json "$OUT/$name.json" | tee "$OUT/$name.txt"
  kill "$ROUTER_PID"
  wait "$ROUTER_PID" 2>/dev/null || true
  ROUTER_PID=
}

producer='{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}'
consumer='{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}'
engine pd-prefill 0 --kv-transfer-config "$producer"
engine pd-decode 1 --kv-transfer-config "$consumer"
P=http://$(address pd-prefill):8000
D=http://$(address pd-decode):8000
wait_ready "$P" pd-prefill
wait_ready "$D" pd-decode
measure pd --prefill-backend "$P" --backend "$D" --pd-threshold 256
curl -sf "$D/metrics" | grep -E '^pagoda:nixl_(bytes_transferred|xfer_time_seconds)_(sum|count)|^pagoda:nixl_num_(failed|recomputed)' \
  | tee "$OUT/pd-nixl-metrics.txt"
awk '/bytes_transferred_sum/ {b += $2} /xfer_time_seconds_sum/ {s += $2} /xfer_time_seconds_count/ {n += $2}
     END { if (s > 0) printf "NIXL between the containers: %d pulls, %.1f MB, %.2f GB/s, %.1f ms a pull\n",
                            n, b / 1e6, b / s / 1e9, 1000 * s / n }' "$OUT/pd-nixl-metrics.txt" | tee "$OUT/nixl.txt"

podman rm -f -t 0 pd-prefill pd-decode >/dev/null
engine pd-prefill 0
engine pd-decode 1
A=http://$(address pd-prefill):8000
B=http://$(address pd-decode):8000
wait_ready "$A" pd-prefill
wait_ready "$B" pd-decode
measure replicas --backend "$A" --backend "$B" --policy prefix
echo "results in $OUT/ (pd.json, replicas.json, nixl.txt)"
