"""GPU tier (marker `gpu`, `make test-gpu`): the engine on the Triton backend on CUDA against transformers.

Without CUDA these tests skip, except in the CPU rehearsal of scripts/gpu-check.sh
(PAGODA_GPU_CHECK_DRY_RUN=1), where they run through Triton's interpreter to prove the check itself. As in
tests/kernels/conftest.py, TRITON_INTERPRET is set before any test module defines the kernels."""

import os
import sys
from pathlib import Path

import pytest
import torch

DRY_RUN = os.environ.get("PAGODA_GPU_CHECK_DRY_RUN", "") not in ("", "0")
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# the fp8 test reuses tests/model's fp8-rounded transformers reference (appended: never shadows a module)
sys.path.append(str(Path(__file__).parent.parent / "model"))

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def pytest_collection_modifyitems(config, items):
    if DEVICE == "cuda" or DRY_RUN:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (make test-gpu; PAGODA_GPU_CHECK_DRY_RUN=1 rehearses "
                                   "it on the CPU through Triton's interpreter)")
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    return DEVICE
