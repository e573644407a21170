"""C++ extensions compiled on first use with torch's extension builder and cached under $PAGODA_CACHE_DIR: the CPU
kernel library (``pagoda.ops.cpu_library``, the shared-memory all-reduce included). An extension's sources are
compiled apart, in parallel (ninja), and linked into one library.

Builds target the ISA level ``pagoda.platform`` chose (``-march=native`` for native, the level's own flags
such as ``-mavx2 -mfma`` when ``PAGODA_CPU_ISA`` forces one), so the cache key holds the level (and for a
native build the CPU's feature flags) as well as the source, the flags, the torch version and their paths. A build that
fails leaves a marker beside its directory: later starts and other ranks skip it (and use torch) instead of
compiling again; delete ``<build dir>.failed`` to retry. Processes starting together build once,
one after the other under an flock on ``<build dir>.lock``, which the OS releases when its holder dies.
torch's builder also keeps a lock file of its own in the build directory, which it waits on with no
deadline; one left behind by a process killed mid-build (OOM, a pod deleted, Ctrl-C) would hang every later
start, so whoever holds the flock removes it first.

An image ships its libraries built ahead of time, one per ISA level (``pagoda.entrypoints.prebuild_kernels``,
into the directory ``PAGODA_PREBUILT_KERNELS`` names): a process whose level has one there loads it and compiles
nothing, so a pod starts without a compiler.
"""

import dataclasses
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from pagoda import platform as pagoda_platform

logger = logging.getLogger(__name__)

# -ffast-math lets GCC vectorise reductions (the kernels rely on no inf/NaN semantics)
BASE_CFLAGS = ["-O3", "-ffast-math", "-fopenmp"]


PREBUILT_ENV = pagoda_platform.PREBUILT_ENV


def kernel_cflags(isa: pagoda_platform.CpuIsa | None = None) -> list[str]:
    """The flags of a kernel build at ``isa``'s level (default: this process's)."""
    return BASE_CFLAGS + (isa or pagoda_platform.cpu_isa()).compile_flags()


def level_build(isa: pagoda_platform.CpuIsa, level: str | None = None) -> pagoda_platform.CpuIsa:
    """``isa`` built for ``level`` (default: its own) with the level's flags rather than -march=native: what
    a prebuilt library targets. The level need not run on this host (an image builds every level)."""
    return dataclasses.replace(isa, level=level or isa.level, forced=True)


class PreviousBuildFailed(RuntimeError):
    """This build failed before (its marker is there): not retried."""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def compiler_available() -> bool:
    return pagoda_platform.compiler_available()


# headers the kernels share (#include "parallel_tasks.h"): on the include path, and in every build's key
INCLUDE_DIR = Path(__file__).with_name("csrc")


def source_list(source: Path | Sequence[Path]) -> list[Path]:
    """A library's sources: one file, or several compiled apart and linked into one library."""
    return [source] if isinstance(source, Path) else list(source)


def build_name(prefix: str, source: Path | Sequence[Path], cflags: list[str],
               isa: pagoda_platform.CpuIsa | None = None, with_paths: bool = True) -> str:
    """``prefix`` + the ISA level + a hash of everything the binary depends on. A prebuilt library's name
    (``with_paths=False``) leaves out where the sources and torch lie: it is built in one place, loaded in another."""
    isa = isa or pagoda_platform.cpu_isa()
    headers = [h.read_text() for h in sorted(INCLUDE_DIR.glob("*.h*"))]
    host = _cpu_flags() if any("native" in flag for flag in cflags) else ""  # -march=native: this CPU's flags
    # the paths too: torch's build.ninja holds the sources', csrc/'s and torch's absolute paths, so two checkouts
    # of the same sources sharing one directory (a clone beside a worktree) rebuilt it in turn at every load
    paths = [str(s.resolve()) for s in source_list(source)] + [str(INCLUDE_DIR.resolve()), str(Path(torch.__file__).parent)] \
        if with_paths else []
    key = "\n".join([*(s.read_text() for s in source_list(source)), *headers, " ".join(cflags), torch.__version__,
                     platform.machine(), isa.level, host, *paths])
    level = "native" if isa.native else isa.level
    return f"{prefix}{level}_{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def failure_marker(build_dir: Path) -> Path:
    return build_dir.with_name(build_dir.name + ".failed")


