"""The C++ CPU attention kernels, decode and prefill: the head sizes they specialise and the generic one,
wide GQA groups, any strides, and clear errors for input they do not take. Correctness in mixed batches is
covered with the rest of the torch backend (test_torch_attention.py)."""

import shutil

import pytest
import torch
from test_torch_attention import BLOCK_SIZE, check_against_dense, dense_attention, paged_batch

from pagoda.attention import cpu_kernels, torch_backend

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler: the kernel cannot be built here"),
]


@pytest.fixture(scope="module", autouse=True)
def kernel_built():
    assert cpu_kernels.available(), "the C++ attention kernels failed to build (see the log)"


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


@pytest.mark.parametrize("head_size", [64, 128])  # the bfloat16 path where the CPU has AVX512_BF16
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (16, 1), (12, 4), (40, 2)])
@pytest.mark.parametrize("seq_lens", [[45], [1, 4, 5, 37, 64, 3]])  # fewer sequences than threads: per KV head
def test_bfloat16_decode_matches_dense_attention(head_size, num_heads, num_kv_heads, seq_lens):
    query, kv_cache, metadata, tables = decode_batch(seq_lens, num_heads, num_kv_heads, head_size, torch.bfloat16)
    out = torch.full_like(query, float("nan"))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        cpu_kernels.paged_decode_attention(query, kv_cache[0], kv_cache[1], metadata.block_tables,
                                           metadata.seq_lens, head_size**-0.5, out)
    finally:
        torch.set_num_threads(threads)

    check_against_dense(out, query, kv_cache, metadata, tables, head_size**-0.5, 3e-2)


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


@pytest.mark.parametrize("block_size", [8, 16, 32])  # with AMX: a tile of 8 keys, one a block, two a block
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(9, 3, 64), (16, 1, 64), (4, 1, 128), (8, 4, 128)])
def test_bfloat16_decode_at_the_engine_block_sizes(block_size, num_heads, num_kv_heads, head_size):
    """The engine's blocks (16 by default), head-major; AMX's scores take whole tiles of keys a block (the item's
    query tiles fit in the first three shapes, not in the last: the vector path's)."""
    gen = torch.Generator().manual_seed(block_size)
    seq_lens = [1, block_size - 1, block_size, block_size + 1, 5 * block_size + 3, 300]
    blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 4
    kv_cache = torch.randn(2, num_blocks, num_kv_heads, block_size, head_size, generator=gen).to(
        torch.bfloat16).transpose(2, 3)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(n)] for n in blocks]
    block_tables = torch.zeros(len(tables), max(blocks), dtype=torch.int32)
    for i, table in enumerate(tables):
        block_tables[i, :len(table)] = torch.tensor(table)
    query = torch.randn(len(seq_lens), num_heads, head_size, generator=gen).to(torch.bfloat16)
    out = torch.full_like(query, float("nan"))

    cpu_kernels.paged_decode_attention(query, kv_cache[0], kv_cache[1], block_tables,
                                       torch.tensor(seq_lens, dtype=torch.int32), head_size**-0.5, out)

    for i, (table, seq_len) in enumerate(zip(tables, seq_lens)):
        k = kv_cache[0, table].flatten(0, 1)[:seq_len]
        v = kv_cache[1, table].flatten(0, 1)[:seq_len]
        expected = dense_attention(query[i : i + 1], k, v, head_size**-0.5)
        torch.testing.assert_close(out[i : i + 1].double(), expected, atol=3e-2, rtol=3e-2)


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


# --- prefill ----------------------------------------------------------------------------------------------

# a fresh prompt, a chunk after a cached prefix, drafts being verified (few rows, long context), a decode
# (left to the decode kernel), a prompt longer than a tile, a one-token context
PREFILL_QUERY_LENS, PREFILL_SEQ_LENS = [7, 13, 4, 1, 45, 2], [7, 30, 61, 9, 45, 2]


