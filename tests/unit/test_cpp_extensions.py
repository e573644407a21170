"""Kernel builds under $PAGODA_CACHE_DIR: a build lock left behind by a process killed mid-build (torch's
builder waits on its lock file with no deadline) does not hang the next start; the one CPU kernel library
registers every op csrc/ops.h declares; and whichever ninja PATH finds first, the build is the ninja wheel's."""

import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from pagoda import cpp_extensions
from pagoda.config.paths import cache_dir
from pagoda.ops import cpu_library

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler: the kernels cannot be built here"),
]


def load_in_a_new_process(env) -> subprocess.CompletedProcess:
    """Load the kernel library (built already by this process) in a fresh process; it prints whether its ops
    registered."""
    load = textwrap.dedent(f"""
        from pagoda import cpp_extensions
        from pagoda.ops import cpu_library
        cpp_extensions.build_and_load({cpu_library._library.prefix!r}, cpu_library.SOURCES)
        import torch
        print(hasattr(torch.ops.pagoda_cpu, "rms_norm"))
    """)
    return subprocess.run([sys.executable, "-c", load], capture_output=True, text=True, timeout=180, env=env)


def test_a_stale_build_lock_from_a_killed_process_does_not_hang_the_next_load():
    assert cpu_library.available()
    extension = cpu_library._library
    name = cpp_extensions.build_name(extension.prefix, extension.source, cpp_extensions.kernel_cflags())
    stale = cache_dir() / "cpu_kernels" / name / "lock"
    stale.touch()  # what torch's builder leaves when its process is killed while it holds the lock
    try:
        proc = load_in_a_new_process(os.environ)
    except subprocess.TimeoutExpired:
        pytest.fail("loading the built kernels waited on the stale lock")
    finally:
        stale.unlink(missing_ok=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "True"


def test_the_library_registers_every_op_its_headers_declare():
    assert cpu_library.available()
    headers = "".join(h.read_text() for h in sorted(cpp_extensions.INCLUDE_DIR.glob("*.h")))
    names = re.findall(r'Schema =\s*"(\w+)\(', headers)
    assert len(names) == len(set(names)) >= 14
    assert "shm_unlink" in names  # the shared-memory all-reduce is in the one library (csrc/shm_group.h)
    assert [name for name in names if not hasattr(torch.ops.pagoda_cpu, name)] == []
    assert hasattr(torch.classes.pagoda_cpu, "ShmGroup")


def test_the_same_sources_in_two_checkouts_get_two_build_directories(tmp_path):
    """torch's build.ninja holds absolute paths: one shared directory was rebuilt by each checkout in turn."""
    names = []
    for checkout in ("a", "b"):
        (tmp_path / checkout).mkdir()
        source = tmp_path / checkout / "kernel.cpp"
        source.write_text("int f() { return 1; }\n")
        names.append(cpp_extensions.build_name("pagoda_probe_", source, ["-O3"]))
    assert names[0] != names[1]
    assert names[0] == cpp_extensions.build_name("pagoda_probe_", tmp_path / "a" / "kernel.cpp", ["-O3"])


def test_another_ninja_first_on_path_is_not_run(tmp_path):
    """Ninja versions hash a build's command lines differently: a process that ran the system's ninja took the
    build of one that ran the wheel's (the venv's bin/ first on PATH) as stale and rebuilt the whole library."""
    assert cpu_library.available()  # built by this process, with the wheel's ninja
    other = tmp_path / "bin"
    other.mkdir()
    ran = tmp_path / "ran"
    (other / "ninja").write_text(f"#!/bin/sh\necho \"$@\" >> {ran}\nexit 1\n")
    (other / "ninja").chmod(0o755)
    proc = load_in_a_new_process({**os.environ, "PATH": f"{other}{os.pathsep}{os.environ.get('PATH', '')}"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "True"
    assert not ran.exists(), ran.read_text()
