"""Which NIXL build to load: the one built for the CUDA that torch runs on.

NIXL ships one wheel per CUDA major (nixl-cu12, nixl-cu13), each with a UCX whose CUDA module links that
major's runtime (libcudart.so.12 or .13). Under a torch of the other major that module cannot load, and UCX then
sees GPU memory as host memory: registering a VRAM KV cache fails with NIXL_ERR_BACKEND (found on an H200 with
torch 2.11 / CUDA 13 and nixl-cu12). So, as NIXL's own `nixl` meta-package does, take nixl_cu{major} for torch's
CUDA major; a CPU build of torch takes whichever build is installed (their DRAM paths are the same).
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

BUILDS = ("nixl_cu12", "nixl_cu13")


def cuda_major() -> int | None:
    """The CUDA major torch was built for; None for a CPU build."""
    import torch

    version = torch.version.cuda
    return int(version.split(".")[0]) if version else None


def module_for(major: int | None, installed: set[str]) -> str:
    """The NIXL module to import, or an ImportError naming the pip package to install."""
    if major is not None:
        wanted = f"nixl_cu{major}"
        if wanted in installed:
            return wanted
        raise ImportError(f"NixlConnector: torch runs on CUDA {major}, whose NIXL build is not installed: "
                          f"pip install nixl-cu{major} (another CUDA's build cannot register GPU memory)")
    for name in BUILDS:
        if name in installed:
            return name
    raise ImportError("NixlConnector needs NIXL: pip install nixl-cu12 (or nixl-cu13 on CUDA 13)")


def nixl_api() -> ModuleType:
    """NIXL's Python API (nixl_agent, nixl_agent_config) from the build module_for picks."""
    installed = {name for name in BUILDS if importlib.util.find_spec(name) is not None}
    return importlib.import_module(module_for(cuda_major(), installed) + "._api")
