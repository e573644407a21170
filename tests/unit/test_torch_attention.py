"""The torch attention backend (the CPU path and the kernels' reference) against dense attention,
for a batch mixing decodes, a chunked prefill and a fresh prefill, in each dtype."""

import math

import pytest
import torch

from pagoda.attention import AttentionMetadata, torch_backend

pytestmark = pytest.mark.unit

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


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2)])
def test_mixed_batch_matches_dense_attention(dtype, tolerance, num_heads, num_kv_heads):
    head_size, num_blocks = 8, 64
    query_lens, seq_lens = [1, 7, 1, 13, 1], [9, 15, 1, 13, 22]  # decode, chunk, first token, prefill, decode
    gen = torch.Generator().manual_seed(0)
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_size, generator=gen).to(dtype)
    free_blocks = torch.randperm(num_blocks, generator=gen).tolist()  # scattered, as after churn
    tables = [[free_blocks.pop() for _ in range(math.ceil(n / BLOCK_SIZE))] for n in seq_lens]
    block_tables = torch.full((len(tables), max(map(len, tables))), -1, dtype=torch.int32)
    for i, t in enumerate(tables):
        block_tables[i, : len(t)] = torch.tensor(t)
    query = torch.randn(sum(query_lens), num_heads, head_size, generator=gen).to(dtype)
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=block_tables,
        slot_mapping=torch.full((sum(query_lens),), -1), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), query_lens_cpu=query_lens, seq_lens_cpu=seq_lens)
    scale = head_size**-0.5

    out = torch_backend.paged_attention(query, kv_cache, metadata, scale)

    assert out.dtype == dtype and out.shape == query.shape
    start = 0
    for table, q_len, s_len in zip(tables, query_lens, seq_lens):
        k = kv_cache[0, table].flatten(0, 1)[:s_len]
        v = kv_cache[1, table].flatten(0, 1)[:s_len]
        expected = dense_attention(query[start : start + q_len], k, v, scale)
        torch.testing.assert_close(out[start : start + q_len].double(), expected, atol=tolerance, rtol=tolerance)
        start += q_len
