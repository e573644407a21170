"""`make lint`'s checks as tests, so CI keeps the code, the Dockerfile, the scripts, the YAML and the
chart clean: ruff, hadolint, shellcheck, yamllint, helm lint --strict."""

import glob
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.lint

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the venv's tools, installed by `make setup`

CHECKS = {
    "ruff": ["ruff", "check", "."],
    "hadolint": ["hadolint", "Dockerfile"],
    "shellcheck": ["shellcheck", *sorted(glob.glob("scripts/*.sh", root_dir=ROOT))],
    "yamllint": ["yamllint", "crds", "charts", ".yamllint.yaml"],
    "helm": ["helm", "lint", "--strict", "charts/pagoda"],
}


@pytest.mark.parametrize("name", list(CHECKS))
def test_lint_is_clean(name):
    tool, *args = CHECKS[name]
    if not (BIN / tool).exists():
        pytest.fail(f"{tool} is not installed in {BIN}: run `make setup`")
    result = subprocess.run([str(BIN / tool), *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{name} found problems:\n{result.stdout}\n{result.stderr}"
