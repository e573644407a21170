#!/usr/bin/env bash
# End-to-end on a throwaway kind cluster: build and load both images, install the chart, apply the
# CPU sample, wait for Ready, send a chat completion through the Service, check it, tear down.
#
# Exit codes: 0 passed, 1 failed, 3 a prerequisite is missing (Docker engine, kind, kubectl, helm);
# with 3 nothing was created.
# Environment: RUNTIME_IMAGE, OPERATOR_IMAGE, DOCKER (docker), CLUSTER (pagoda-e2e), KEEP_CLUSTER=1
# to keep the cluster for debugging, READY_TIMEOUT (900s), E2E_EXPECT (a word the answer must contain).
set -euo pipefail
cd "$(dirname "$0")/.."

RUNTIME_IMAGE="${RUNTIME_IMAGE:-pagoda-runtime:0.1.0}"
OPERATOR_IMAGE="${OPERATOR_IMAGE:-pagoda-operator:0.1.0}"
DOCKER="${DOCKER:-docker}"
CLUSTER="${CLUSTER:-pagoda-e2e}"
VENV="${VENV:-.venv}"
READY_TIMEOUT="${READY_TIMEOUT:-900s}"
E2E_EXPECT="${E2E_EXPECT:-Paris}"
NAMESPACE=pagoda-e2e
SAMPLE=crds/samples/cpu-smollm2.yaml
MISSING=3

log() { printf '\n==> %s\n' "$*"; }
missing() { printf 'e2e-kind: %s\n' "$*" >&2; exit "$MISSING"; }

tool() {  # prefer the venv's copy (make setup installs helm and kubectl there)
    if [[ -x "$VENV/bin/$1" ]]; then echo "$VENV/bin/$1"; elif command -v "$1" >/dev/null 2>&1; then command -v "$1"; fi
}

# ---- prerequisites, before anything is created ----
command -v "$DOCKER" >/dev/null 2>&1 || missing "'$DOCKER' not found: install Docker (https://docs.docker.com/engine/install/)"
"$DOCKER" info >/dev/null 2>&1 || missing "no Docker engine answers ('$DOCKER info' failed): start dockerd or fix permissions"
command -v kind >/dev/null 2>&1 || missing "'kind' not found: install it (https://kind.sigs.k8s.io/docs/user/quick-start/#installation)"
KUBECTL="$(tool kubectl)"; [[ -n "$KUBECTL" ]] || missing "'kubectl' not found: run 'make setup' (installs it into $VENV/bin)"
HELM="$(tool helm)"; [[ -n "$HELM" ]] || missing "'helm' not found: run 'make setup' (installs it into $VENV/bin)"
PYTHON="$(tool python3)"; [[ -n "$PYTHON" ]] || missing "'python3' not found"

KUBECONFIG_FILE="$(mktemp)"
export KUBECONFIG="$KUBECONFIG_FILE"
PORT_FORWARD_PID=""

cleanup() {
    local rc=$?
    if [[ -n "$PORT_FORWARD_PID" ]]; then kill "$PORT_FORWARD_PID" 2>/dev/null || true; fi
    if [[ $rc -ne 0 ]]; then
        log "failed (exit $rc): state for debugging"
        "$KUBECTL" get llmd,statefulsets,pods,services -n "$NAMESPACE" -o wide 2>/dev/null || true
        "$KUBECTL" describe llmd -n "$NAMESPACE" 2>/dev/null | tail -n 30 || true
        "$KUBECTL" logs -n pagoda-system deployment/pagoda --tail 50 2>/dev/null || true
        "$KUBECTL" logs -n "$NAMESPACE" -l pagoda.dev/role=head --tail 50 2>/dev/null || true
    fi
    if [[ "${KEEP_CLUSTER:-0}" == 1 ]]; then
        log "keeping cluster $CLUSTER (kubeconfig: $KUBECONFIG_FILE)"
    else
        log "deleting cluster $CLUSTER"
        kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
        rm -f "$KUBECONFIG_FILE"
    fi
    exit "$rc"
}
trap cleanup EXIT

log "creating kind cluster $CLUSTER"
kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
kind create cluster --name "$CLUSTER" --kubeconfig "$KUBECONFIG_FILE" --wait 180s

log "building images"
make images RUNTIME_IMAGE="$RUNTIME_IMAGE" OPERATOR_IMAGE="$OPERATOR_IMAGE" DOCKER="$DOCKER"
kind load docker-image --name "$CLUSTER" "$RUNTIME_IMAGE" "$OPERATOR_IMAGE"

log "installing the chart"
"$HELM" install pagoda charts/pagoda --namespace pagoda-system --create-namespace --wait --timeout 5m \
    --set image.repository="${OPERATOR_IMAGE%:*}" --set image.tag="${OPERATOR_IMAGE##*:}" \
    --set runtimeImage="$RUNTIME_IMAGE" --set image.pullPolicy=Never

log "applying $SAMPLE"
"$KUBECTL" create namespace "$NAMESPACE"
sed "s|image: pagoda-runtime:0.1.0 |image: $RUNTIME_IMAGE |" "$SAMPLE" | "$KUBECTL" apply -n "$NAMESPACE" -f -
"$KUBECTL" wait -n "$NAMESPACE" llmd/smollm2 --for=jsonpath='{.status.phase}'=Ready --timeout "$READY_TIMEOUT"
"$KUBECTL" get -n "$NAMESPACE" llmd smollm2

log "chat completion through Service smollm2"
"$KUBECTL" port-forward -n "$NAMESPACE" svc/smollm2 18000:8000 >/dev/null 2>&1 &
PORT_FORWARD_PID=$!
"$PYTHON" - "$E2E_EXPECT" <<'PY'
import json, sys, time, urllib.request

expect = sys.argv[1]
body = json.dumps({"model": "smollm2", "temperature": 0, "max_tokens": 32,
                   "messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}]})
deadline = time.time() + 60
while True:
    try:
        req = urllib.request.Request("http://127.0.0.1:18000/v1/chat/completions", body.encode(),
                                     {"content-type": "application/json"})
        answer = json.load(urllib.request.urlopen(req, timeout=120))
        break
    except OSError as e:  # the port-forward may need a moment
        if time.time() > deadline:
            raise SystemExit(f"no answer from the Service: {e}")
        time.sleep(2)
text = answer["choices"][0]["message"]["content"]
print("answer:", repr(text), "usage:", answer.get("usage"))
assert answer["model"] == "smollm2", answer
assert answer["usage"]["completion_tokens"] > 0, answer
assert expect.lower() in text.lower(), f"expected {expect!r} in the answer"
PY

log "e2e passed"
