"""Builds the C++ kernel library ahead of time, one per ISA level, into the directory a runtime image ships and
names in ``PAGODA_PREBUILT_KERNELS``: a pod then loads its node's level (``pagoda.cpp_extensions``) instead of
compiling at every start, and the image needs no compiler. The library (``pagoda.ops.cpu_library``) holds every
C++ op, the tensor-parallel shared-memory all-reduce included.

    python -m pagoda.entrypoints.prebuild_kernels --levels avx2 avx512 avx512bf16 --into /opt/pagoda/kernels

Each level is built with its own flags whether or not this host can run it, and nothing is loaded here (a
library built for AVX-512 must not be loaded on an AVX2 builder). A library's name is the hash of what it is
built from (sources, headers, flags, torch's version), so one built from other sources is never loaded, and
``--cache DIR`` (a build cache mount) keeps the libraries whose sources did not change from one image build
to the next.
"""

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from pagoda import cpp_extensions
from pagoda import platform as pagoda_platform
from pagoda.platform.isa import LEVELS


def _build(name: str, sources: list[Path], cflags: list[str], build_dir: Path) -> Path:
    """Compile and link without loading. torch's public ``load`` always loads what it built, so this calls the
    builder step beneath it (the same ninja file and flags a start-up build writes)."""
    from torch.utils import cpp_extension

    cpp_extension._write_ninja_file_and_build_library(
        name=name, sources=[str(s) for s in sources], extra_cflags=cflags, extra_cuda_cflags=[],
        extra_sycl_cflags=[], extra_ldflags=[], extra_include_paths=[str(cpp_extensions.INCLUDE_DIR)],
        build_directory=str(build_dir), verbose=False, with_cuda=False, with_sycl=False)
    return build_dir / f"{name}.so"


def prebuild(levels: list[str], into: Path, cache: Path | None = None) -> list[Path]:
    """Build the kernel library at each of ``levels`` into ``into``/NAME/NAME.so (copied from ``cache`` when built
    there before); returns the libraries, one per level."""
    from pagoda.ops import cpu_library

    isa = pagoda_platform.cpu_isa()
    known = LEVELS.get(isa.arch, ("generic",))
    unknown = [level for level in levels if level not in known]
    if unknown:
        raise ValueError(f"--levels: {', '.join(unknown)} not a level of {isa.arch}; use {', '.join(known)}")
    cpp_extensions.ensure_ninja_on_path()
    built = []
    for level in levels:
        level_isa = cpp_extensions.level_build(isa, level)
        cflags = cpp_extensions.kernel_cflags(isa=level_isa)
        name = cpp_extensions.build_name(cpu_library.PREFIX, cpu_library.SOURCES, cflags, level_isa, with_paths=False)
        cached = cache / name / f"{name}.so" if cache else None
        (into / name).mkdir(parents=True, exist_ok=True)
        if cached is not None and cached.is_file():
            built.append(Path(shutil.copy2(cached, into / name)))
            print(f"{level}: {built[-1]} (cached)", flush=True)
            continue
        with tempfile.TemporaryDirectory() as tmp:
            library = _build(name, cpu_library.SOURCES, cflags, Path(tmp))
            built.append(Path(shutil.copy2(library, into / name / library.name)))
            if cached is not None:
                cached.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(library, cached)
        print(f"{level}: {built[-1]}", flush=True)
    return built


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagoda.entrypoints.prebuild_kernels",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", nargs="+", required=True, help="ISA levels to build (e.g. avx2 avx512 avx512bf16)")
    parser.add_argument("--into", type=Path, required=True, help="the directory PAGODA_PREBUILT_KERNELS will name")
    parser.add_argument("--cache", type=Path, help="libraries built before, reused when their sources are the same")
    args = parser.parse_args(argv)
    if not cpp_extensions.compiler_available():
        parser.error("no C++ compiler found (install g++)")
    try:
        prebuild(args.levels, args.into, args.cache)
    except ValueError as e:
        parser.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
