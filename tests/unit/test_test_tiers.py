"""`make test` (what CI runs) leaves the heavy tests out and `make test-all` runs them: the costly variants of
checks that make test keeps a cheaper one of (pyproject's `heavy` marker)."""

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
TIERS = """
import pytest

@pytest.mark.parametrize("ranks", [2, pytest.param(4, marks=pytest.mark.heavy)])
def test_sums(ranks):
    pass
"""


def pytest_command_of(target: str) -> str:
    """The pytest line `make TARGET` runs."""
    done = subprocess.run(["make", "-n", "-o", ".venv/.pagoda-setup", target, "PYTEST_ARGS=--collect-only -q"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    (line,) = [line for line in done.stdout.splitlines() if "-m pytest tests" in line]
    return line


def collected(make_line: str, tmp_path: Path) -> str:
    """What that line, with this repository's pytest settings, collects of a file with a heavy parametrization."""
    (tmp_path / "test_tiers_file.py").write_text(TIERS)
    argv = [sys.executable, *shlex.split(make_line)[1:], "-c", str(ROOT / "pyproject.toml"), "-p", "no:cacheprovider"]
    argv[argv.index("tests")] = str(tmp_path / "test_tiers_file.py")
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # seconds of plugin imports, not what this checks
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="make not found")
def test_make_test_leaves_the_heavy_tests_to_make_test_all(tmp_path):
    default = collected(pytest_command_of("test"), tmp_path)
    everything = collected(pytest_command_of("test-all"), tmp_path)
    assert "test_sums[2]" in default and "test_sums[4]" not in default
    assert "test_sums[2]" in everything and "test_sums[4]" in everything


def test_ci_runs_make_test_with_the_slowest_durations():
    lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("make ")]
    assert lines == ['make test PYTEST_ARGS="--durations=30"']
