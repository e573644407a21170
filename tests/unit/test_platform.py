"""pagoda.platform: the CPU's ISA level from /proc/cpuinfo text (x86 and ARM), PAGODA_CPU_ISA forcing a level
(refused with a clear error where the host cannot run it), the compile flags per level, the dtype "auto"
becomes with its reason, the kernel plan, and kernel builds remembering a failure instead of retrying it."""

import os
import subprocess
import sys
import textwrap

import pytest

from pagoda import platform
from pagoda.platform import isa as cpu_isa

pytestmark = pytest.mark.unit

ZEN4 = "model name\t: AMD EPYC 9R14\nflags\t\t: fpu sse2 avx2 fma f16c avx512f avx512dq avx512bw avx512vl avx512_bf16\n"
ZEN3 = "model name\t: AMD EPYC 7R13 Processor\nflags\t\t: fpu sse2 avx avx2 fma f16c bmi2\n"
SKYLAKE = "model name\t: Intel(R) Xeon(R) Platinum 8175M\nflags\t\t: avx2 fma f16c avx512f avx512dq avx512bw avx512vl\n"
SAPPHIRE = ("model name\t: Intel(R) Xeon(R) Platinum 8488C\nflags\t\t: avx2 fma f16c avx512f avx512dq avx512bw "
            "avx512vl avx512_bf16 amx_bf16 amx_tile\n")
OLD_X86 = "model name\t: QEMU Virtual CPU\nflags\t\t: fpu sse2 ssse3\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics asimddp sve i8mm bf16\nCPU part\t: 0xd40\n"
GRAVITON2 = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics asimddp\nCPU part\t: 0xd0c\n"


@pytest.mark.parametrize("arch, cpuinfo, best", [
    ("x86_64", ZEN4, "avx512bf16"), ("x86_64", ZEN3, "avx2"), ("x86_64", SKYLAKE, "avx512"),
    ("x86_64", SAPPHIRE, "avx512bf16"), ("x86_64", OLD_X86, "generic"), ("aarch64", GRAVITON3, "neonbf16"),
    ("aarch64", GRAVITON2, "neon"), ("riscv64", "isa\t: rv64imafdc\n", "generic"),
])
def test_best_level_from_cpuinfo(arch, cpuinfo, best):
    features = cpu_isa.features_from_cpuinfo(arch, cpuinfo)
    isa = cpu_isa.resolve(arch, "cpu", features, None)
    assert isa.best == isa.level == best and not isa.forced and isa.native


def test_arm_features_and_native_flags():
    features = cpu_isa.features_from_cpuinfo("aarch64", GRAVITON3)
    assert {"neon", "sve", "bf16"} <= features
    isa = cpu_isa.resolve("aarch64", "Graviton3", features, "native")
    assert isa.compile_flags() == ["-mcpu=native"] and isa.has_native_bf16()
    assert not cpu_isa.resolve("aarch64", "Graviton2", cpu_isa.features_from_cpuinfo("aarch64", GRAVITON2),
                               None).has_native_bf16()


def test_arm_levels_flags_and_refusals():
    graviton3 = cpu_isa.features_from_cpuinfo("aarch64", GRAVITON3)
    assert cpu_isa.resolve("aarch64", "Graviton3", graviton3, None).executable_levels == ("generic", "neon", "neonbf16")
    neon = cpu_isa.resolve("aarch64", "Graviton3", graviton3, "neon")
    assert neon.forced and neon.compile_flags() == ["-march=armv8-a"] and not neon.has_native_bf16()
    assert cpu_isa.resolve("aarch64", "Graviton3", graviton3, "neonbf16").compile_flags() == ["-march=armv8.2-a+bf16"]
    graviton2 = cpu_isa.features_from_cpuinfo("aarch64", GRAVITON2)
    with pytest.raises(platform.UnsupportedIsa, match="cannot execute neonbf16 code; it can run native, generic, neon"):
        cpu_isa.resolve("aarch64", "Graviton2", graviton2, "neonbf16")
    with pytest.raises(platform.UnsupportedIsa, match="cannot execute avx2"):
        cpu_isa.resolve("aarch64", "Graviton2", graviton2, "avx2")


