#!/usr/bin/env bash
# make gpu-wheels: the cp312 manylinux x86_64 wheels of scripts/gpu-wheels.txt, --no-deps, into DEST (.whl/),
# for the GPU machine, which has no network (docs/gpu.md). PYTHON_VERSION=3.11 fetches the same pins for
# another Python (the CPU rehearsal's, when no 3.12 torch build is at hand).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.whl}
PY=${PYTHON:-python3}
PYTHON_VERSION=${PYTHON_VERSION:-3.12}
mapfile -t REQS < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' scripts/gpu-wheels.txt | grep -v '^$')
mkdir -p "$DEST"
rm -f "$DEST"/*.whl  # exactly the list's pins, no wheel of an older list
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --dest "$DEST" \
    --python-version "$PYTHON_VERSION" --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_28_x86_64 \
    "${REQS[@]}"
# nixl-cu13 (56 MiB): its expert-parallel kernels (nixl_ep_cu13/, 27 MiB, several torch builds) are not used
# by the KV connector; the wheel travels without them, so the list fits the tree's 64 MiB
for wheel in "$DEST"/nixl_cu1[0-9]-*.whl; do
    [ -e "$wheel" ] || continue
    "$PY" - "$wheel" <<'SLIM'
import os, sys, zipfile
path = sys.argv[1]
with zipfile.ZipFile(path) as src, zipfile.ZipFile(path + ".slim", "w", zipfile.ZIP_DEFLATED) as dst:
    for item in src.infolist():
        if not item.filename.startswith(("nixl_ep_cu12/", "nixl_ep_cu13/")):
            dst.writestr(item, src.read(item.filename))
os.replace(path + ".slim", path)
SLIM
done
TOTAL=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
echo "gpu-wheels: $(find "$DEST" -maxdepth 1 -type f -name '*.whl' | wc -l) wheels for Python $PYTHON_VERSION in $DEST," \
     "$((TOTAL / 1024)) KiB ($(awk "BEGIN {printf \"%.1f\", $TOTAL / 1048576}") MiB; the tree may carry 64 MiB)"
if [ "$TOTAL" -gt $((48 * 1024 * 1024)) ]; then
    echo "gpu-wheels: over 48 MiB: too close to the 64 MiB the GPU machine's copy of the tree may hold" >&2
    exit 1
fi
