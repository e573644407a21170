"""Attention sinks (gpt-oss: a learned logit per head in each softmax's denominator, with no value behind it):
the torch backend against a dense reference written here (transformers' eager formula: the sink appended to
the scores, softmax, the sink's column dropped); the C++ CPU kernels (decode and prefill, float and fp8
caches, with and without a window) and the Triton kernels (mixed batch, split-K decode; the interpreter on a
CPU) against the torch backend."""

import shutil

import pytest
import torch
from paged_batch import assert_close, make_batch

from pagoda.attention import cpu_kernels, torch_backend
from pagoda.kernels.flash_decode import flash_decode
from pagoda.kernels.paged_attention import paged_attention
from pagoda.layers.quantization.kv_scales import quantize

pytestmark = pytest.mark.kernels

# decodes far past the window, a prefill chunk straddling it, a prompt shorter than it, one token
PAIRS = [(1, 300), (40, 150), (9, 9), (1, 1)]
HEADS, KV_HEADS = 8, 2


def sinks_for(num_heads: int, device="cpu") -> torch.Tensor:
    """Some far below the scores, some far above (the sink then takes most of the weight)."""
    return torch.linspace(-6.0, 6.0, num_heads, device=device)


def dense_reference(batch, window, sinks):
    md, (key_cache, value_cache) = batch.metadata, batch.kv_cache.double()
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    out, start = [], 0
    for i, (q_len, s_len) in enumerate(zip(md.query_lens_cpu, md.seq_lens_cpu)):
        blocks = md.block_tables[i, : -(-s_len // block_size)].long()
        k = key_cache[blocks].flatten(0, 1)[:s_len]
        v = value_cache[blocks].flatten(0, 1)[:s_len]
        q = batch.query[start : start + q_len].double()
        group = q.shape[1] // num_kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * batch.scale
        q_pos = torch.arange(s_len - q_len, s_len)[:, None]
        k_pos = torch.arange(s_len)[None, :]
        visible = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
        scores = scores.masked_fill(~visible, float("-inf"))
        sink = sinks.double().view(-1, 1, 1).expand(-1, q_len, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        out.append(torch.einsum("hqk,khd->qhd", probs, v))
        start += q_len
    return torch.cat(out)


@pytest.mark.parametrize("window", [None, 17])
def test_torch_backend_equals_the_dense_reference(window):
    batch = make_batch(PAIRS, HEADS, KV_HEADS, 64, 16, seed=1)
    sinks = sinks_for(HEADS)
    got = torch_backend.windowed_attention(batch.query, batch.kv_cache, batch.metadata, batch.scale, window, None,
                                           sinks=sinks)
    torch.testing.assert_close(got.double(), dense_reference(batch, window, sinks), atol=1e-5, rtol=1e-5)
    plain = torch_backend.windowed_attention(batch.query, batch.kv_cache, batch.metadata, batch.scale, window, None)
    assert (got - plain).abs().max() > 0.1  # the sinks change the output


@pytest.fixture
def cpp_only(monkeypatch):
    """The torch attention paths raise: torch_backend.paged_attention must take the C++ kernels."""
    if shutil.which("c++") is None or not cpu_kernels.available():
        pytest.skip("no C++ compiler: the kernels cannot be built here")

    def refuse(*args, **kwargs):
        raise AssertionError("the torch path ran where the C++ kernels should have")

    def run(fn, *args, **kwargs):
        with monkeypatch.context() as m:
            for name in ("paged_attention_in_torch", "windowed_attention", "_batched_decode"):
                m.setattr(torch_backend, name, refuse)
            return fn(*args, **kwargs)

    return run


@pytest.mark.parametrize("cache", ["float", torch.float8_e4m3fn], ids=["float", "e4m3"])
@pytest.mark.parametrize("window", [None, 17])
@pytest.mark.parametrize("dtype,head_size", [(torch.float32, 64), (torch.bfloat16, 64), (torch.float32, 40),
                                             (torch.bfloat16, 128)], ids=["f32-d64", "bf16-d64", "f32-d40", "bf16-d128"])
def test_cpu_kernels_equal_the_torch_backend(cpp_only, cache, window, dtype, head_size):
    batch = make_batch(PAIRS, HEADS, KV_HEADS, head_size, 16, dtype=dtype, seed=2)
    k_scale = v_scale = 1.0
    if cache != "float":
        k_scale, v_scale = 0.05, 1.7
        float_cache = batch.kv_cache.float()
        batch.kv_cache = torch.stack([quantize(float_cache[0], k_scale, cache), quantize(float_cache[1], v_scale, cache)])
    batch.kv_cache = batch.kv_cache.transpose(2, 3).contiguous().transpose(2, 3)  # head-major, as the runner's
    sinks = sinks_for(HEADS)
    read = batch.kv_cache if cache != "float" else batch.kv_cache.float()
    expected = torch_backend.windowed_attention(batch.query.float(), read, batch.metadata, batch.scale, window,
                                                None, k_scale, v_scale, sinks)
    got = cpp_only(torch_backend.paged_attention, batch.query, batch.kv_cache, batch.metadata, batch.scale, k_scale,
                   v_scale, sliding_window=window, sinks=sinks)
    assert_close(got, expected, dtype)


def test_cpu_kernels_refuse_sinks_of_the_wrong_shape():
    if shutil.which("c++") is None or not cpu_kernels.available():
        pytest.skip("no C++ compiler")
    batch = make_batch([(1, 5)], 4, 2, 64, 16)
    md = batch.metadata
    with pytest.raises(RuntimeError, match="sinks"):
        cpu_kernels.paged_decode_attention(batch.query, batch.kv_cache[0], batch.kv_cache[1], md.block_tables,
                                           md.seq_lens, batch.scale, torch.empty_like(batch.query),
                                           sinks=torch.zeros(3))


@pytest.mark.parametrize("window", [None, 17])
def test_triton_mixed_batch_equals_the_torch_backend(device, window):
    batch = make_batch(PAIRS, HEADS, KV_HEADS, 64, 16, device=device, seed=3)
    md, sinks = batch.metadata, sinks_for(HEADS, device)
    got = paged_attention(batch.query, batch.kv_cache[0], batch.kv_cache[1], md.block_tables, md.query_start_loc,
                          md.seq_lens, md.max_query_len, batch.scale, sliding_window=window, sinks=sinks)
    expected = torch_backend.windowed_attention(batch.query, batch.kv_cache, md, batch.scale, window, None,
                                                sinks=sinks)
    assert_close(got, expected, torch.float32)


@pytest.mark.parametrize("window", [None, 100])
def test_triton_split_k_decode_equals_the_torch_backend(device, window):
    batch = make_batch([(1, 300), (1, 130), (1, 7)], HEADS, KV_HEADS, 64, 16, device=device, seed=4)
    md, sinks = batch.metadata, sinks_for(HEADS, device)
    got = flash_decode(batch.query, batch.kv_cache[0], batch.kv_cache[1], md.block_tables, md.seq_lens,
                       md.max_seq_len, batch.scale, partition_size=64, sliding_window=window, sinks=sinks)
    expected = torch_backend.windowed_attention(batch.query, batch.kv_cache, md, batch.scale, window, None,
                                                sinks=sinks)
    assert_close(got, expected, torch.float32)
