"""fp8 -> bfloat16 / float16 / float32 with integer ops (layers.quantization.fp8_cast) equals torch's own
conversion on every one of the 256 codes of both formats, on strided views too."""

import pytest
import torch

from pagoda.layers.quantization.fp8_cast import upcast

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_every_code_converts_as_torch_does(fp8, dtype):
    codes = torch.arange(256, dtype=torch.uint8).view(fp8)
    expected, got = codes.to(dtype), upcast(codes, dtype)
    assert got.dtype == dtype
    special = torch.isnan(expected) | torch.isinf(expected)  # never stored: quantization clamps
    assert torch.equal(got[~special], expected[~special])
    assert torch.equal(torch.signbit(got[~special]), torch.signbit(expected[~special]))  # -0 stays -0
    assert special.sum() == (2 if fp8 == torch.float8_e4m3fn else 8)


def test_strided_views():
    stored = (torch.randn(6, 5, 4) * 30).to(torch.float8_e4m3fn).transpose(0, 2)[1:]
    assert not stored.is_contiguous()
    assert torch.equal(upcast(stored, torch.bfloat16), stored.to(torch.bfloat16))
