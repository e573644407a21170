#!/usr/bin/env bash
# Pagoda's GPU path checked on a borrowed GPU in one command, under 8 minutes (docs/gpu.md):
#   make gpu-wheels                      (here, with PyPI: the wheels the GPU machine lacks, into .whl/)
#   bash scripts/gpu-check.sh            (there: the tree copied with .whl/; results under $OUT)
# Options go to scripts/gpu_check.py run: --budget S, --only STEP..., --workers N; --plan and --check-args
# print the steps or check the arguments without running anything.
#
# PAGODA_GPU_CHECK_DRY_RUN=1 rehearses it on a CPU: a venv that mimics the GPU machine (torch, triton,
# transformers and the rest of what it has; scripts/gpu-rehearsal-venv.sh), the same wheel list, Triton's
# interpreter, smaller selections. It proves the imports, the wheels and the output files.
# PAGODA_GPU_CHECK_PYTHON=PATH runs the check with that Python and no wheels (make test-gpu: a full venv).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/build/gpu-check}
DRY_RUN=${PAGODA_GPU_CHECK_DRY_RUN:-0}
[ "$DRY_RUN" = "" ] && DRY_RUN=0
export OUT PAGODA_GPU_CHECK_DRY_RUN=$DRY_RUN

MODE=run
ARGS=()
for arg in "$@"; do
    case "$arg" in
        --plan) MODE=plan ;;
        --check-args) MODE=check-args ;;
        *) ARGS+=("$arg") ;;
    esac
done

WHEEL_ARGS=()
if [ -n "${PAGODA_GPU_CHECK_PYTHON:-}" ]; then
    PYTHON=$PAGODA_GPU_CHECK_PYTHON
elif [ "$DRY_RUN" != 0 ]; then
    # the rehearsal's venv and the same pins built for its Python (a CPU torch for 3.12 is not at hand)
    VENV=${PAGODA_GPU_REHEARSAL_VENV:-$ROOT/build/gpu-rehearsal/venv}
    PYTHON=$VENV/bin/python
    [ "$MODE" = run ] || [ -x "$PYTHON" ] || PYTHON=python3  # --plan, --check-args: any Python will do
    if [ "$MODE" = run ]; then
        VENV=$VENV bash "$ROOT/scripts/gpu-rehearsal-venv.sh"
        WHEELS=$(dirname "$VENV")/wheels
        PYTHON_VERSION=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
        LIST_SUM=$(cksum < "$ROOT/scripts/gpu-wheels.txt")
        if [ "$PYTHON_VERSION" = 3.12 ]; then
            WHEELS=$ROOT/.whl
        elif [ "$(cat "$WHEELS/.list-cksum" 2>/dev/null)" != "$LIST_SUM" ]; then
            rm -rf "$WHEELS"
            PYTHON_VERSION=$PYTHON_VERSION PYTHON=$PYTHON bash "$ROOT/scripts/gpu-wheels.sh" "$WHEELS"
            echo "$LIST_SUM" > "$WHEELS/.list-cksum"
        fi
        WHEEL_ARGS=(--wheels "$WHEELS" --target "$(dirname "$VENV")/site")
        rm -rf "$(dirname "$VENV")/site"
    fi
else
    PYTHON=${PYTHON:-python3}
    WHEEL_ARGS=(--wheels "$ROOT/.whl" --target "${TMPDIR:-/tmp}/pagoda-gpu-check-site")
    if [ "$MODE" = run ]; then
        [ -d "$ROOT/.whl" ] || { echo "gpu-check: no .whl/ folder: run make gpu-wheels first (docs/gpu.md)" >&2; exit 2; }
        rm -rf "${TMPDIR:-/tmp}/pagoda-gpu-check-site"
    fi
fi
[ "$MODE" = run ] || WHEEL_ARGS=()

mkdir -p "$OUT"
cd "$ROOT"
exec "$PYTHON" "$ROOT/scripts/gpu_check.py" "$MODE" --out "$OUT" "${WHEEL_ARGS[@]}" "${ARGS[@]}"
