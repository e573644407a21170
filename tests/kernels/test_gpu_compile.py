"""The kernels compile for real GPUs (sm_80, sm_86, sm_90) on this machine too; see gpu_compile.py."""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.kernels


def test_kernels_compile_for_gpus(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, whatever an earlier run cached
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9's default, stated to silence its warning
    script = Path(__file__).with_name("gpu_compile.py")
    shards = min(os.cpu_count() or 1, 4)  # each compile is single-threaded: a shard of the kernels per core
    with ThreadPoolExecutor(shards) as pool:
        results = list(pool.map(lambda shard: subprocess.run(
            [sys.executable, str(script), str(shard), str(shards)], env=env, capture_output=True, text=True,
            timeout=600), range(shards)))
    for result in results:
        assert result.returncode == 0, result.stdout + result.stderr
    assert sum(result.stdout.count("bytes of cubin") for result in results) == 3 * 15
