"""scripts/e2e-kind.sh stops before creating anything when a prerequisite is missing, with a clear
message and exit code 3 (the real run needs Docker and kind: `make e2e-kind`)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.operator

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "e2e-kind.sh"


def fake_tool(bindir: Path, name: str, exit_code: int) -> None:
    path = bindir / name
    path.write_text(f"#!/bin/sh\nexit {exit_code}\n")
    path.chmod(0o755)


def run(bindir: Path) -> subprocess.CompletedProcess:
    """Only the fakes and `dirname` on PATH: whatever is installed here, nothing real is reached."""
    (bindir / "dirname").symlink_to(shutil.which("dirname"))
    env = {**os.environ, "PATH": str(bindir), "DOCKER": "docker"}
    return subprocess.run([shutil.which("bash"), str(SCRIPT)], capture_output=True, text=True, env=env, timeout=60)


def test_no_docker_engine(tmp_path):
    fake_tool(tmp_path, "docker", 1)  # the CLI is there, the engine does not answer
    result = run(tmp_path)
    assert result.returncode == 3 and "no Docker engine" in result.stderr


def test_no_kind(tmp_path):
    fake_tool(tmp_path, "docker", 0)
    result = run(tmp_path)
    assert result.returncode == 3 and "'kind' not found" in result.stderr
