"""Kernel tier: the Triton kernels against the torch reference.

Without CUDA the kernels run in Triton's interpreter, which triton.jit selects when it *defines* a kernel
(it reads TRITON_INTERPRET at decoration time). pytest imports this conftest before any test module of
this directory, and the engine imports pagoda.kernels only lazily (when a Triton backend is built), so no
module collected earlier has defined the kernels yet; the session check below turns any future violation
of that into a clear failure instead of every kernel test failing on CPU tensors.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True, scope="session")
def _kernels_defined_for_this_machine():
    from pagoda.kernels import paged_attention
    from pagoda.kernels._checks import is_interpreted

    if DEVICE == "cpu" and not is_interpreted(paged_attention._mixed_batch_kernel):
        pytest.fail("pagoda.kernels was imported before tests/kernels/conftest.py set TRITON_INTERPRET=1, so its "
                    "kernels were compiled for a GPU this machine lacks; run with TRITON_INTERPRET=1 in the "
                    "environment", pytrace=False)


@pytest.fixture
def device() -> str:
    return DEVICE