def prefill_batch(query_lens, seq_lens, num_heads, num_kv_heads, head_size, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // 4) for n in seq_lens) + 5
    return paged_batch(query_lens, seq_lens, num_heads, num_kv_heads, head_size, num_blocks, dtype, "head_major",
                       gen)


def run_prefill(query, kv_cache, metadata, scale, out=None):
    out = torch.full_like(query, float("nan")) if out is None else out
    cpu_kernels.paged_prefill_attention(query, kv_cache[0], kv_cache[1], metadata.block_tables,
                                        metadata.query_start_loc, metadata.seq_lens, scale, out)
    return out


def multi_row_sequences(query, out, metadata, tables):
    """The rows (and their sequences) the prefill kernel writes: sequences with two or more query rows."""
    keep = [i for i, q_len in enumerate(metadata.query_lens_cpu) if q_len > 1]
    starts = metadata.query_start_loc.tolist()
    rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in keep])
    sub = paged_metadata_of(metadata, keep)
    return query[rows], out[rows], sub, [tables[i] for i in keep], rows


def paged_metadata_of(metadata, keep):
    q_lens = [metadata.query_lens_cpu[i] for i in keep]
    s_lens = [metadata.seq_lens_cpu[i] for i in keep]
    return type(metadata)(
        query_start_loc=torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32),
        seq_lens=torch.tensor(s_lens, dtype=torch.int32), block_tables=metadata.block_tables[keep],
        slot_mapping=torch.full((sum(q_lens),), -1), max_query_len=max(q_lens), max_seq_len=max(s_lens),
        query_lens_cpu=q_lens, seq_lens_cpu=s_lens)


@pytest.mark.parametrize("head_size", [64, 128, 80, 8])  # 64 and 128: the AVX-512 path where the CPU has it
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (16, 1), (12, 4), (64, 1)])  # 64/1: > a tile's group
def test_prefill_matches_dense_attention_and_leaves_decode_rows_alone(head_size, num_heads, num_kv_heads):
    query, kv_cache, metadata, tables = prefill_batch(PREFILL_QUERY_LENS, PREFILL_SEQ_LENS, num_heads,
                                                      num_kv_heads, head_size, torch.float32)

    out = run_prefill(query, kv_cache, metadata, head_size**-0.5)

    q, o, sub, sub_tables, rows = multi_row_sequences(query, out, metadata, tables)
    check_against_dense(o, q, kv_cache, sub, sub_tables, head_size**-0.5, 1e-5)
    decode_row = metadata.query_start_loc[3]
    assert out[decode_row].isnan().all()


