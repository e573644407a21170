"""The fused C++ CPU ops against the torch code they replace: RMSNorm (with and without the residual add),
rotary in place, SiLU-and-multiply, the KV-cache write and argmax, in every dtype, on strided rows, with
many rows (the parallel path); clear errors for input they do not take; and the layers picking them only
inside a forward pass."""

import shutil

import pytest
import torch
import torch.nn.functional as F

from pagoda.attention import torch_backend
from pagoda.layers import custom_ops, fused_cpu_ops
from pagoda.layers.attention import forward_context
from pagoda.layers.layernorm import RMSNorm
from pagoda.layers.rotary import RotaryEmbedding

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler: the kernels cannot be built here"),
]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ROWS = [1, 7, 300]  # 300 x 576 elements crosses the threshold where rows run in parallel


@pytest.fixture(scope="module", autouse=True)
def built():
    assert fused_cpu_ops.available(), "the fused CPU ops failed to build (see the log)"


def assert_close(got, want, dtype):
    if dtype == torch.float32:  # the kernels' float32 sums run in another order than torch's
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    else:  # float32 inside, rounded where torch rounds: equal but for rare last-bit ties (exp differs in ulps)
        mismatched = (got != want).float().mean().item()
        assert mismatched < 1e-2, f"{mismatched:.2%} of {dtype} elements differ"
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-2)


