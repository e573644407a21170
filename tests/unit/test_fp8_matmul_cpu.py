"""fp8_matmul_cpu's kernel (FP8 e4m3fn weights widened in registers, bfloat16 activations) at the ISA level this
process builds for (tests/kernels/test_cpu_isa_levels.py runs this file at every level the host executes), against
the dequantized reference, x.float() @ (weight * scales).T in float32: per-channel and block-wise scales (partial
blocks at the edges), decode's few rows and prefill's many, part-filled output blocks, bias, every fp8 code; and
the FP8 linear layers taking the kernel once packed.

Tolerance: both sides multiply the same values exactly and sum in float32; the kernel rounds once to bfloat16
(half a unit in the last place: 2**-9 relative), so rtol 4e-3 plus a small atol for sums that cancel."""

import shutil

import pytest
import torch
import torch.nn.functional as F

from pagoda import platform
from pagoda.layers import fp8_matmul_cpu
from pagoda.layers.quantization import fp8

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler: the kernel cannot be built here"),
]

E4M3 = torch.float8_e4m3fn


@pytest.fixture(scope="module", autouse=True)
def built():
    if not platform.cpu_kernels_enabled()[0]:
        pytest.skip(platform.cpu_kernels_enabled()[1])
    assert fp8_matmul_cpu.available(), "the fp8 matmul kernel failed to build (see the log)"


def random_fp8(n, k, gen, amplitude=300.0):
    return (torch.randn(n, k, generator=gen) * amplitude / 3).clamp(-448, 448).to(E4M3)


def assert_matches(got, x, qweight, scales, block_k, bias=None):
    expected = x.float() @ fp8.dequantize(qweight, scales, block_k).t()
    if bias is not None:
        expected += bias.float()
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    tolerance = 1e-3 * float(expected.abs().max())
    torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=4e-3)


@pytest.mark.parametrize("n,k", [(64, 96), (50, 256), (33, 200)])
def test_pack_and_unpack_are_inverse(n, k):
    qweight = random_fp8(n, k, torch.Generator().manual_seed(n))
    packed = fp8_matmul_cpu.pack(qweight)
    assert packed.shape == ((n + 31) // 32, k // 2, 32, 2) and packed.dtype == E4M3
    assert torch.equal(fp8_matmul_cpu.unpack(packed, n).view(torch.uint8), qweight.view(torch.uint8))


@pytest.mark.parametrize("rows", [1, 6, 13, 70])  # micro-kernel tails of 5 and 8 rows, two row tasks
@pytest.mark.parametrize("n,k,block_k", [(64, 96, None), (50, 256, 128), (33, 200, 64), (96, 128, 2)],
                         ids=["channel", "blocks", "partial-blocks", "pair-blocks"])
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_matches_the_dequantized_weight(rows, n, k, block_k, bias):
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    qweight = random_fp8(n, k, gen)
    groups = 1 if block_k is None else -(-k // block_k)
    scales = torch.rand(n, groups, generator=gen) * 0.01 + 1e-3
    x = torch.randn(rows, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    got = fp8_matmul_cpu.linear(x, fp8_matmul_cpu.pack(qweight), scales, block_k or k, n, b)
    assert_matches(got, x, qweight, scales, block_k, b)


@pytest.mark.parametrize("codes", ["all", "subnormal"])
def test_every_fp8_code_is_read_as_its_value(codes):
    """Weights made of all 256 codes but NaN, or of the subnormals alone with a scale that makes them the result
    (a kernel that read them as zero, or as normal numbers, would be far off)."""
    all_codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    pool = all_codes[(all_codes & 0x7F) != 0x7F] if codes == "all" else all_codes[(all_codes & 0x78) == 0]
    gen = torch.Generator().manual_seed(5)
    qweight = pool[torch.randint(0, pool.numel(), (40, 512), generator=gen)].view(E4M3)
    scales = torch.full((40, 1), 1.0 / float(fp8.dequantize(qweight, torch.ones(40, 1)).abs().max()))
    x = torch.randn(5, 512, generator=gen).bfloat16()
    got = fp8_matmul_cpu.linear(x, fp8_matmul_cpu.pack(qweight), scales, 512, 40, None)
    assert_matches(got, x, qweight, scales, None)
    assert got.float().abs().max() > 1.0


def test_strided_and_batched_rows():
    gen = torch.Generator().manual_seed(1)
    qweight = random_fp8(96, 128, gen)
    scales = torch.rand(96, 1, generator=gen) * 0.01
    x = torch.randn(2, 5, 256, generator=gen).bfloat16()[..., :128]  # rows 256 apart
    got = fp8_matmul_cpu.linear(x, fp8_matmul_cpu.pack(qweight), scales, 128, 96, None)
    assert got.shape == (2, 5, 96)
    assert_matches(got.view(10, 96), x.reshape(10, 128), qweight, scales, None)


@pytest.mark.parametrize("change,message", [
    (dict(scales=torch.ones(64, 2)), "scales must be"),
    (dict(block_k=3), "block_k must be a positive even number"),
    (dict(x=torch.zeros(1, 96)), "x must be a bfloat16"),
    (dict(out_features=100), "out_features 100 does not match the packed weight"),
])
def test_bad_arguments_are_refused_with_a_message(change, message):
    args = dict(x=torch.zeros(1, 96, dtype=torch.bfloat16), packed=fp8_matmul_cpu.pack(torch.zeros(64, 96, dtype=E4M3)),
                scales=torch.ones(64, 1), block_k=96, out_features=64, bias=None)
    args.update(change)
    with pytest.raises(RuntimeError, match=f"fp8_linear: {message}"):  # the op's name, as torch.ops calls it
        fp8_matmul_cpu.linear(**args)


class _Linear(torch.nn.Module):
    """What an FP8 method needs of a linear layer once loaded."""

    def __init__(self, qweight, scales, bias):
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.register_buffer("weight_scale", scales)
        self.bias = bias


@pytest.mark.parametrize("block", [None, (32, 64)], ids=["channel", "blocks"])
def test_a_packed_layer_gives_the_torch_paths_result(block):
    """The FP8 layers' methods: pack_for_cpu switches apply to the kernel, and dequantized_weight reads the packed
    weight back."""
    gen = torch.Generator().manual_seed(2)
    qweight = random_fp8(72, 192, gen)
    scales = torch.rand(72, 1 if block is None else 3, generator=gen) * 0.01
    bias = torch.randn(72, generator=gen).bfloat16()
    method = fp8.Fp8OnlineMethod() if block is None else fp8.Fp8CheckpointMethod.__new__(fp8.Fp8CheckpointMethod)
    method.block_k = None if block is None else block[1]
    layer = _Linear(qweight, scales, bias)
    x = torch.randn(3, 192, generator=gen).bfloat16()
    torch_path = method.apply(layer, x, bias)
    dequantized = method.dequantized_weight(layer)

    method.pack_for_cpu(layer)
    assert layer.qweight.dim() == 4 and layer.qweight.dtype == E4M3
    assert torch.equal(method.dequantized_weight(layer), dequantized)
    got = method.apply(layer, x, bias)
    torch.testing.assert_close(got.float(), F.linear(x.float(), dequantized, bias.float()), atol=2e-2, rtol=4e-3)
    torch.testing.assert_close(got, torch_path, atol=2e-2, rtol=1e-2)
