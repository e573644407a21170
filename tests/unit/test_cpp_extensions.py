"""Kernel builds under $PAGODA_CACHE_DIR: a build lock left behind by a process killed mid-build (torch's
builder waits on its lock file with no deadline) does not hang the next start."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from pagoda import cpp_extensions
from pagoda.config.paths import cache_dir
from pagoda.layers import fused_cpu_ops

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler: the kernels cannot be built here"),
]


def test_a_stale_build_lock_from_a_killed_process_does_not_hang_the_next_load():
    assert fused_cpu_ops.available()
    extension = fused_cpu_ops._extension
    name = cpp_extensions.build_name(extension.prefix, extension.source, cpp_extensions.kernel_cflags())
    stale = cache_dir() / "cpu_kernels" / name / "lock"
    stale.touch()  # what torch's builder leaves when its process is killed while it holds the lock
    load = textwrap.dedent(f"""
        from pathlib import Path
        from pagoda import cpp_extensions
        cpp_extensions.build_and_load({extension.prefix!r}, Path({str(extension.source)!r}))
        import torch
        print(hasattr(torch.ops.pagoda_cpu_fused, "rms_norm"))
    """)
    try:
        proc = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True, timeout=180,
                              env=os.environ)
    except subprocess.TimeoutExpired:
        pytest.fail("loading the built kernels waited on the stale lock")
    finally:
        stale.unlink(missing_ok=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "True"
