#!/usr/bin/env bash
# One image build of `make images`: the build's output as it runs, and, where the base image could not be
# pulled (a machine that cannot reach its registry), one line saying what to run instead.
#   scripts/build-image.sh DOCKER build ARGS...
set -uo pipefail
log=$(mktemp "${TMPDIR:-/tmp}/pagoda-image-build.XXXXXX")
trap 'rm -f "$log"' EXIT
"$@" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
# podman/buildah, then Docker (BuildKit and the classic builder): what each says when a FROM image won't pull
pull_failed='creating build container|pinging container registry|initializing source docker://|did not resolve to an alias|failed to resolve source metadata|pull access denied|error pulling image|Error response from daemon: Get '
if [ "$status" != 0 ] && grep -qE "$pull_failed" "$log"; then
    echo "make images: the base image could not be pulled: run 'sudo scripts/local-base-image.sh', then" \
        "'make images PYTHON_BASE=localhost/python:3.11-slim-bookworm' (docs/kubernetes.md)" >&2
fi
exit "$status"
