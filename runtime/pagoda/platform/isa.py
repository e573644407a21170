"""The CPU's instruction-set level, detected once from the OS (no torch): what the C++ kernels are built for.

Levels, lowest first, per architecture:

- x86_64: ``generic`` (no -march, no ISA-specific code), ``avx2`` (AVX2 + FMA + F16C), ``avx512`` (F/BW/VL),
  ``avx512bf16`` (+ BF16; AMX is a feature of it: where the CPU has it, the matmul and attention run on its
  tiles, csrc/amx_tiles.h, unless ``PAGODA_CPU_AMX=0``: then an AMX host runs the kernels of a CPU without it,
  Zen 4's, to test and measure them there);
- aarch64: ``generic``, ``neon`` (ASIMD, every aarch64 CPU), ``neonbf16`` (+ the BF16 extension's BFDOT and
  BFMMLA: Graviton3/4, Neoverse V1/V2/N2, Apple M2 on; SVE is reported as a feature).

``PAGODA_CPU_ISA=native|<level>`` forces a level (native: the best this CPU executes, built with -march=native /
-mcpu=native); a level the host cannot execute is refused with an error naming the levels it can.
"""

import os
import platform as _platform
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

ENV = "PAGODA_CPU_ISA"
AMX_ENV = "PAGODA_CPU_AMX"  # 0: no AMX tiles even where the CPU has them (read by csrc/amx_tiles.h too)
LEVELS = {"x86_64": ("generic", "avx2", "avx512", "avx512bf16"), "aarch64": ("generic", "neon", "neonbf16")}
ALL_LEVELS = ("native", "generic", "avx2", "avx512", "avx512bf16", "neon", "neonbf16")

# GCC's tuning for Intel server cores (-march=native on a Xeon) vectorises loops 256 bits wide even where
# AVX-512 is there. The loops it vectorises in the kernels (SiLU, RMSNorm, rotary: no intrinsics) are short and
# bound by their instructions, so 512 bits halve them: a 1,500-token prefill of the default model on two cores
# of a Xeon with AMX 320-327 -> 294-313 ms (the gate/up matmul's SiLU 10 -> 7 % of it).
WIDE_VECTORS = ["-mprefer-vector-width=512"]
_AVX512 = ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", *WIDE_VECTORS]

# the compiler flags that target a level (besides -O3 -ffast-math -fopenmp); native: the host's own
LEVEL_FLAGS = {
    "generic": ["-DPAGODA_ISA_GENERIC"],  # no -march; and csrc/cpu_isa.h leaves out NEON, aarch64's baseline
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": _AVX512,
    "avx512bf16": [*_AVX512, "-mavx512bf16"],
    "neon": ["-march=armv8-a"],  # NEON (ASIMD) is aarch64's baseline
    "neonbf16": ["-march=armv8.2-a+bf16"],  # the oldest base with BF16: runs on every CPU that has it
}


class UnsupportedIsa(ValueError):
    """PAGODA_CPU_ISA names a level this host cannot execute, or no level at all."""


@dataclass(frozen=True)
class CpuIsa:
    arch: str  # x86_64, aarch64 or what platform.machine() says
    model: str  # the CPU's marketing name, "unknown" where the OS does not say
    features: frozenset[str] = field(default_factory=frozenset)  # normalised: avx2, fma, avx512bf16, sve, bf16...
    best: str = "generic"  # the highest level the host executes
    level: str = "generic"  # the level the kernels are built for (best unless forced)
    forced: bool = False  # PAGODA_CPU_ISA named a level
    amx_off: bool = False  # PAGODA_CPU_AMX=0: the CPU's AMX tiles left unused

    @property
    def native(self) -> bool:
        """Built for the host itself (-march=native), not a lesser level."""
        return self.level == self.best and not self.forced

    @property
    def executable_levels(self) -> tuple[str, ...]:
        levels = LEVELS.get(self.arch, ("generic",))
        return levels[:levels.index(self.best) + 1]

    @property
    def amx(self) -> bool:
        """Whether the kernels run on AMX tiles: an avx512bf16 level on a CPU with AMX-BF16, not turned off."""
        return self.level == "avx512bf16" and "amx" in self.features and not self.amx_off

    def has_native_bf16(self) -> bool:
        """bfloat16 dot products in hardware at this level (AVX512_BF16/AMX; ARM BF16's BFDOT/BFMMLA)."""
        return self.level in ("avx512bf16", "neonbf16")

    def compile_flags(self) -> list[str]:
        if self.native:
            if self.arch == "aarch64":
                return ["-mcpu=native"]
            # -march=native sets the ISA; the tuning flags the host's best level takes come with it
            return ["-march=native", *(f for f in LEVEL_FLAGS.get(self.best, []) if f in WIDE_VECTORS)]
        return list(LEVEL_FLAGS[self.level])

    def describe(self) -> str:
        how = "forced by " + ENV if self.forced else "detected"
        extra = sorted(self.features & {"amx", "sve", "bf16", "avx512bf16"})
        off = f"; AMX tiles off by {AMX_ENV}=0" if self.amx_off and "amx" in self.features else ""
        return (f"{self.model} ({self.arch}), ISA level {self.level} ({how}; best on this CPU: {self.best}"
                + (f"; features {', '.join(extra)}" if extra else "") + off + ")")


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _sysctl(name: str) -> str:
    try:
        return subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _cpuinfo_field(cpuinfo: str, *names: str) -> str:
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in names:
            return value.strip()
    return ""