@pytest.mark.parametrize("cpuinfo, level, dtype, why, kernels", [
    (GRAVITON3, None, "bfloat16", "BFMMLA/BFDOT", "NEON + BF16 kernels (BFMMLA/BFDOT matmul"),
    (GRAVITON3, "neon", "bfloat16", "neon without bfloat16 instructions: bfloat16 weights widened",
     "NEON kernels (bf16 weights widened to float32 in the FMLA matmul"),
    (GRAVITON2, None, "bfloat16", "widened to float32", "NEON kernels (bf16 weights widened"),
    (GRAVITON2, "generic", "float32", "no bfloat16 kernels", "generic C++ kernels"),
])
def test_arm_dtype_and_plan_name_the_neon_kernel_set(monkeypatch, cpuinfo, level, dtype, why, kernels):
    """What an ARM host is told at start-up, from its /proc/cpuinfo (platform decides from the CpuIsa alone)."""
    isa = cpu_isa.resolve("aarch64", "Neoverse", cpu_isa.features_from_cpuinfo("aarch64", cpuinfo), level)
    monkeypatch.setattr(platform, "cpu_isa", lambda: isa)
    monkeypatch.setenv("PAGODA_CPU_KERNELS", "1")
    monkeypatch.setattr(platform, "compiler_available", lambda: True)
    chosen, reason = platform.choose_dtype("cpu")
    assert chosen == dtype and why in reason
    plan = platform.cpu_kernel_plan(chosen)
    assert kernels in plan.kernel_set and plan.kernel_set in plan.describe()
    assert plan.layer_loop == (chosen == "bfloat16") and (plan.matmul == platform.VNNI) == (chosen == "bfloat16")
    monkeypatch.setenv("PAGODA_CPU_KERNELS", "0")
    chosen, reason = platform.choose_dtype("cpu")
    assert chosen == "float32" and ("PAGODA_CPU_KERNELS=0" in reason or level == "generic")
    assert platform.cpu_kernel_plan("bfloat16").kernel_set == "no C++ kernels"


def test_a_forced_level_takes_its_own_flags_not_native():
    features = cpu_isa.features_from_cpuinfo("x86_64", ZEN4)
    # 512-bit vectors for the loops GCC vectorises itself, where the level has them
    assert cpu_isa.resolve("x86_64", "zen4", features, None).compile_flags() == [
        "-march=native", "-mprefer-vector-width=512"]
    zen3 = cpu_isa.resolve("x86_64", "zen3", features - {"avx512f", "avx512bw", "avx512vl", "avx512bf16"}, None)
    assert zen3.level == "avx2" and zen3.compile_flags() == ["-march=native"]
    avx2 = cpu_isa.resolve("x86_64", "zen4", features, "avx2")
    assert avx2.forced and not avx2.native and avx2.level == "avx2"
    assert avx2.compile_flags() == ["-mavx2", "-mfma", "-mf16c"]
    avx512bf16 = cpu_isa.resolve("x86_64", "zen4", features, "avx512bf16").compile_flags()
    assert "-mavx512bf16" in avx512bf16 and "-mprefer-vector-width=512" in avx512bf16
    assert "-mavx512bf16" not in cpu_isa.resolve("x86_64", "zen4", features, "avx512").compile_flags()
    assert cpu_isa.resolve("x86_64", "zen4", features, "generic").compile_flags() == ["-DPAGODA_ISA_GENERIC"]


@pytest.mark.parametrize("requested, message", [
    ("avx512bf16", "cannot execute avx512bf16 code; it can run native, generic, avx2"),
    ("neon", "cannot execute neon"),
    ("sse9", "is not a CPU ISA level"),
])
def test_a_level_the_host_cannot_run_is_refused(requested, message):
    features = cpu_isa.features_from_cpuinfo("x86_64", ZEN3)
    with pytest.raises(platform.UnsupportedIsa, match=message):
        cpu_isa.resolve("x86_64", "AMD EPYC 7R13", features, requested)


def test_the_env_var_is_checked_at_startup_with_a_clear_error():
    for dtype in ("auto", "bfloat16"):
        code = f"from pagoda.config import resolve_dtype; resolve_dtype({dtype!r}, 'cpu', None)"
        env = {**os.environ, "PAGODA_CPU_ISA": "nonsense"}
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode != 0 and "PAGODA_CPU_ISA='nonsense' is not a CPU ISA level" in proc.stderr


