#!/usr/bin/env bash
# A venv that mimics the lent GPU machine for PAGODA_GPU_CHECK_DRY_RUN=1 scripts/gpu-check.sh: torch, triton
# 3.6, transformers 5.17 and the machine's other packages, and nothing of the server stack (scripts/
# gpu-wheels.txt brings that). Python 3.12 where a CPU build of torch for it installs, else 3.11.
# PAGODA_GPU_REHEARSAL_PYTHON and PAGODA_GPU_REHEARSAL_TORCH (a pip requirement or wheel) override the choice.
set -euo pipefail
VENV=${VENV:?VENV must name the venv folder}
[ -f "$VENV/.pagoda-rehearsal" ] && exit 0
MACHINE=(triton==3.6.0 transformers==5.17.0 safetensors tokenizers huggingface_hub accelerate peft numpy jinja2
         prometheus-client httpx aiohttp psutil pyyaml pytest pytest-timeout pytest-xdist)
# The machine may hold these as its packages' dependencies; treated as absent, so the rehearsal installs
# them from the wheels as the check would.
ABSENT=(pydantic pydantic-core typing-inspection annotated-types fastapi starlette uvicorn sniffio)

candidates=()
if [ -n "${PAGODA_GPU_REHEARSAL_PYTHON:-}" ]; then
    candidates=("$PAGODA_GPU_REHEARSAL_PYTHON")
else
    for v in 3.12 3.11; do
        for p in "python$v" "$HOME"/.pyenv/versions/"$v"*/bin/"python$v"; do
            # (a pyenv shim is on PATH even where its version is not selected: it must run)
            "$p" -V >/dev/null 2>&1 && candidates+=("$(command -v "$p")")
        done
    done
fi
rm -rf "$VENV"
for py in "${candidates[@]}"; do
    "$py" -m venv "$VENV" || continue
    version=$("$VENV/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    torch_req=${PAGODA_GPU_REHEARSAL_TORCH:-torch==2.11.0+cpu}
    echo "gpu-rehearsal: Python $version ($py); trying $torch_req, then torch==2.13.0+cpu"
    if "$VENV/bin/pip" install --quiet "$torch_req" 2>/dev/null \
        || "$VENV/bin/pip" install --quiet "torch==2.13.0+cpu" 2>/dev/null; then
        "$VENV/bin/pip" install --quiet "${MACHINE[@]}"
        "$VENV/bin/pip" uninstall --quiet --yes "${ABSENT[@]}" 2>/dev/null || true
        "$VENV/bin/python" -c 'import torch, triton, transformers; print("gpu-rehearsal: torch", torch.__version__,
            "triton", triton.__version__, "transformers", transformers.__version__)'
        touch "$VENV/.pagoda-rehearsal"
        exit 0
    fi
    echo "gpu-rehearsal: no CPU build of torch installs for Python $version"
    rm -rf "$VENV"
done
echo "gpu-rehearsal: no Python 3.12 or 3.11 with a CPU build of torch: set PAGODA_GPU_REHEARSAL_PYTHON" >&2
exit 3