@pytest.mark.parametrize("dtype,tolerance", [(torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
def test_prefill_in_half_precision_with_strided_query_and_output(dtype, tolerance):
    query, kv_cache, metadata, tables = prefill_batch(PREFILL_QUERY_LENS, PREFILL_SEQ_LENS, 9, 3, 64, dtype)
    qkv = torch.cat([query, torch.randn_like(query)], dim=1)  # the query is a slice of the fused projection
    out = torch.full((query.shape[0], 18, 64), float("nan"), dtype=dtype)[:, :9]

    run_prefill(qkv[:, :9], kv_cache, metadata, 0.125, out)

    q, o, sub, sub_tables, _ = multi_row_sequences(query, out, metadata, tables)
    check_against_dense(o, q, kv_cache, sub, sub_tables, 0.125, tolerance)


@pytest.mark.parametrize("head_size", [64, 128])  # both have a bfloat16 tile where the CPU has AVX512_BF16 (or AMX)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (64, 1)])  # 64/1: a tile's heads split, rows of one
def test_prefill_matches_the_torch_path_on_long_chunks_in_bfloat16(head_size, num_heads, num_kv_heads):
    query, kv_cache, metadata, _ = prefill_batch([300, 129, 1, 64], [900, 129, 400, 700], num_heads, num_kv_heads,
                                                 head_size, torch.bfloat16, seed=3)
    out = run_prefill(query, kv_cache, metadata, head_size**-0.5)
    reference = torch_backend.paged_attention_in_torch(query, kv_cache, metadata, head_size**-0.5)

    prefill_rows = torch.cat([torch.arange(0, 429), torch.arange(430, 494)])
    torch.testing.assert_close(out[prefill_rows].float(), reference[prefill_rows].float(), atol=1.6e-2, rtol=1e-2)


@pytest.mark.parametrize("head_size", [64, 128])
def test_prefill_follows_later_keys_far_above_the_running_max_in_bfloat16(head_size):
    """Keys chunks after the first whose scores pass every earlier one's by far (past the bound within which the
    bfloat16 tiles keep their running max, csrc/paged_attention_common.h's kLazyMaxLog2, and past float32's range
    above it): the max moves there, and the output still matches the reference, for the rows that see those keys
    and for those that do not. At every ISA level (tests/kernels/test_cpu_isa_levels.py): AMX's, vdpbf16ps'."""
    query, kv_cache, metadata, tables = prefill_batch([700, 200], [900, 200], 9, 3, head_size, torch.bfloat16, seed=7)
    for block in {tables[0][position // BLOCK_SIZE] for position in (333, 610, 611, 850)}:
        kv_cache[0, block] *= 100  # scores 100x their spread: some far above the running max, some far below
    out = run_prefill(query, kv_cache, metadata, head_size**-0.5)
    check_against_dense(out, query, kv_cache, metadata, tables, head_size**-0.5, 3e-2)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_prefill_scores_far_below_the_maximum_get_zero_weight(dtype, tolerance):
    query, kv_cache, metadata, tables = prefill_batch([20, 33, 90], [20, 50, 150], 2, 1, 64, dtype, seed=5)
    query = query * 40

    out = run_prefill(query, kv_cache, metadata, 0.125)

    check_against_dense(out, query, kv_cache, metadata, tables, 0.125, tolerance)


@pytest.mark.parametrize("change,message", [
    (dict(query_start_loc=lambda s: s.long()), "int32"),
    (dict(query=lambda q: q.double()), "one dtype"),
    (dict(query_start_loc=lambda s: s[:-1]), "num_seqs \\+ 1 starts"),
])
def test_prefill_refuses_bad_input_with_a_message(change, message):
    query, kv_cache, metadata, _ = prefill_batch([3, 4], [5, 6], 2, 1, 8, torch.float32)
    args = dict(query=query, query_start_loc=metadata.query_start_loc)
    args = {name: change.get(name, lambda x: x)(value) for name, value in args.items()}

    with pytest.raises(RuntimeError, match=message):
        cpu_kernels.paged_prefill_attention(args["query"], kv_cache[0], kv_cache[1], metadata.block_tables,
                                            args["query_start_loc"], metadata.seq_lens, 1.0,
                                            torch.empty_like(args["query"]))


def test_bfloat16_decode_ignores_whatever_sits_past_each_context():
    """The bfloat16 decode path reads keys in pairs; an odd context's partner row is a free slot of the
    block, which may hold any bits (here NaN and inf): it must weigh nothing."""
    query, kv_cache, metadata, tables = decode_batch([7, 33, 1], 9, 3, 64, torch.bfloat16, seed=2)
    for table, seq_len in zip(tables, metadata.seq_lens_cpu):
        last, used = table[-1], seq_len - 4 * (len(table) - 1)
        kv_cache[0, last, used:] = float("nan")
        kv_cache[1, last, used:] = float("inf")
    out = torch.empty_like(query)

    cpu_kernels.paged_decode_attention(query, kv_cache[0], kv_cache[1], metadata.block_tables, metadata.seq_lens,
                                       0.125, out)

    check_against_dense(out, query, kv_cache, metadata, tables, 0.125, 3e-2)