def test_amx_where_the_cpu_has_it_unless_turned_off():
    """AMX is a feature of the avx512bf16 level; PAGODA_CPU_AMX=0 leaves it unused (the kernels of Zen 4)."""
    sapphire_rapids = cpu_isa.features_from_cpuinfo("x86_64", ZEN4) | {"amx"}
    assert cpu_isa.resolve("x86_64", "xeon", sapphire_rapids, None).amx
    assert cpu_isa.resolve("x86_64", "xeon", sapphire_rapids, "avx512bf16").amx
    assert not cpu_isa.resolve("x86_64", "xeon", sapphire_rapids, "avx512").amx
    off = cpu_isa.resolve("x86_64", "xeon", sapphire_rapids, None, amx_off=True)
    assert not off.amx and off.level == "avx512bf16" and "AMX tiles off by PAGODA_CPU_AMX=0" in off.describe()
    zen4 = cpu_isa.resolve("x86_64", "zen4", cpu_isa.features_from_cpuinfo("x86_64", ZEN4), None, amx_off=True)
    assert not zen4.amx and "AMX" not in zen4.describe()
    assert [cpu_isa.amx_turned_off(v) for v in (None, "", "1", "0")] == [False, False, False, True]
    with pytest.raises(platform.UnsupportedIsa, match="PAGODA_CPU_AMX='off': use 1"):
        cpu_isa.amx_turned_off("off")


def test_the_amx_env_var_is_checked_at_startup_with_a_clear_error():
    code = "from pagoda.config import resolve_dtype; resolve_dtype('auto', 'cpu', None)"
    env = {**os.environ, "PAGODA_CPU_AMX": "no"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode != 0 and "PAGODA_CPU_AMX='no': use 1" in proc.stderr


@pytest.fixture
def at_level(monkeypatch):
    executable = cpu_isa.detect("native").executable_levels

    def set_level(level, kernels="1"):
        if level not in executable:
            pytest.skip(f"this host cannot run {level}")
        monkeypatch.setenv("PAGODA_CPU_ISA", level)
        monkeypatch.setenv("PAGODA_CPU_KERNELS", kernels)
        platform.cpu_isa.cache_clear()

    yield set_level
    monkeypatch.undo()
    platform.cpu_isa.cache_clear()


def test_dtype_auto_and_the_plan_per_level(at_level):
    if platform.cpu_isa().arch != "x86_64":
        pytest.skip("x86 levels")
    at_level("avx2")
    dtype, reason = platform.choose_dtype("cpu")
    assert dtype == "bfloat16" and "widened to float32" in reason
    plan = platform.cpu_kernel_plan(dtype)
    assert plan.matmul == platform.VNNI and plan.layer_loop and "ISA level avx2 (forced" in plan.describe()
    at_level("avx2", kernels="0")
    dtype, reason = platform.choose_dtype("cpu")
    assert dtype == "float32" and "PAGODA_CPU_KERNELS=0" in reason
    plan = platform.cpu_kernel_plan("bfloat16")
    assert not plan.cpp_kernels and not plan.layer_loop and plan.matmul != platform.VNNI
    at_level("generic")
    assert platform.choose_dtype("cpu")[0] == "float32"
    assert platform.cpu_kernel_plan("float32").matmul == "torch"


def test_a_failed_build_is_remembered_not_retried(tmp_path):
    source = tmp_path / "broken_kernel.cpp"
    source.write_text("#include <torch/library.h>\nthis is not C++;\n")
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from pagoda import cpp_extensions
        for attempt in range(2):
            start = time.perf_counter()
            try:
                cpp_extensions.build_and_load("pagoda_broken_", Path({str(source)!r}))
            except cpp_extensions.PreviousBuildFailed as e:
                print("remembered", round(time.perf_counter() - start, 3), "not C++" in str(e))
            except Exception as e:
                print("failed", type(e).__name__)
    """)
    env = {**os.environ, "PAGODA_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    lines = proc.stdout.split("\n")
    assert lines[0] == "failed RuntimeError", proc.stdout + proc.stderr[-2000:]
    verdict, seconds, names_the_error = lines[1].split()
    assert verdict == "remembered" and float(seconds) < 1 and names_the_error == "True"
    markers = list((tmp_path / "cache" / "cpu_kernels").glob("*.failed"))
    assert len(markers) == 1 and markers[0].name.startswith("pagoda_broken_")


def test_a_build_stopped_from_outside_is_not_remembered_as_failed():
    """Ctrl-C or SIGTERM while ninja runs (a killed test run, a pod deleted mid-build) or the OOM killer says
    nothing about the sources: no marker, so the next start builds again."""
    from pagoda import cpp_extensions

    compile_error = RuntimeError("Error building extension 'x': broken.cpp:2:1: error: 'this' does not name a type")
    assert cpp_extensions._is_compile_error(compile_error)
    for stopped in ("ninja: build stopped: interrupted by user.",
                    "c++: fatal error: Killed signal terminated program cc1plus"):
        assert not cpp_extensions._is_compile_error(RuntimeError(f"Error building extension 'x': {stopped}"))
    assert not cpp_extensions._is_compile_error(OSError("Error building extension: no space"))
