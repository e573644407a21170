"""The wheel (what the container image installs) carries every C++ source and header the kernels are
built from on first use: a missing one silently costs the fused kernels (the engine falls back to torch)."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_carries_every_kernel_source(tmp_path):
    tree = tmp_path / "src"
    tree.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in ("runtime", "operator"):
        shutil.copytree(ROOT / name, tree / name, ignore=ignore)
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(tree), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "wheels")], check=True, capture_output=True)

    (wheel,) = (tmp_path / "wheels").glob("pagoda-*.whl")
    packaged = set(zipfile.ZipFile(wheel).namelist())
    sources = {str(p.relative_to(ROOT / "runtime")) for pattern in ("*.cpp", "*.h")
               for p in (ROOT / "runtime" / "pagoda").rglob(pattern)}
    assert sources, "no kernel sources found: the test looks in the wrong place"
    assert sources <= packaged, f"left out of the wheel: {sorted(sources - packaged)}"
