"""RMSNorm and the fused residual add against layers/layernorm.py's torch code (the reference)."""

import pytest
import torch

from pagoda.kernels import rmsnorm
from pagoda.kernels._checks import is_interpreted
from pagoda.kernels.rmsnorm import fused_add_rms_norm, rms_norm
from pagoda.layers.layernorm import RMSNorm

pytestmark = pytest.mark.kernels
INTERPRETED = is_interpreted(rmsnorm._rms_norm_kernel)

# The kernel follows the reference's roundings step by step; what remains is float32 summation order and
# 1/sqrt vs rsqrt, so one rounding of the output dtype at most. bfloat16 allows two units in the last place
# (2**-7 relative each): Triton 3.9's interpreter truncates float32 to bfloat16 where GPUs and torch round
# to nearest, and the kernel rounds twice (the normed value, then the product with the weight).
TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-3, rtol=1e-3),
    torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),
}


def reference_norm(hidden: int, dtype, device, eps=1e-6, seed=0) -> RMSNorm:
    norm = RMSNorm(hidden, eps).to(device)
    g = torch.Generator().manual_seed(seed)
    norm.weight.data = (1 + 0.3 * torch.randn(hidden, generator=g)).to(dtype).to(device)
    return norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(7, 64), (3, 5, 80), (2, 4096), (1, 1000)])
def test_rms_norm(device, shape, dtype):
    norm = reference_norm(shape[-1], dtype, device)
    x = (3 * torch.randn(shape)).to(dtype).to(device)
    x_before = x.clone()
    got = rms_norm(x, norm.weight, norm.eps)
    assert got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got, norm(x), **TOLERANCES[dtype])
    assert torch.equal(x, x_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(7, 64), (3, 5, 80), (2, 4096)])
def test_fused_add_rms_norm(device, shape, dtype):
    norm = reference_norm(shape[-1], dtype, device, seed=1)
    x = torch.randn(shape).to(dtype).to(device)
    residual = (5 * torch.randn(shape)).to(dtype).to(device)
    inputs = (x.clone(), residual.clone())
    normed, new_residual = fused_add_rms_norm(x, residual, norm.weight, norm.eps)
    expected_normed, expected_residual = norm(x, residual)
    if dtype == torch.bfloat16 and INTERPRETED:  # truncated instead of rounded to nearest: one unit off
        torch.testing.assert_close(new_residual, expected_residual, atol=0, rtol=2**-7)
    else:
        assert torch.equal(new_residual, expected_residual)  # one rounding of the same sum
    torch.testing.assert_close(normed, expected_normed, **TOLERANCES[dtype])
    assert torch.equal(x, inputs[0]) and torch.equal(residual, inputs[1]), "inputs are not modified"


def test_strided_rows(device):
    """Rows of a wider buffer (stride > hidden), as q/k heads viewed out of a projection."""
    norm = reference_norm(32, torch.float32, device)
    wide = torch.randn(6, 48, device=device)
    x = wide[:, 8:40]
    torch.testing.assert_close(rms_norm(x, norm.weight, norm.eps), norm(x), **TOLERANCES[torch.float32])


def test_empty_input(device):
    norm = reference_norm(16, torch.float32, device)
    assert rms_norm(torch.empty(0, 16, device=device), norm.weight, norm.eps).shape == (0, 16)