def features_from_cpuinfo(arch: str, cpuinfo: str) -> frozenset[str]:
    """Normalised features from /proc/cpuinfo's "flags" (x86) or "Features" (ARM) line."""
    words = set(_cpuinfo_field(cpuinfo, "flags", "Features").split())
    if arch == "x86_64":
        names = {"avx2": "avx2", "fma": "fma", "f16c": "f16c", "avx512f": "avx512f", "avx512bw": "avx512bw",
                 "avx512vl": "avx512vl", "avx512dq": "avx512dq", "avx512_bf16": "avx512bf16", "amx_bf16": "amx"}
    else:
        names = {"asimd": "neon", "sve": "sve", "bf16": "bf16", "i8mm": "i8mm", "asimddp": "dotprod"}
    return frozenset(ours for theirs, ours in names.items() if theirs in words)


def best_level(arch: str, features: frozenset[str]) -> str:
    if arch == "x86_64":
        if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= features:
            return "avx512bf16" if "avx512bf16" in features else "avx512"
        return "avx2" if {"avx2", "fma", "f16c"} <= features else "generic"
    if arch == "aarch64":
        if "neon" not in features:
            return "generic"
        return "neonbf16" if "bf16" in features else "neon"
    return "generic"


def _normalised_arch() -> str:
    machine = _platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


def _host() -> tuple[str, str, frozenset[str]]:
    arch = _normalised_arch()
    if _platform.system() == "Darwin":  # no /proc: sysctl
        model = _sysctl("machdep.cpu.brand_string") or "unknown"
        if arch == "aarch64":
            features = {"neon"}
            if _sysctl("hw.optional.arm.FEAT_BF16") == "1":
                features.add("bf16")
            return arch, model, frozenset(features)
        words = (_sysctl("machdep.cpu.features") + " " + _sysctl("machdep.cpu.leaf7_features")).lower().split()
        return arch, model, features_from_cpuinfo(arch, "flags: " + " ".join(words).replace(".", "_"))
    cpuinfo = _read("/proc/cpuinfo")
    model = _cpuinfo_field(cpuinfo, "model name", "Model name", "cpu model", "Hardware") or "unknown"
    if model == "unknown" and arch == "aarch64":
        part = _cpuinfo_field(cpuinfo, "CPU part")
        model = f"ARM CPU part {part}" if part else model
    return arch, model, features_from_cpuinfo(arch, cpuinfo)


def amx_turned_off(value: str | None) -> bool:
    """PAGODA_CPU_AMX's value: 1 or unset (AMX where the CPU has it) or 0."""
    value = "1" if value is None or value == "" else value
    if value not in ("0", "1"):
        raise UnsupportedIsa(f"{AMX_ENV}={value!r}: use 1 (AMX tiles where the CPU has them, the default) or 0 (none)")
    return value == "0"


def resolve(arch: str, model: str, features: frozenset[str], requested: str | None, amx_off: bool = False) -> CpuIsa:
    """The level to build for: ``requested`` (PAGODA_CPU_ISA's value; None or "native": the best)."""
    best = best_level(arch, features)
    requested = (requested or "native").strip().lower()
    if requested == "native":
        return CpuIsa(arch, model, features, best, best, False, amx_off)
    if requested not in ALL_LEVELS:
        raise UnsupportedIsa(f"{ENV}={requested!r} is not a CPU ISA level; use one of {', '.join(ALL_LEVELS)}")
    levels = LEVELS.get(arch, ("generic",))
    executable = levels[:levels.index(best) + 1]
    if requested not in executable:
        raise UnsupportedIsa(f"{ENV}={requested}: this CPU ({model}, {arch}) cannot execute {requested} code; "
                             f"it can run {', '.join(('native',) + executable)}")
    return CpuIsa(arch, model, features, best, requested, True, amx_off)


def detect(requested: str | None = None) -> CpuIsa:
    """The host's ISA, at the level PAGODA_CPU_ISA asks for (or ``requested``), AMX as PAGODA_CPU_AMX says."""
    arch, model, features = _host()
    return resolve(arch, model, features, requested if requested is not None else os.environ.get(ENV),
                   amx_turned_off(os.environ.get(AMX_ENV)))
