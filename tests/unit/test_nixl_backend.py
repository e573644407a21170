"""The NIXL build NixlConnector loads: the one for torch's CUDA major (docs/disaggregation.md)."""

import pytest

from pagoda.kv_transfer import nixl_backend


def test_cuda_torch_takes_its_majors_build():
    assert nixl_backend.module_for(13, {"nixl_cu12", "nixl_cu13"}) == "nixl_cu13"
    assert nixl_backend.module_for(12, {"nixl_cu12", "nixl_cu13"}) == "nixl_cu12"


def test_the_other_majors_build_is_refused_by_its_package_name():
    """nixl-cu12 under CUDA 13 torch registered no VRAM on an H200 (its UCX's CUDA module needs libcudart 12):
    refused up front, naming what to install."""
    with pytest.raises(ImportError, match="pip install nixl-cu13"):
        nixl_backend.module_for(13, {"nixl_cu12"})


def test_a_cpu_torch_takes_any_build_and_names_one_when_none():
    assert nixl_backend.module_for(None, {"nixl_cu13"}) == "nixl_cu13"
    assert nixl_backend.module_for(None, {"nixl_cu12", "nixl_cu13"}) == "nixl_cu12"
    with pytest.raises(ImportError, match="pip install nixl-cu12"):
        nixl_backend.module_for(None, set())


def test_cuda_turns_on_ucx_cuda_ipc_get_unless_the_user_chose():
    """Without it a NIXL READ between two processes on one H200 ran over TCP (0.3-0.5 GB/s)."""
    assert nixl_backend.ucx_settings(13, {}) == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
    assert nixl_backend.ucx_settings(12, {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n"}) == {}
    assert nixl_backend.ucx_settings(None, {}) == {}


def test_this_machines_nixl_loads():
    pytest.importorskip("nixl_cu12")
    api = nixl_backend.nixl_api()
    assert hasattr(api, "nixl_agent") and hasattr(api, "nixl_agent_config")
