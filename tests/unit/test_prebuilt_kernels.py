"""The kernel library built ahead of time (python -m pagoda.entrypoints.prebuild_kernels), one per ISA level, as
the runtime image ships it: a process whose ISA level has one in PAGODA_PREBUILT_KERNELS loads it with no
compiler, for the compute kernels and the shared-memory all-reduce alike, and one built from other sources is
never taken for it."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from pagoda import cpp_extensions, platform
from pagoda.entrypoints import prebuild_kernels as prebuild

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler: nothing can be prebuilt here"),
]

LOAD = textwrap.dedent("""
    import json, logging
    import torch
    logging.basicConfig(level=logging.INFO)
    from pagoda import platform
    from pagoda.distributed import shm_allreduce
    from pagoda.ops import cpu_library
    library = str(shm_allreduce.load_library())
    print(json.dumps({"library": library, "enabled": platform.cpu_kernels_enabled()[0],
                      "kernels": cpu_library.available(), "isa_level": torch.ops.pagoda_cpu.isa_level(),
                      "shm_group": hasattr(torch.classes.pagoda_cpu, "ShmGroup")}))
""")


def load_without_a_compiler(prebuilt, cache) -> subprocess.CompletedProcess:
    env = {**os.environ, "PAGODA_PREBUILT_KERNELS": str(prebuilt), "CXX": "/nonexistent/c++",
           "PAGODA_CACHE_DIR": str(cache)}
    return subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, timeout=300, env=env)


def test_a_prebuilt_library_of_this_level_loads_without_a_compiler(tmp_path):
    level = platform.cpu_isa().level
    [library] = prebuild.prebuild([level], tmp_path / "kernels", cache=tmp_path / "cache")
    assert library.parent.name.startswith(f"pagoda_cpu_{level}_")
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [library.parent.name]  # one library per level
    # again: the cache's copy, not a second compile
    assert prebuild.prebuild([level], tmp_path / "again", cache=tmp_path / "cache") == \
        [tmp_path / "again" / library.parent.name / library.name]
    proc = load_without_a_compiler(tmp_path / "kernels", tmp_path / "runtime-cache")
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert loaded == {"library": str(library), "enabled": True, "kernels": True,
                      "isa_level": level, "shm_group": True}
    assert not (tmp_path / "runtime-cache" / "cpu_kernels").exists()  # nothing was compiled

    # a library of other sources has another name: not loaded, and with no compiler the error says why
    other = tmp_path / "other"
    shutil.copytree(tmp_path / "kernels", other)
    (other / library.parent.name).rename(other / library.parent.name.replace(library.parent.name[-16:], "0" * 16))
    proc = load_without_a_compiler(other, tmp_path / "runtime-cache")
    assert proc.returncode != 0
    assert f"no C++ compiler found and no prebuilt library (none for ISA level {level} in {other})" in proc.stderr


def test_prebuilt_names_hold_what_the_library_is_built_from_not_where(tmp_path):
    source = tmp_path / "a" / "kernel.cpp"
    source.parent.mkdir()
    source.write_text("int f() { return 1; }\n")
    moved = tmp_path / "b" / "kernel.cpp"
    moved.parent.mkdir()
    moved.write_text(source.read_text())
    name = cpp_extensions.build_name
    assert name("p_", source, ["-O3"], with_paths=False) == name("p_", moved, ["-O3"], with_paths=False)
    assert name("p_", source, ["-O3"]) != name("p_", moved, ["-O3"])
    moved.write_text("int f() { return 2; }\n")
    assert name("p_", source, ["-O3"], with_paths=False) != name("p_", moved, ["-O3"], with_paths=False)


def test_prebuild_refuses_a_level_of_another_architecture(capsys):
    other = "neon" if platform.cpu_isa().arch == "x86_64" else "avx2"
    with pytest.raises(SystemExit):
        prebuild.main(["--levels", other, "--into", "/tmp/unused"])
    assert "--levels" in capsys.readouterr().err
