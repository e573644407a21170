"""The Makefile's Kubernetes-side targets as a user meets them, without building anything: `make
e2e-containers` hands the tests the images `make images` built with the same IMAGE_TAG, and `make images` on a
machine that cannot pull says what to run instead (a fake DOCKER plays podman)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HINT = "make images PYTHON_BASE=localhost/python:3.11-slim-bookworm"
PODMAN_PULL_ERROR = ('Error: creating build container: initializing source docker://python:3.11-slim-bookworm: '
                     'pinging container registry registry-1.docker.io: Get "https://registry-1.docker.io/v2/": '
                     'dial tcp: lookup registry-1.docker.io: no such host')

needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="make not found")


def make(*args: str) -> subprocess.CompletedProcess:
    # -o: setup and the wheelhouse count as done, so nothing is installed or downloaded
    return subprocess.run(["make", "-o", ".venv/.pagoda-setup", "-o", "wheelhouse", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def fake_docker(tmp_path: Path, stderr: str, exit_code: int) -> Path:
    path = tmp_path / "podman"
    (tmp_path / "stderr.txt").write_text(stderr + "\n")
    path.write_text(f"#!/bin/sh\necho 'STEP 1/9: FROM python:3.11-slim-bookworm AS wheel'\n"
                    f"cat '{tmp_path / 'stderr.txt'}' >&2\nexit {exit_code}\n")
    path.chmod(0o755)
    return path


@needs_make
def test_e2e_containers_forwards_both_images_of_the_tag():
    done = make("-n", "e2e-containers", "IMAGE_TAG=9.9.9", "DOCKER=podman")
    assert done.returncode == 0, done.stderr
    (line,) = [line for line in done.stdout.splitlines() if "pytest tests/e2e" in line]
    assert "RUNTIME_IMAGE=pagoda-runtime:9.9.9" in line and "OPERATOR_IMAGE=pagoda-operator:9.9.9" in line


@needs_make
def test_images_says_what_to_run_when_the_base_cannot_be_pulled(tmp_path):
    done = make("images", f"DOCKER={fake_docker(tmp_path, PODMAN_PULL_ERROR, 125)}")
    assert done.returncode != 0
    assert "pinging container registry" in done.stdout  # podman's own words still shown
    (hint,) = [line for line in done.stderr.splitlines() if "local-base-image.sh" in line]
    assert HINT in hint


@pytest.mark.parametrize("error", [
    "Error: building at STEP \"RUN pip install torch\": exit status 1",
    ("ERROR: failed to solve: python:3.11-slim-bookworm: failed to resolve source metadata for "
     "docker.io/library/python:3.11-slim-bookworm: dial tcp: lookup registry-1.docker.io: no such host"),
])
def test_the_build_script_keeps_the_status_and_hints_only_at_a_pull_failure(tmp_path, error):
    done = subprocess.run(["bash", str(ROOT / "scripts" / "build-image.sh"), str(fake_docker(tmp_path, error, 7)),
                           "build", "."], capture_output=True, text=True, timeout=60)
    assert done.returncode == 7 and error in done.stdout
    assert (HINT in done.stderr) == ("failed to resolve source metadata" in error)


def test_the_e2e_marker_says_what_it_needs(pytestconfig):
    (e2e,) = [m for m in pytestconfig.getini("markers") if m.startswith("e2e:")]
    assert "make e2e-containers" in e2e and "podman" in e2e and "kind" not in e2e
