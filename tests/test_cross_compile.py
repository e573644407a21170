"""The C++ kernels compile for aarch64 (NEON; and SVE + BF16 as on Graviton3), under Debian's cross compiler
(g++-aarch64-linux-gnu), though they cannot run here: the ARM build is checked on every x86 CI run. Syntax and
semantics only (-fsyntax-only against this torch's headers, which are the same on every architecture)."""

import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.lint

ROOT = Path(__file__).resolve().parents[1]
CXX = "aarch64-linux-gnu-g++"
SOURCES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "runtime" / "pagoda").rglob("*.cpp"))
TARGETS = {"neon": ["-march=armv8-a"], "graviton3": ["-mcpu=neoverse-v1"]}  # PAGODA_CPU_ISA=neon; native there


def include_flags() -> list[str]:
    from torch.utils import cpp_extension

    paths = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"], str(ROOT / "runtime/pagoda/csrc")]
    return [flag for path in paths for flag in ("-isystem", path)]


@pytest.mark.skipif(shutil.which(CXX) is None, reason=f"{CXX} is not installed (apt-get install g++-aarch64-linux-gnu)")
@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("source", SOURCES)
def test_compiles_for_aarch64(source, target):
    command = [CXX, "-std=c++17", "-fsyntax-only", "-O3", "-ffast-math", "-fopenmp", *TARGETS[target],
               *include_flags(), source]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{source} for {target}:\n{result.stderr[-4000:]}"


@pytest.mark.skipif(shutil.which(CXX) is None, reason=f"{CXX} is not installed (apt-get install g++-aarch64-linux-gnu)")
def test_aarch64_builds_select_the_neon_level(tmp_path):
    probe = tmp_path / "probe.cpp"
    probe.write_text('#include "cpu_isa.h"\nstatic_assert(pagoda::kIsaLevel[0] == \'n\', "not the NEON level");\n')
    result = subprocess.run([CXX, "-std=c++17", "-fsyntax-only", "-I", str(ROOT / "runtime/pagoda/csrc"), str(probe)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr

