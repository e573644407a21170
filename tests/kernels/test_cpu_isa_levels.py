"""Every CPU ISA level this host can execute, built and tested from this one machine: the C++ kernels' unit
tests (attention, fused ops, the bfloat16 matmul) run in a subprocess with PAGODA_CPU_ISA=<level>, so the
kernels compile with that level's flags (an AVX-512 machine also tests its AVX2 and generic code) and are
compared against the torch reference there. A process can load one build of the kernel library, hence a
process per level."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagoda.platform import isa as cpu_isa

pytestmark = [
    pytest.mark.kernels,
    pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler: the kernels cannot be built here"),
]

ROOT = Path(__file__).resolve().parents[2]
KERNEL_TESTS = ["tests/unit/test_bf16_matmul_cpu.py", "tests/unit/test_fp8_matmul_cpu.py", "tests/unit/test_fused_cpu_ops.py",
                "tests/unit/test_cpu_attention_kernels.py",
                "tests/kernels/test_cpu_attention_variants.py"]  # fp8 caches, windows, soft-caps
LEVELS = cpu_isa.detect("native").executable_levels
# this process's own level: make test runs KERNEL_TESTS at it in-process already, so its run here is heavy
OWN_LEVEL = cpu_isa.detect().level


@pytest.mark.parametrize("level", [pytest.param(level, marks=pytest.mark.heavy) if level == OWN_LEVEL else level
                                   for level in LEVELS])
def test_kernels_at_level(level):
    env = {**os.environ, "PAGODA_CPU_ISA": level, "PAGODA_CPU_KERNELS": "1"}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *KERNEL_TESTS],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, f"kernels at {level}:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    assert " passed" in proc.stdout and " failed" not in proc.stdout
