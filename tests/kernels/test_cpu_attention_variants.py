"""The C++ CPU attention kernels (``attention/paged_*_cpu.cpp``) on what used to send a layer to the torch
path: an fp8 KV cache (e4m3fn / e5m2, per-tensor scales, widened in registers), sliding windows shorter and
longer than the context, soft-capped scores, and the fp8 cache write; against the torch reference
(``paged_attention_in_torch``, ``windowed_attention``, ``kv_scales.quantize``). tests/kernels/test_cpu_isa_levels.py
runs this file again at every ISA level the host executes (AVX-512, AVX2, generic upcasts and tiles).

Tolerances: both sides read the same fp8 bytes, so they are paged_batch.TOLERANCES for the query's dtype. The
torch fallbacks are made to fail during the kernel calls, so a routing slip cannot pass for the kernels."""

import shutil

import pytest
import torch
from paged_batch import assert_close, make_batch

from pagoda.attention import cpu_kernels, torch_backend
from pagoda.layers.quantization.fp8_cast import upcast
from pagoda.layers.quantization.kv_scales import quantize

pytestmark = [
    pytest.mark.kernels,
    pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler: the kernels cannot be built here"),
]

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# decodes far past the window, a prefill chunk straddling it, a prompt shorter than it, one token, and a chunk
# after a prefix longer than a tile
PAIRS = [(1, 300), (40, 150), (9, 9), (1, 1), (70, 133)]


@pytest.fixture(scope="module", autouse=True)
def kernels_built():
    assert cpu_kernels.available(), "the C++ attention kernels failed to build (see the log)"


@pytest.fixture
def cpp_only(monkeypatch):
    """Within the test, the torch attention paths raise: torch_backend.paged_attention must take the kernels."""
    def refuse(*args, **kwargs):
        raise AssertionError("the torch path ran where the C++ kernels should have")

    def run(fn, *args, **kwargs):
        with monkeypatch.context() as m:
            for name in ("paged_attention_in_torch", "windowed_attention", "_batched_decode"):
                m.setattr(torch_backend, name, refuse)
            return fn(*args, **kwargs)

    return run


def batch_with_cache(pairs, num_heads, num_kv_heads, head_size, block_size, dtype, cache, k_scale=1.0, v_scale=1.0,
                     seed=0, head_major=True):
    """make_batch with its cache quantized to ``cache`` when fp8 (keys with a wider range), stored head-major
    as the model runner allocates it."""
    batch = make_batch(pairs, num_heads, num_kv_heads, head_size, block_size, dtype=dtype, seed=seed)
    if cache in FP8:
        float_cache = batch.kv_cache.float()
        batch.kv_cache = torch.stack([quantize(float_cache[0] * 3, k_scale, cache), quantize(float_cache[1], v_scale, cache)])
    if head_major:  # [2, blocks, H_kv, block_size, D] in memory
        batch.kv_cache = batch.kv_cache.transpose(2, 3).contiguous().transpose(2, 3)
    return batch


def reference(batch, window=None, softcap=None, k_scale=1.0, v_scale=1.0):
    query = batch.query.float()
    cache = batch.kv_cache if batch.kv_cache.dtype in FP8 else batch.kv_cache.float()
    if window is None and softcap is None:
        return torch_backend.paged_attention_in_torch(query, cache, batch.metadata, batch.scale, k_scale, v_scale)
    return torch_backend.windowed_attention(query, cache, batch.metadata, batch.scale, window, softcap, k_scale, v_scale)


@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_size", [64, 128, 40])  # 40: the generic tile (no fixed head size)
def test_mixed_batch_reads_fp8(cpp_only, fp8, dtype, head_size):
    k_scale, v_scale = 0.05, 1.7
    batch = batch_with_cache(PAIRS, 9, 3, head_size, 16, dtype, fp8, k_scale, v_scale)
    expected = reference(batch, k_scale=k_scale, v_scale=v_scale)
    got = cpp_only(torch_backend.paged_attention, batch.query, batch.kv_cache, batch.metadata, batch.scale, k_scale,
                   v_scale)
    assert_close(got, expected, dtype)


@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decode_batch_reads_fp8_with_wide_groups(cpp_only, fp8, dtype):
    """Decodes only (one kernel call), 20 query heads per KV head (> the kernel's 16 at once), odd block size."""
    k_scale, v_scale = 0.3, 0.02
    batch = batch_with_cache([(1, 700), (1, 129), (1, 1), (1, 64)], 40, 2, 64, 5, dtype, fp8, k_scale, v_scale)
    expected = reference(batch, k_scale=k_scale, v_scale=v_scale)
    got = cpp_only(torch_backend.paged_attention, batch.query, batch.kv_cache, batch.metadata, batch.scale, k_scale,
                   v_scale)
    assert_close(got, expected, dtype)


