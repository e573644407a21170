"""The torch attention backend (the CPU path and the kernels' reference) against dense attention,
for a batch mixing decodes, a chunked prefill and a fresh prefill, in each dtype and in both cache
layouts: token-major (contiguous) and head-major (what the model runner allocates).

Attention goes through the C++ kernels when they build (prefill and decode), else through SDPA and
batched matmuls: both paths are tested."""

import math
import shutil

import pytest
import torch

from pagoda.attention import AttentionMetadata, cpu_kernels, torch_backend

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True, params=["cpp_kernel", "torch_matmuls"])
def decode_path(request, monkeypatch):
    if request.param == "torch_matmuls":
        monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    elif shutil.which("c++") is None:
        pytest.skip("no C++ compiler: the kernel cannot be built here")
    else:
        assert cpu_kernels.available(), "the C++ decode kernel failed to build (see the log)"
    return request.param

BLOCK_SIZE = 4


def dense_attention(q, k, v, scale):
    """q [q_len, H, D] are the last q_len positions of k/v [seq_len, H_kv, D]; float64, causal."""
    q_len, seq_len, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, 1)
    v = v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    allowed = torch.ones(q_len, seq_len, dtype=torch.bool).tril(seq_len - q_len)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def new_kv_cache(layout, num_blocks, num_kv_heads, head_size, dtype, gen=None):
    """[2, num_blocks, block_size, num_kv_heads, head_size], stored token- or head-major."""
    if layout == "token_major":
        return torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_size, generator=gen).to(dtype)
    return torch.randn(2, num_blocks, num_kv_heads, BLOCK_SIZE, head_size, generator=gen).to(dtype).transpose(2, 3)


@pytest.mark.parametrize("layout", ["token_major", "head_major"])
def test_write_kv_cache_puts_each_token_in_its_slot(layout):
    kv_cache = new_kv_cache(layout, 8, 2, 4, torch.float32).zero_()
    key, value = torch.randn(5, 2, 4), torch.randn(5, 2, 4)
    slots = torch.tensor([0, 5, -1, 31, 17])  # -1: a padding token, not written

    torch_backend.write_kv_cache(key, value, kv_cache, slots)

    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(kv_cache[0, slot // BLOCK_SIZE, slot % BLOCK_SIZE], key[i])
            assert torch.equal(kv_cache[1, slot // BLOCK_SIZE, slot % BLOCK_SIZE], value[i])
    assert int((kv_cache != 0).any(-1).sum()) == 2 * 4 * 2  # 4 tokens x 2 heads, in keys and values


def paged_batch(query_lens, seq_lens, num_heads, num_kv_heads, head_size, num_blocks, dtype, layout, gen):
    """A random query batch and cache; each sequence's blocks scattered over the cache, as after churn."""
    kv_cache = new_kv_cache(layout, num_blocks, num_kv_heads, head_size, dtype, gen)
    free_blocks = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free_blocks.pop() for _ in range(math.ceil(n / BLOCK_SIZE))] for n in seq_lens]
    block_tables = torch.full((len(tables), max(map(len, tables))), -1, dtype=torch.int32)
    for i, t in enumerate(tables):
        block_tables[i, : len(t)] = torch.tensor(t)
    query = torch.randn(sum(query_lens), num_heads, head_size, generator=gen).to(dtype)
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=block_tables,
        slot_mapping=torch.full((sum(query_lens),), -1), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens))
    return query, kv_cache, metadata, tables


def check_against_dense(out, query, kv_cache, metadata, tables, scale, tolerance):
    assert out.dtype == query.dtype and out.shape == query.shape
    start = 0
    for table, q_len, s_len in zip(tables, metadata.query_lens_cpu, metadata.seq_lens_cpu):
        k = kv_cache[0, table].flatten(0, 1)[:s_len]
        v = kv_cache[1, table].flatten(0, 1)[:s_len]
        expected = dense_attention(query[start : start + q_len], k, v, scale)
        torch.testing.assert_close(out[start : start + q_len].double(), expected, atol=tolerance, rtol=tolerance)
        start += q_len


@pytest.mark.parametrize("layout", ["token_major", "head_major"])
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2)])
def test_mixed_batch_matches_dense_attention(layout, dtype, tolerance, num_heads, num_kv_heads):
    query_lens, seq_lens = [1, 7, 1, 13, 1], [9, 15, 1, 13, 22]  # decode, chunk, first token, prefill, decode
    head_size, scale = 8, 8**-0.5
    query, kv_cache, metadata, tables = paged_batch(query_lens, seq_lens, num_heads, num_kv_heads, head_size, 64,
                                                    dtype, layout, torch.Generator().manual_seed(0))

    out = torch_backend.paged_attention(query, kv_cache, metadata, scale)

    check_against_dense(out, query, kv_cache, metadata, tables, scale, tolerance)


def test_decode_works_in_and_out_of_inference_mode():
    """The decode path reuses gather buffers; one made under inference_mode (the engine) must not be
    reused outside it (a test calling the reference directly), where writing it would raise."""
    query, kv_cache, metadata, _ = paged_batch([1, 1], [5, 9], 4, 2, 4, 8, torch.float32, "head_major",
                                               torch.Generator().manual_seed(0))
    with torch.inference_mode():
        inside = torch_backend.paged_attention(query, kv_cache, metadata, 0.5)
    outside = torch_backend.paged_attention(query, kv_cache, metadata, 0.5)
    torch.testing.assert_close(inside, outside)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_many_decodes_of_spread_lengths_match_dense_attention(dtype, tolerance):
    """Many decodes of spread context lengths (padded to the longest), with a prefill chunk in the middle of
    the batch, so decode rows are not simply rows 0..B-1."""
    gen = torch.Generator().manual_seed(1)
    seq_lens = torch.randint(1, 90, (40,), generator=gen).tolist()
    query_lens = [1] * 40
    query_lens[17], seq_lens[17] = 6, 30  # a prefill chunk in the middle
    query, kv_cache, metadata, tables = paged_batch(query_lens, seq_lens, 4, 2, 8, 512, dtype, "head_major", gen)

    out = torch_backend.paged_attention(query, kv_cache, metadata, 0.3)

    check_against_dense(out, query, kv_cache, metadata, tables, 0.3, tolerance)
