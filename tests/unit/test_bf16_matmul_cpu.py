"""bf16_matmul_cpu's kernel at the ISA level this process builds for (tests/kernels/test_cpu_isa_levels.py runs
this file at every level the host can execute): float32 sums of bfloat16 weights and inputs against torch's
float32 product, for decode's few rows and prefill's many, part-filled blocks, bias, strided rows."""

import shutil

import pytest
import torch

from pagoda import platform
from pagoda.layers import bf16_matmul_cpu

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler: the kernel cannot be built here"),
]


@pytest.fixture(scope="module", autouse=True)
def built():
    if not platform.cpu_kernels_enabled()[0]:
        pytest.skip(platform.cpu_kernels_enabled()[1])
    assert bf16_matmul_cpu.available(), "the bfloat16 matmul kernel failed to build (see the log)"


def test_the_kernel_is_built_for_this_processes_level():
    """The one kernel library's level (the fp8 matmul, attention and fused ops are in the same build)."""
    isa = platform.cpu_isa()
    assert bf16_matmul_cpu.isa_level() == isa.level


def test_amx_runs_the_matmul_where_the_cpu_has_it():
    """AMX tiles take 3 rows and more on an avx512bf16 build where the CPU has AMX-BF16: the sums tests below
    then run them (their inputs' widths, multiples of 32, are whole tiles; 48 is not, and takes vdpbf16ps), unless
    PAGODA_CPU_AMX=0 (tests/kernels/test_cpu_isa_levels.py runs these so on an AMX host)."""
    assert bf16_matmul_cpu.uses_amx() == platform.cpu_isa().amx


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 13, 23, 24, 47, 64, 65, 200])  # AVX2: streaming < 24 <= float32
@pytest.mark.parametrize("out_features, in_features", [(64, 96), (100, 64), (33, 576), (40, 48), (33, 608), (20, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_float32_sums_match_torch(rows, out_features, in_features, bias):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    exact = x.float() @ weight.float().t() + (b.float() if bias else 0)
    packed = bf16_matmul_cpu.pack(weight)

    wide = bf16_matmul_cpu.linear(x, packed, out_features, b, float32_out=True)
    narrow = bf16_matmul_cpu.linear(x, packed, out_features, b)

    assert wide.dtype == torch.float32 and narrow.dtype == torch.bfloat16
    torch.testing.assert_close(wide, exact, atol=2e-4 * in_features ** 0.5, rtol=1e-5)
    assert torch.equal(narrow, wide.bfloat16())  # rounded once, to nearest even


@pytest.mark.parametrize("in_features", [64, 1536])
def test_many_rows_over_many_blocks(in_features):
    """Enough rows and blocks for AMX's tasks of 256 rows, with a last tile of 8 rows; at 1,536 inputs each
    block in three passes, its sums carried between them (608 and 1,536 above: two and three passes of fewer
    rows)."""
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(256, in_features, generator=gen).bfloat16()
    x = torch.randn(600, in_features, generator=gen).bfloat16()
    got = bf16_matmul_cpu.linear(x, bf16_matmul_cpu.pack(weight), 256, None, float32_out=True)
    torch.testing.assert_close(got, x.float() @ weight.float().t(), atol=2e-4 * in_features ** 0.5, rtol=1e-5)


def test_strided_and_batched_rows():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(96, 128, generator=gen).bfloat16()
    packed = bf16_matmul_cpu.pack(weight)
    x = torch.randn(2, 5, 256, generator=gen).bfloat16()[..., :128]  # rows 256 apart
    got = bf16_matmul_cpu.linear(x, packed, 96, None, float32_out=True)
    assert got.shape == (2, 5, 96)
    torch.testing.assert_close(got, x.float() @ weight.float().t(), atol=3e-3, rtol=1e-5)


def test_a_mismatched_input_is_refused():
    packed = bf16_matmul_cpu.pack(torch.randn(64, 64).bfloat16())
    with pytest.raises(RuntimeError, match="x has 32 columns, the weight 64"):
        bf16_matmul_cpu.linear(torch.randn(1, 32).bfloat16(), packed, 64, None)
    with pytest.raises(RuntimeError, match="bfloat16 CPU tensor"):
        bf16_matmul_cpu.linear(torch.randn(1, 64), packed, 64, None)


@pytest.mark.parametrize("rows", [1, 2, 5, 64, 300])
@pytest.mark.parametrize("intermediate, in_features", [(64, 96), (96, 1536), (40, 64)])
def test_gate_up_with_silu_and_mul_gives_the_two_ops_bits(rows, intermediate, in_features):
    """The fused gate/up matmul against linear then silu_and_mul: the same bits, for decode's rows and AMX's,
    one pair of blocks and three, and an intermediate size that is no whole number of blocks (40: the two
    ops)."""
    from pagoda.layers import fused_cpu_ops

    gen = torch.Generator().manual_seed(rows + intermediate)
    weight = torch.randn(2 * intermediate, in_features, generator=gen).bfloat16()
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    packed = bf16_matmul_cpu.pack(weight)

    fused = bf16_matmul_cpu.linear_silu_and_mul(x, packed, intermediate)
    two_ops = fused_cpu_ops.silu_and_mul(bf16_matmul_cpu.linear(x, packed, 2 * intermediate, None))

    assert fused.shape == (rows, intermediate) and torch.equal(fused, two_ops)
    reference = torch.nn.functional.silu(x.float() @ weight[:intermediate].float().t()) * (
        x.float() @ weight[intermediate:].float().t())
    torch.testing.assert_close(fused.float(), reference, atol=0.05 * in_features ** 0.5, rtol=0.02)
