"""The Triton weight-only matmul (int8 per row, int4 per group) against the torch reference of
layers/quantization (dequantize, then F.linear in float32)."""

import pytest
import torch
import torch.nn.functional as F

from pagoda.kernels.weight_only_matmul import int4_matmul, int8_matmul
from pagoda.layers.quantization import int4, int8

pytestmark = pytest.mark.kernels

TOLERANCES = {  # float32 accumulation either way; the output's rounding (and bfloat16 inputs to the dot)
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=2e-2, rtol=1e-2),
    torch.bfloat16: dict(atol=0.1, rtol=3e-2),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,n,k,group_size", [(1, 64, 64, 32), (5, 48, 128, 64), (33, 80, 256, 128),
                                                 (3, 100, 96, 32)])
def test_int4_matmul_matches_reference(device, dtype, rows, n, k, group_size, monkeypatch):
    g = torch.Generator().manual_seed(rows + n)
    codes, scales, zeros = int4.quantize_groups(torch.randn(n, k, generator=g), group_size, dtype)
    monkeypatch.setattr(int4, "cpu_kernel_fits", lambda device, n: False)  # the layout layers have on GPUs
    layer = torch.nn.Module()
    int4.pack(layer, codes, scales, zeros, group_size)
    qweight, scales_and_zeros = layer.qweight, layer.scales_and_zeros
    x = torch.randn(rows, k, generator=g).to(dtype)
    expected = F.linear(x.float(), int4.dequantize(qweight, scales_and_zeros, group_size))
    got = int4_matmul(x.to(device), qweight.to(device), scales_and_zeros.to(device), group_size)
    torch.testing.assert_close(got.cpu().float(), expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,n,k", [(1, 64, 64), (7, 48, 96), (40, 130, 80)])
def test_int8_matmul_matches_reference(device, dtype, rows, n, k):
    g = torch.Generator().manual_seed(rows + n)
    weight = torch.randn(n, k, generator=g).to(dtype)
    qweight, scales = int8.quantize_rows(weight, weight.float().abs().amax(dim=1))
    x = torch.randn(2, rows, k, generator=g).to(dtype)  # leading dimensions flatten into rows
    expected = F.linear(x.float(), qweight.float() * scales.float()[:, None])
    got = int8_matmul(x.to(device), qweight.to(device), scales.to(device))
    assert got.shape == (2, rows, n) and got.dtype == dtype
    torch.testing.assert_close(got.cpu().float(), expected, **TOLERANCES[dtype])


def test_bad_arguments_name_the_tensor(device):
    qweight = torch.zeros(64, 32, dtype=torch.uint8, device=device)
    sz = torch.zeros(2, 64, 2, device=device)
    with pytest.raises(ValueError, match="int4_matmul: x must be a float tensor"):
        int4_matmul(torch.zeros(3, 32, device=device), qweight, sz, 32)
    with pytest.raises(ValueError, match="group_size must be 32, 64 or 128"):
        int4_matmul(torch.zeros(3, 64, device=device), qweight, sz, 48)
    with pytest.raises(ValueError, match="scales must be of x's dtype"):
        int8_matmul(torch.zeros(3, 32, device=device), torch.zeros(8, 32, dtype=torch.int8, device=device),
                    torch.zeros(8, dtype=torch.bfloat16, device=device))