@pytest.mark.parametrize("cache", [None, torch.float8_e4m3fn, torch.float8_e5m2], ids=["float", "e4m3", "e5m2"])
@pytest.mark.parametrize("window,softcap", [(64, None), (None, 5.0), (17, 2.0), (1, None), (4096, None), (33, 50.0)],
                         ids=["window64", "softcap5", "window17-softcap2", "window1", "window-past-context",
                              "window33-softcap50"])
@pytest.mark.parametrize("dtype,head_size,block_size", [(torch.float32, 64, 16), (torch.bfloat16, 64, 16),
                                                        (torch.float32, 32, 5), (torch.bfloat16, 128, 4)],
                         ids=["f32-d64", "bf16-d64", "f32-d32-block5", "bf16-d128-block4"])
def test_window_and_softcap(cpp_only, cache, window, softcap, dtype, head_size, block_size):
    k_scale, v_scale = (0.05, 1.7) if cache is not None else (1.0, 1.0)
    batch = batch_with_cache(PAIRS, 8, 2, head_size, block_size, dtype, cache if cache is not None else dtype,
                             k_scale, v_scale, seed=5)
    expected = reference(batch, window, softcap, k_scale, v_scale)
    got = cpp_only(torch_backend.paged_attention, batch.query, batch.kv_cache, batch.metadata, batch.scale, k_scale,
                   v_scale, sliding_window=window, logit_softcap=softcap)
    assert_close(got, expected, dtype)


def test_window_longer_than_every_context_equals_plain_attention():
    batch = batch_with_cache(PAIRS, 8, 2, 64, 16, torch.float32, torch.float32, seed=7)
    plain = torch_backend.paged_attention(batch.query, batch.kv_cache, batch.metadata, batch.scale)
    windowed = torch_backend.paged_attention(batch.query, batch.kv_cache, batch.metadata, batch.scale,
                                             sliding_window=301)
    torch.testing.assert_close(windowed, plain, atol=1e-6, rtol=1e-6)


