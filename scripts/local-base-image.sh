#!/usr/bin/env bash
# Makes a local stand-in for python:3.11-slim-bookworm on a machine that cannot pull images:
# a debootstrap'ed Debian bookworm with Python 3.11, pip and venv, `python` and `pip` on PATH, and pip
# allowed to install system-wide (as in the slim image), imported into podman or docker.
#   sudo scripts/local-base-image.sh [IMAGE]      (default: localhost/python:3.11-slim-bookworm)
# Then: make images PYTHON_BASE=localhost/python:3.11-slim-bookworm
set -euo pipefail
image=${1:-localhost/python:3.11-slim-bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
DOCKER=${DOCKER:-$(command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1 && echo docker || echo podman)}

die() { echo "local-base-image.sh: $*" >&2; exit 3; }
[ "$(id -u)" = 0 ] || die "debootstrap needs root"
command -v debootstrap >/dev/null || die "debootstrap not found (apt-get install debootstrap)"
command -v "$DOCKER" >/dev/null || die "'$DOCKER' not found (apt-get install podman, or set DOCKER)"

root=$(mktemp -d /tmp/pagoda-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-pip,python3-venv,ca-certificates,passwd \
  bookworm "$root" "$mirror" >/dev/null
# As the slim image: `python`/`pip` exist, and pip installs into the system Python (no PEP 668 marker).
ln -sf /usr/bin/python3 "$root/usr/local/bin/python"
ln -sf /usr/bin/pip3 "$root/usr/local/bin/pip"
rm -f "$root"/usr/lib/python3*/EXTERNALLY-MANAGED
# The host's trust store, so that builds behind a TLS-inspecting proxy reach the registries as the host does.
host_ca=${HOST_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
[ -f "$host_ca" ] && cp "$host_ca" "$root/etc/ssl/certs/ca-certificates.crt"
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | "$DOCKER" import \
  --change 'ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' - "$image" >/dev/null
runtime=()
[ "$DOCKER" = podman ] && runtime=(--runtime runc)  # crun cannot set the rlimits on some hosts
echo "$image: $("$DOCKER" run --rm "${runtime[@]}" --ulimit nofile=1024:1024 --ulimit nproc=1024:1024 \
  "$image" python --version 2>&1)"
