"""Every CPU ISA level this host can execute, built and tested from this one machine: the C++ kernels' unit
tests (attention, fused ops, the bfloat16 matmul) run in a subprocess with PAGODA_CPU_ISA=<level>, so the
kernels compile with that level's flags (an AVX-512 machine also tests its AVX2 and generic code) and are
compared against the torch reference there. A process can load one build of the kernel library, hence a
process per level. On a CPU with AMX the avx512bf16 level runs twice: on the tiles, and with PAGODA_CPU_AMX=0 on
the vdpbf16ps kernels a CPU without them (Zen 4) runs."""

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


# (level, PAGODA_CPU_AMX) a subprocess runs at: where the CPU has AMX, avx512bf16 without it too (Zen 4's kernels)
HAS_AMX = "avx512bf16" in LEVELS and "amx" in cpu_isa.detect("native").features
RUNS = [(level, "1") for level in LEVELS] + ([("avx512bf16", "0")] if HAS_AMX else [])


@pytest.mark.parametrize("level, amx", [
    pytest.param(level, amx, marks=pytest.mark.heavy, id=level) if (level, amx) == (OWN_LEVEL, "1")
    else pytest.param(level, amx, id=level if amx == "1" else f"{level}-no-amx") for level, amx in RUNS])
def test_kernels_at_level(level, amx):
    env = {**os.environ, "PAGODA_CPU_ISA": level, "PAGODA_CPU_KERNELS": "1", "PAGODA_CPU_AMX": amx}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *KERNEL_TESTS],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, f"kernels at {level}, PAGODA_CPU_AMX={amx}:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    assert " passed" in proc.stdout and " failed" not in proc.stdout