def test_window_never_reads_blocks_before_it():
    """Blocks wholly before every window may hold anything (a hybrid allocator may hand them out again): NaN
    there must not reach the output."""
    batch = batch_with_cache([(1, 300), (40, 150)], 4, 2, 64, 16, torch.float32, torch.float32, seed=8,
                             head_major=False)
    window = 32
    expected = reference(batch, window)
    md = batch.metadata
    for (q_len, s_len), table in zip([(1, 300), (40, 150)], md.block_tables):
        first_seen = max(0, s_len - q_len - window + 1)
        for b in range(first_seen // 16):
            batch.kv_cache[:, int(table[b])] = float("nan")
    got = torch_backend.paged_attention(batch.query, batch.kv_cache, md, batch.scale, sliding_window=window)
    assert_close(got, expected, torch.float32)


def every_fp8_value(fp8):
    """The 256 codes but NaN / inf (never stored), as a [256] fp8 tensor (those replaced by zero)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8)
    finite = upcast(codes, torch.float32).isfinite() & (codes.view(torch.uint8) != 0x7F) & \
        (codes.view(torch.uint8) != 0xFF)
    return torch.where(finite, codes.view(torch.uint8), torch.zeros_like(codes.view(torch.uint8))).view(fp8)


@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("v_scale", [1.0, 0.37])
def test_every_fp8_code_is_read_as_its_value(fp8, v_scale):
    """A context of one position: the output is that position's value row, v_scale times its fp8 codes (all 256
    in one row of head size 256), subnormals included, by decode and by prefill (whose first row sees only
    position 0)."""
    values = every_fp8_value(fp8)
    cache = torch.zeros(2, 2, 4, 1, 256, dtype=torch.uint8).view(fp8)
    cache[1, 1, 0, 0] = values
    cache[1, 1, 1, 0] = values.view(torch.uint8).flip(0).view(fp8)
    expected = values.to(torch.float64) * v_scale  # torch's own conversion
    query = torch.randn(2, 1, 256)
    out = torch.empty_like(query)
    cpu_kernels.paged_decode_attention(query[:1], cache[0], cache[1], torch.tensor([[1]], dtype=torch.int32),
                                       torch.tensor([1], dtype=torch.int32), 0.1, out[:1], 0.5, v_scale)
    torch.testing.assert_close(out[0, 0].double(), expected, rtol=1e-6, atol=0)
    cpu_kernels.paged_prefill_attention(query, cache[0], cache[1], torch.tensor([[1]], dtype=torch.int32),
                                        torch.tensor([0, 2], dtype=torch.int32), torch.tensor([2], dtype=torch.int32),
                                        0.1, out, 0.5, v_scale)
    torch.testing.assert_close(out[0, 0].double(), expected, rtol=1e-6, atol=0)


def subnormal_fp8_codes(fp8):
    """The codes with exponent 0 (subnormals and zeros) as uint8."""
    mantissa_bits = 3 if fp8 == torch.float8_e4m3fn else 2
    return torch.tensor([sign | m for sign in (0, 0x80) for m in range(1 << mantissa_bits)], dtype=torch.uint8)


@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("codes", ["all", "subnormal"])
def test_bfloat16_decode_reads_every_fp8_code(cpp_only, fp8, head_size, codes):
    """bfloat16 queries on an fp8 cache in decode (with AVX512_BF16 the cache is widened to bfloat16, at other
    levels to float32): keys and values drawn from the 256 codes but NaN / inf, or from the subnormal codes alone
    with scales that make them decide the scores and the output (a kernel that read them as zero, or as normal
    numbers, would be far off), against the torch reference."""
    pairs = [(1, 37), (1, 16), (1, 1), (1, 64)]
    batch = batch_with_cache(pairs, 8, 2, head_size, 16, torch.bfloat16, fp8, seed=11)
    pool = every_fp8_value(fp8).view(torch.uint8) if codes == "all" else subnormal_fp8_codes(fp8)
    generator = torch.Generator().manual_seed(3)
    picks = torch.randint(0, pool.numel(), batch.kv_cache.shape, generator=generator)
    batch.kv_cache.view(torch.uint8).copy_(pool[picks])
    largest = float(upcast(pool.view(fp8), torch.float32).abs().max())
    k_scale, v_scale = 0.5 / largest, 2.0 / largest  # scores and outputs of order 1
    expected = reference(batch, k_scale=k_scale, v_scale=v_scale)
    got = cpp_only(torch_backend.paged_attention, batch.query, batch.kv_cache, batch.metadata, batch.scale, k_scale,
                   v_scale)
    assert expected.abs().max() > 0.1
    assert_close(got, expected, torch.bfloat16)


@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.037, 2.5)])
def test_fp8_write_equals_the_torch_quantization(fp8, dtype, k_scale, v_scale):
    g = torch.Generator().manual_seed(1)
    key = (torch.randn(45, 2, 64, generator=g) * 4).to(dtype)
    value = torch.randn(45, 2, 64, generator=g).to(dtype)
    key[1, 0, :5] = torch.tensor([1e5, -1e5, 0.0, 1e-4, -3e-3])  # saturates both ways, zero, tiny
    slots = torch.randperm(6 * 16, generator=g)[:45]
    slots[::5] = -1
    cache = torch.zeros(2, 6, 2, 16, 64, dtype=torch.uint8).view(fp8).transpose(2, 3)  # head-major
    expected = cache.clone()
    valid = slots >= 0
    blocks, offsets = slots[valid] // 16, slots[valid] % 16
    expected[0].index_put_((blocks, offsets), quantize(key[valid], k_scale, fp8))
    expected[1].index_put_((blocks, offsets), quantize(value[valid], v_scale, fp8))

    torch_backend.write_kv_cache(key, value, cache, slots, k_scale, v_scale)

    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))  # byte for byte, signed zeros too
    assert upcast(cache[0], torch.float32).abs().max() == torch.finfo(fp8).max  # saturated, not inf or NaN


@pytest.mark.parametrize("change,message", [
    (dict(sliding_window=-1), "sliding_window"),
    (dict(logit_softcap=-2.0), "logit_softcap"),
    (dict(k_scale=0.0), "k_scale"),
])
def test_bad_variant_arguments_are_refused_with_a_message(change, message):
    batch = batch_with_cache([(1, 5)], 2, 1, 64, 16, torch.float32, torch.float8_e4m3fn)
    md = batch.metadata
    args = dict(k_scale=1.0, v_scale=1.0, sliding_window=None, logit_softcap=None) | change
    with pytest.raises(RuntimeError, match=message):
        cpu_kernels.paged_decode_attention(batch.query, batch.kv_cache[0], batch.kv_cache[1], md.block_tables,
                                           md.seq_lens, batch.scale, torch.empty_like(batch.query), **args)