def ensure_ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH: make it the ninja wheel's (a dependency), whatever else PATH finds
    first. Ninja versions hash a build's command lines differently (1.11 and 1.13 do), so two processes that
    found different ones (a system ninja, and the venv's bin/ first on PATH when the venv is activated) each took
    the other's build as stale and rebuilt the whole library in turn, a minute or two each start."""
    try:
        import ninja
    except ImportError:  # not installed (a dependency, but an image may leave it out): PATH's, if any
        return
    wheel_ninja = shutil.which("ninja", path=ninja.BIN_DIR)
    if wheel_ninja is not None and shutil.which("ninja") != wheel_ninja:
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def prebuilt_library(prefix: str, sources: list[Path], cflags: list[str]) -> Path | None:
    """The prebuilt library that stands for a build of ``sources`` with ``cflags`` at this process's level:
    the same sources and torch version built with the level's flags (a native build's level is the CPU's best)."""
    root = pagoda_platform.prebuilt_kernels_dir()
    if root is None:
        return None
    isa = pagoda_platform.cpu_isa()
    level_isa = level_build(isa)
    isa_flags = set(isa.compile_flags())
    level_cflags = [f for f in cflags if f not in isa_flags] + level_isa.compile_flags()
    name = build_name(prefix, sources, level_cflags, level_isa, with_paths=False)
    library = root / name / f"{name}.so"
    return library if library.is_file() else None


def build_and_load(prefix: str, source: Path | Sequence[Path], cflags: list[str] | None = None) -> str:
    """Compile ``source`` (one file or several, linked into one library) once per (sources, flags, torch, ISA
    level) and load it for the ``torch.ops`` and ``torch.classes`` it registers; returns its path. A prebuilt
    library of this process's level (PAGODA_PREBUILT_KERNELS) is loaded instead of compiling. Raises on
    failure, PreviousBuildFailed without compiling when this build failed before."""
    cflags = kernel_cflags() if cflags is None else cflags
    sources = source_list(source)
    prebuilt = prebuilt_library(prefix, sources, cflags)
    if prebuilt is not None:
        logger.info("Loading %s (prebuilt)", prebuilt)
        torch.ops.load_library(str(prebuilt))
        return str(prebuilt)
    if not compiler_available():
        root = pagoda_platform.prebuilt_kernels_dir()
        where = f"none for ISA level {pagoda_platform.cpu_isa().level} in {root}" if root else f"{PREBUILT_ENV} not set"
        raise RuntimeError(f"no C++ compiler found and no prebuilt library ({where})")
    from torch.utils import cpp_extension

    from pagoda.config.paths import cache_dir

    ensure_ninja_on_path()
    what = ", ".join(s.name for s in sources)
    name = build_name(prefix, sources, cflags)
    build_dir = cache_dir() / "cpu_kernels" / name
    marker = failure_marker(build_dir)
    if marker.exists():
        raise PreviousBuildFailed(f"{what} failed to build before with these flags ({marker}; delete it "
                                  f"to retry): {marker.read_text()[-500:]}")
    build_dir.mkdir(parents=True, exist_ok=True)
    logger.info("Loading %s (compiled once into %s)", what, build_dir)
    with open(build_dir.with_name(name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists():  # another process failed while this one waited for the lock
            raise PreviousBuildFailed(f"{what} failed to build ({marker}): {marker.read_text()[-500:]}")
        (build_dir / "lock").unlink(missing_ok=True)  # torch's, stale: no other process is building here now
        try:
            return cpp_extension.load(name=name, sources=[str(s) for s in sources], extra_cflags=cflags,
                                      build_directory=str(build_dir), extra_include_paths=[str(INCLUDE_DIR)],
                                      is_python_module=False, verbose=False)
        except Exception as e:
            if _is_compile_error(e):  # a load error (a library already registered...) is not the build's fault
                marker.write_text(f"{type(e).__name__}: {e}")
            raise


# a build stopped from outside (Ctrl-C, SIGTERM to the process group, the OOM killer) says nothing about
# the sources: the next start builds again
_INTERRUPTED = ("interrupted by user", "Killed signal terminated program", "fatal error: Killed")


def _is_compile_error(e: Exception) -> bool:
    message = str(e)
    return (isinstance(e, RuntimeError) and "Error building extension" in message
            and not any(sign in message for sign in _INTERRUPTED))


class OptionalExtension:
    """A kernel library the engine can do without: built on first ``available()`` (thread-safe), which
    says whether its ``torch.ops`` are loaded. Off with ``env_switch=0``, without a compiler, or when
    the build fails (a broken toolchain must not stop the engine: callers fall back to torch). ``load()``
    builds and loads it whatever the switch says, for ops with a switch of their own."""

    def __init__(self, prefix: str, source: Path | Sequence[Path], env_switch: str, what: str):
        self.prefix, self.source, self.env_switch, self.what = prefix, source, env_switch, what
        self._lock = threading.Lock()
        self._loaded: bool | None = None  # None: not tried yet
        self._library: Path | None = None  # loaded from there
        self._error: Exception | None = None  # the load failed: not tried again in this process

    def available(self) -> bool:
        if self._loaded is not None:
            return self._loaded
        with self._lock:
            if self._loaded is None:
                self._loaded = False
                enabled, why_not = pagoda_platform.cpu_kernels_enabled()
                if os.environ.get(self.env_switch, "1") == "0":
                    logger.info("%s=0: %s uses the torch path", self.env_switch, self.what)
                elif not enabled:
                    logger.warning("%s: %s uses the slower torch path", why_not, self.what)
                else:
                    try:
                        self._load_locked()
                        self._loaded = True
                    except Exception as e:
                        logger.warning("Could not build the C++ kernels for %s, using the torch path: %s",
                                       self.what, e)
        return self._loaded

    def load(self) -> Path:
        """The library's path, built and loaded the first time; raises (each time) when it cannot be."""
        with self._lock:
            return self._load_locked()

    def _load_locked(self) -> Path:
        if self._library is None and self._error is None:
            try:
                self._library = Path(build_and_load(self.prefix, self.source))
            except Exception as e:
                self._error = e
        if self._error is not None:
            raise self._error
        return self._library
