"""The C++ kernels compile for every aarch64 level (generic; neon: ARMv8.0 NEON; neonbf16: + BF16's BFDOT/BFMMLA;
and a native Graviton3 build) under Debian's cross compiler (g++-aarch64-linux-gnu), with -Werror, though they
cannot run here: the ARM build is checked on every x86 CI run. The torch sources are checked for syntax and
semantics (-fsyntax-only against this torch's headers, which are the same on every architecture); the NEON
micro-kernels, which need code generation to check intrinsics' lanes and target features, are compiled to
object code through tests/kernels/neon_kernels_harness.cpp (run under qemu by
tests/kernels/test_neon_kernels_qemu.py where qemu-user is installed)."""

import os
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pagoda.platform.isa import LEVEL_FLAGS, LEVELS

pytestmark = [pytest.mark.lint, pytest.mark.skipif(
    shutil.which("aarch64-linux-gnu-g++") is None,
    reason="aarch64-linux-gnu-g++ is not installed (apt-get install g++-aarch64-linux-gnu)")]

ROOT = Path(__file__).resolve().parents[1]
CXX = "aarch64-linux-gnu-g++"
CSRC = ROOT / "runtime" / "pagoda" / "csrc"
SOURCES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "runtime" / "pagoda").rglob("*.cpp"))
# PAGODA_CPU_ISA=neon and =neonbf16 (the flags the platform builds them with), and a native Graviton3 build
TARGETS = {level: LEVEL_FLAGS[level] for level in LEVELS["aarch64"]} | {"graviton3": ["-mcpu=neoverse-v1"]}
LEVEL_OF_TARGET = {**{level: level for level in LEVELS["aarch64"]}, "graviton3": "neonbf16"}
NEON_TARGETS = [target for target in TARGETS if LEVEL_OF_TARGET[target] != "generic"]


def level_dependent(source: str) -> bool:
    """Whether a source's code differs per level (it asks cpu_isa.h); the others are checked at one level."""
    return "cpu_isa.h" in (ROOT / source).read_text()


# each check is 2-8 s of parsing torch's headers: every level for the sources that differ per level, one for
# the rest (the Graviton3 build differs from neonbf16 only in SVE, which no source uses: object code below)
SYNTAX_CASES = [(source, level) for source in SOURCES
                for level in (LEVELS["aarch64"] if level_dependent(source) else ("neon",))]
WARNINGS = ["-Wall", "-Werror"]


def include_flags() -> list[str]:
    """torch's headers as system headers; csrc/ as our own, so that -Werror covers it."""
    from torch.utils import cpp_extension

    paths = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    return [flag for path in paths for flag in ("-isystem", path)] + ["-I", str(CSRC)]


def compile_for(target: str, *args: str) -> subprocess.CompletedProcess:
    command = [CXX, "-std=c++17", "-O3", "-ffast-math", "-fopenmp", *WARNINGS, *TARGETS[target], *include_flags(),
               *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def syntax_checks(request):
    """The selected syntax cases, started at once on a compiler per core: each is one single-threaded compiler
    run, so one at a time would leave all cores but one idle."""
    selected = [item.callspec.params for item in request.session.items
                if getattr(item, "originalname", None) == "test_compiles_for_aarch64"]
    pool = ThreadPoolExecutor(os.cpu_count() or 1)
    checks = {(case["source"], case["target"]): pool.submit(compile_for, case["target"], "-fsyntax-only", case["source"])
              for case in selected}
    yield checks
    pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize("source, target", SYNTAX_CASES)
def test_compiles_for_aarch64(source, target, syntax_checks):
    result = syntax_checks[source, target].result()
    assert result.returncode == 0, f"{source} for {target}:\n{result.stderr[-4000:]}"


@pytest.mark.parametrize("target", NEON_TARGETS)
def test_neon_micro_kernels_compile_to_object_code(target, tmp_path):
    result = compile_for(target, "-Wextra", "-c", str(ROOT / "tests/kernels/neon_kernels_harness.cpp"),
                         "-o", str(tmp_path / "harness.o"))
    assert result.returncode == 0, f"the NEON kernels for {target}:\n{result.stderr[-4000:]}"


@pytest.mark.parametrize("target", list(TARGETS))
def test_each_aarch64_build_selects_its_level(target, tmp_path):
    """cpu_isa.h names the level the platform asked for, so the level's own matmul header is the one built."""
    probe = tmp_path / "probe.cpp"
    level = LEVEL_OF_TARGET[target]
    probe.write_text('#include <string>\n#include "cpu_isa.h"\n'
                     f'static_assert(std::char_traits<char>::length(pagoda::kIsaLevel) == {len(level)} && '
                     f'pagoda::kIsaLevel[{len(level) - 1}] == \'{level[-1]}\', "not the {level} level");\n')
    result = subprocess.run([CXX, "-std=c++17", "-fsyntax-only", *TARGETS[target], "-I", str(CSRC), str(probe)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
