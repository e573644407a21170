"""The aarch64 kernels run, on this x86 machine: neon_kernels_harness.cpp (the bfloat16 matmul micro-kernel
each aarch64 level selects, argmax, the NEON SiLU-and-multiply, against scalar references) is cross-compiled
with g++-aarch64-linux-gnu at each level's flags and run under qemu-aarch64 (``-cpu max``: every extension,
BF16 included). Skipped, saying which, where the cross compiler or qemu-user is missing
(``apt-get install g++-aarch64-linux-gnu qemu-user``)."""

import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from pagoda.platform.isa import LEVEL_FLAGS

pytestmark = pytest.mark.kernels

ROOT = Path(__file__).resolve().parents[2]
CXX = "aarch64-linux-gnu-g++"
QEMU = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")
HARNESS = Path(__file__).with_name("neon_kernels_harness.cpp")


def include_flags() -> list[str]:
    """torch's headers as system headers (the harness uses only c10's header-only BFloat16), and the kernels'
    csrc/ as our own, so that -Werror covers them."""
    from torch.utils import cpp_extension

    paths = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    return [flag for path in paths for flag in ("-isystem", path)] + ["-I", str(ROOT / "runtime/pagoda/csrc")]


def build_harness(level: str, out: Path) -> subprocess.CompletedProcess:
    command = [CXX, "-std=c++17", "-O3", "-ffast-math", "-Wall", "-Wextra", "-Werror", "-static",
               *LEVEL_FLAGS[level], *include_flags(), str(HARNESS), "-o", str(out)]
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(shutil.which(CXX) is None, reason=f"{CXX} is not installed (apt-get install g++-aarch64-linux-gnu)")
@pytest.mark.skipif(QEMU is None, reason="qemu-aarch64 is not installed (apt-get install qemu-user): the aarch64 "
                                         "kernels are only compiled here (tests/test_cross_compile.py), not run")
@pytest.mark.parametrize("level", ["neon", "neonbf16"])
def test_aarch64_kernels_match_the_scalar_reference_under_qemu(level, tmp_path):
    binary = tmp_path / f"harness_{level}"
    built = build_harness(level, binary)
    assert built.returncode == 0, f"the harness at {level} did not build:\n{built.stderr[-4000:]}"
    run = subprocess.run([QEMU, "-cpu", "max", str(binary)], capture_output=True, text=True, timeout=600)
    lines = run.stdout.splitlines()
    failed = [line for line in lines if line.startswith("FAIL")]
    assert run.returncode == 0 and not failed, "\n".join(failed[:40]) + run.stderr[-2000:]
    # the level's own matmul kernel ran (BFMMLA/BFDOT at neonbf16), and every check printed
    assert lines[0] == f"isa {level}" and lines[-1] == "0 failed"
    checks = [line for line in lines if line.startswith("ok ")]
    assert sum(line.startswith("ok matmul") for line in checks) == 360
    assert sum(line.startswith("ok argmax") for line in checks) == 30
    assert sum(line.startswith("ok silu_and_mul") for line in checks) == 16
    assert sum(line.startswith("ok decode_attention") for line in checks) == 56
