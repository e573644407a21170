"""Which NIXL build to load: the one built for the CUDA that torch runs on.

NIXL ships one wheel per CUDA major (nixl-cu12, nixl-cu13), each with a UCX whose CUDA module links that
major's runtime (libcudart.so.12 or .13). Under a torch of the other major that module cannot load, and UCX then
sees GPU memory as host memory: registering a VRAM KV cache fails with NIXL_ERR_BACKEND (found on an H200 with
torch 2.11 / CUDA 13 and nixl-cu12). So, as NIXL's own `nixl` meta-package does, take nixl_cu{major} for torch's
CUDA major; a CPU build of torch takes whichever build is installed (their DRAM paths are the same).

On CUDA it also turns on one UCX setting before the agent creates its UCX context (UCX reads its environment
then); see UCX_ON_CUDA.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

BUILDS = ("nixl_cu12", "nixl_cu13")

# UCX turns cuda_ipc's GET zero-copy off on a GPU with no active NVLink (one GPU alone, or GPUs on PCIe), and a
# NIXL READ is a GET: UCX then emulates it over TCP (on one H200, 0.3-0.5 GB/s between two processes, its
# protocol table reading "software emulation | tcp/lo"). NIXL's UCX plugin turns it back on (ai-dynamo/nixl#2208),
# which the wheels we load may predate. A value the user set wins.
UCX_ON_CUDA = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}


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


def ucx_settings(major: int | None, environ: dict[str, str]) -> dict[str, str]:
    """The UCX variables to set before an agent starts: UCX_ON_CUDA's, on CUDA, where the user set none."""
    if major is None:
        return {}
    return {name: value for name, value in UCX_ON_CUDA.items() if name not in environ}


def nixl_api() -> ModuleType:
    """NIXL's Python API (nixl_agent, nixl_agent_config) from the build module_for picks."""
    installed = {name for name in BUILDS if importlib.util.find_spec(name) is not None}
    major = cuda_major()
    module = module_for(major, installed)
    os.environ.update(ucx_settings(major, dict(os.environ)))
    return importlib.import_module(module + "._api")
