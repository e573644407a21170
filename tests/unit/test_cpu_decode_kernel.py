"""The C++ CPU decode kernel: the head sizes it specialises and the generic one, wide GQA groups, any
strides, and clear errors for input it does not take. Correctness in mixed batches is covered with the
rest of the torch backend (test_torch_attention.py)."""

import shutil

import pytest
import torch
from test_torch_attention import check_against_dense, paged_batch

from pagoda.attention import cpu_kernels, torch_backend

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler: the kernel cannot be built here"),
]


@pytest.fixture(scope="module", autouse=True)
def kernel_built():
    assert cpu_kernels.available(), "the C++ decode kernel failed to build (see the log)"


def decode_batch(seq_lens, num_heads, num_kv_heads, head_size, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // 4) for n in seq_lens) + 5
    return paged_batch([1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, head_size, num_blocks, dtype,
                       "head_major", gen)


@pytest.mark.parametrize("head_size", [64, 128, 80, 8])  # 64 and 128 are compiled specially
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (16, 1), (12, 4), (40, 2)])  # 40/2: > 16 per KV head
def test_decode_matches_dense_attention(head_size, num_heads, num_kv_heads):
    query, kv_cache, metadata, tables = decode_batch([1, 4, 5, 37, 64, 3], num_heads, num_kv_heads, head_size,
                                                     torch.float32)
    out = torch.full_like(query, float("nan"))

    cpu_kernels.paged_decode_attention(query, kv_cache[0], kv_cache[1], metadata.block_tables, metadata.seq_lens,
                                       head_size**-0.5, out)

    check_against_dense(out, query, kv_cache, metadata, tables, head_size**-0.5, 1e-5)


def test_strided_query_and_output():
    """The engine passes the query as a slice of the fused QKV projection."""
    query, kv_cache, metadata, tables = decode_batch([9, 21], 4, 2, 64, torch.bfloat16)
    qkv = torch.cat([query, torch.randn_like(query)], dim=1)  # [B, 2 * H, D]: the query is every other row
    out = torch.zeros(2, 8, 64, dtype=torch.bfloat16)[:, :4]

    cpu_kernels.paged_decode_attention(qkv[:, :4], kv_cache[0], kv_cache[1], metadata.block_tables,
                                       metadata.seq_lens, 0.125, out)

    check_against_dense(out, query, kv_cache, metadata, tables, 0.125, 3e-2)


def test_matches_the_torch_path_on_long_contexts_in_bfloat16():
    gen = torch.Generator().manual_seed(3)
    seq_lens = torch.randint(200, 900, (12,), generator=gen).tolist()
    query, kv_cache, metadata, _ = decode_batch(seq_lens, 9, 3, 64, torch.bfloat16, seed=3)
    out = torch.empty_like(query)

    cpu_kernels.paged_decode_attention(query, kv_cache[0], kv_cache[1], metadata.block_tables, metadata.seq_lens,
                                       0.125, out)
    reference = torch.empty_like(query)
    torch_backend._batched_decode(query, kv_cache[0], kv_cache[1], metadata.block_tables, metadata.seq_lens,
                                  max(seq_lens), 0.125, reference)

    torch.testing.assert_close(out.float(), reference.float(), atol=1.6e-2, rtol=1e-2)


@pytest.mark.parametrize("change,message", [
    (dict(block_tables=lambda t: t.long()), "int32"),
    (dict(query=lambda q: q.double()), "one dtype"),
    (dict(query=lambda q: q[:, :1, :5]), "head size must match"),
    (dict(seq_lens=lambda s: s[:1]), "one length per query row"),
])
def test_refuses_bad_input_with_a_message(change, message):
    query, kv_cache, metadata, _ = decode_batch([5, 6], 2, 1, 8, torch.float32)
    args = dict(query=query, block_tables=metadata.block_tables, seq_lens=metadata.seq_lens)
    args = {name: change.get(name, lambda x: x)(value) for name, value in args.items()}

    with pytest.raises(RuntimeError, match=message):
        cpu_kernels.paged_decode_attention(args["query"], kv_cache[0], kv_cache[1], args["block_tables"],
                                           args["seq_lens"], 1.0, torch.empty_like(args["query"]))


def test_scores_far_below_the_maximum_get_zero_weight():
    """Scores hundreds below the row's maximum underflow to zero weight (the kernel's own exp must not
    wrap its exponent around into huge weights)."""
    query, kv_cache, metadata, tables = decode_batch([7, 33], 2, 1, 64, torch.float32, seed=5)
    query = query * 40  # scaled scores spread over several hundred
    out = torch.empty_like(query)

    cpu_kernels.paged_decode_attention(query, kv_cache[0], kv_cache[1], metadata.block_tables, metadata.seq_lens,
                                       0.125, out)

    check_against_dense(out, query, kv_cache, metadata, tables, 0.125, 1e-4)