def norm_layer(hidden, dtype, gen):
    layer = RMSNorm(hidden, 1e-5).to(dtype)
    layer.weight.data.copy_(torch.randn(hidden, generator=gen))
    return layer


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_rms_norm_matches_torch(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    layer = norm_layer(576, dtype, gen)
    x = (torch.randn(rows, 576, generator=gen) * 3).to(dtype)
    residual = torch.randn(rows, 576, generator=gen).to(dtype)
    assert_close(fused_cpu_ops.rms_norm(x, layer.weight, 1e-5), layer(x), dtype)
    out, new_residual = fused_cpu_ops.fused_add_rms_norm(x, residual, layer.weight, 1e-5)
    want_out, want_residual = layer(x, residual)
    assert torch.equal(new_residual, want_residual)
    assert_close(out, want_out, dtype)


def test_rms_norm_reads_strided_rows():
    gen = torch.Generator().manual_seed(0)
    layer = norm_layer(64, torch.bfloat16, gen)
    wide = torch.randn(5, 100, generator=gen).to(torch.bfloat16)
    x = wide[:, 10:74]  # row stride 100
    assert torch.equal(fused_cpu_ops.rms_norm(x, layer.weight, 1e-5), layer(x.contiguous()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_rotary_matches_torch(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    head_size, q_heads, kv_heads = 64, 9, 3
    rotary = RotaryEmbedding(head_size, 4096, {"rope_theta": 10000.0})
    positions = torch.randint(0, 4096, (rows,), generator=gen)
    query = torch.randn(rows, q_heads * head_size, generator=gen).to(dtype)
    key = torch.randn(rows, kv_heads * head_size, generator=gen).to(dtype)
    want_q, want_k = rotary(positions, query.clone(), key.clone())
    fused_cpu_ops.apply_rotary_(positions, query, key, rotary.cos_sin_cache, head_size)
    assert_close(query, want_q, dtype)
    assert_close(key, want_k, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_silu_and_mul_matches_torch(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 2 * 1536, generator=gen) * 4).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    assert_close(fused_cpu_ops.silu_and_mul(x), F.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_of_gates_far_below_zero_is_zero_not_nan(dtype):
    """exp(-gate) overflows below -88: the gate times SiLU's vanishing sigmoid stays a (tiny) number."""
    gate = torch.tensor([-1e4, -500.0, -100.0, -88.5, -87.0, -20.0, 0.0, 20.0, 100.0] * 4).to(dtype)
    x = torch.cat([gate, torch.full_like(gate, 3.0)]).unsqueeze(0)
    got = fused_cpu_ops.silu_and_mul(x)
    assert torch.isfinite(got).all(), got
    torch.testing.assert_close(got.float(), (F.silu(gate.float()) * 3.0).unsqueeze(0), atol=1e-6, rtol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_cache_write_matches_torch(dtype, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    tokens, heads, head_size, num_blocks, block_size = 9, 3, 16, 6, 4
    # head-major memory, as the model runner allocates it; key/value as views of a fused qkv row
    cache = torch.zeros(2, num_blocks, heads, block_size, head_size, dtype=dtype).transpose(2, 3)
    qkv = torch.randn(tokens, 4 * heads * head_size, generator=gen).to(dtype)
    key = qkv[:, : heads * head_size].view(tokens, heads, head_size)
    value = qkv[:, 2 * heads * head_size : 3 * heads * head_size].view(tokens, heads, head_size)
    slots = torch.tensor([0, 5, -1, 23, 7, 8, -1, 12, 2])
    fused_cpu_ops.write_kv_cache(key, value, cache, slots)
    want = torch.zeros_like(cache)
    monkeypatch.setattr(fused_cpu_ops, "usable", lambda x: False)
    torch_backend.write_kv_cache(key, value, want, slots)
    assert torch.equal(cache, want)
    assert cache.abs().sum() > 0


@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("n", [1, 7, 16, 33, 49152])
def test_argmax_gives_torchs_first_largest_index(rows, n):
    torch.manual_seed(n)
    # few distinct values: ties within and across the 16 lanes; -inf rows and entries; a row's largest last
    x = torch.randint(-3, 4, (rows, n)).float()
    x[0, n // 2] = float("-inf")
    x[-1] = float("-inf")
    if rows > 2:
        x[1, -1] = 10.0
    strided = torch.randn(rows, 2 * n)[:, :n]

    for logits in (x, strided, torch.randn(rows, n)):
        assert torch.equal(fused_cpu_ops.argmax(logits), logits.argmax(dim=-1))


def test_errors_name_the_problem():
    x = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match="weight must be"):
        fused_cpu_ops.rms_norm(x, torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="position 99 outside"):
        fused_cpu_ops.apply_rotary_(torch.tensor([0, 1, 99]), torch.randn(3, 8), torch.randn(3, 8),
                                    torch.randn(10, 8), 8)
    with pytest.raises(RuntimeError, match="argmax_rows: x must be float32"):
        torch.ops.pagoda_cpu.argmax_rows(torch.zeros(2, 3, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="slot 1000 outside"):
        cache = torch.zeros(2, 2, 4, 1, 8)
        fused_cpu_ops.write_kv_cache(torch.randn(1, 1, 8), torch.randn(1, 1, 8), cache, torch.tensor([1000]))
    with pytest.raises(RuntimeError, match="silu_and_mul"):
        fused_cpu_ops.silu_and_mul(torch.randn(3, 7))


def test_layers_pick_the_kernels_only_inside_a_forward_pass(monkeypatch):
    calls = []
    real = fused_cpu_ops.rms_norm
    monkeypatch.setattr(fused_cpu_ops, "rms_norm", lambda *a: calls.append(1) or real(*a))
    layer = norm_layer(64, torch.float32, torch.Generator().manual_seed(0))
    x = torch.randn(2, 64)
    layer(x)
    assert not calls, "outside a forward pass (e.g. a reference model) the layers run torch"
    with forward_context(metadata=None, backend=torch_backend):
        assert custom_ops.fused_ops(x) is fused_cpu_ops
        layer(x)
    assert calls == [1]
    monkeypatch.setattr(fused_cpu_ops, "usable", lambda x: False)
    with forward_context(metadata=None, backend=torch_backend):
        assert custom_ops.fused_ops(x) is None  # no compiler, a failed build or PAGODA_CPU_KERNELS=0
