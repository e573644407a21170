"""64-bit addressing of the paged cache: block_id * block_stride passes 2**31 elements in any cache over
4 GiB (float16), and int32 arithmetic would silently wrap to another block.

Two tests, because such a cache cannot simply be allocated in a unit test:
- the address helpers every kernel uses (``paged_kv.context_offsets`` and ``slot_offsets``) are run directly
  on block ids near 2**31 with real strides and compared with exact Python integers, with no memory behind
  the offsets at all; a control run of the same formula without the widening shows the interpreter wraps,
  so the test would catch a regression;
- the real kernels run on a cache of 2**31 + a few blocks' elements that is allocated but never touched
  except for the blocks in use: the OS maps untouched pages lazily, so this costs address space, not
  memory (skipped where the allocation is refused). Its results must equal, bit for bit, the same
  computation on a compact copy of the blocks in use.
"""

import pytest
import torch
import triton
import triton.language as tl
from paged_batch import make_metadata

from pagoda.kernels.flash_decode import flash_decode
from pagoda.kernels.kv_cache import write_kv_cache
from pagoda.kernels.paged_attention import paged_attention
from pagoda.kernels.paged_kv import context_offsets, slot_offsets

pytestmark = pytest.mark.kernels


@triton.jit
def _probe_offsets(
    block_table_ptr,  # [N] int32: one sequence's table
    positions_ptr,  # [N] int32
    slots_ptr,  # [N] int64
    context_out_ptr,  # [N] int64
    slot_out_ptr,  # [N] int64
    wrapped_out_ptr,  # [N] int64: the same formula in int32, the control
    n,
    stride_block,
    stride_slot,
    BLOCK_SIZE: tl.constexpr,
    N: tl.constexpr,
):
    i = tl.arange(0, N)
    mask = i < n
    positions = tl.load(positions_ptr + i, mask=mask, other=0)
    tl.store(context_out_ptr + i, context_offsets(block_table_ptr, positions, mask, BLOCK_SIZE, stride_block,
                                                  stride_slot), mask=mask)
    slots = tl.load(slots_ptr + i, mask=mask, other=0)
    tl.store(slot_out_ptr + i, slot_offsets(slots, BLOCK_SIZE, stride_block, stride_slot), mask=mask)
    block_ids = tl.load(block_table_ptr + positions // BLOCK_SIZE, mask=mask, other=0)
    tl.store(wrapped_out_ptr + i, block_ids * stride_block + (positions % BLOCK_SIZE) * stride_slot, mask=mask)


def test_address_helpers_are_64_bit(device):
    block_size, num_kv_heads, head_size = 16, 8, 128  # Llama-3-8B's layout
    stride_slot = num_kv_heads * head_size
    stride_block = block_size * stride_slot  # 16384: block ids past 131072 overflow int32
    table = torch.tensor([2**31 - 1, 131072, 7, 2**30 + 5], dtype=torch.int32)
    positions = torch.tensor([0, 15, 16, 33, 47, 48, 63], dtype=torch.int32)
    slots = table.long()[positions.long() // block_size] * block_size + positions.long() % block_size
    outs = [torch.zeros(len(positions), dtype=torch.int64, device=device) for _ in range(3)]
    _probe_offsets[(1,)](table.to(device), positions.to(device), slots.to(device), *outs, len(positions),
                         stride_block, stride_slot, BLOCK_SIZE=block_size, N=8)
    expected = [int(table[p // block_size]) * stride_block + (p % block_size) * stride_slot
                for p in positions.tolist()]
    assert max(expected) > 2**44
    assert outs[0].tolist() == expected
    assert outs[1].tolist() == expected
    assert outs[2].tolist() != expected, "control: int32 arithmetic should have wrapped"


def _sparse_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, device):
    try:
        return torch.empty(num_blocks, block_size, num_kv_heads, head_size, dtype=dtype, device=device)
    except (RuntimeError, MemoryError) as e:  # torch raises OutOfMemoryError (a RuntimeError) on CUDA
        pytest.skip(f"cannot reserve {num_blocks * block_size * num_kv_heads * head_size * dtype.itemsize / 2**30:.1f}"
                    f" GiB of address space for a cache past 2**31 elements: {e}")


def test_kernels_address_blocks_past_2_to_the_31(device):
    block_size, num_kv_heads, head_size, dtype = 16, 1, 64, torch.float16
    block_elements = block_size * num_kv_heads * head_size
    first_far_block = 2**31 // block_elements + 1  # its first element lies past 2**31
    pairs = [(3, 40), (1, 21)]  # a prefill chunk after cached context, and a decode
    blocks = [[first_far_block + 2, 5, first_far_block], [first_far_block + 1, first_far_block + 3]]
    num_blocks = first_far_block + 4
    big_k = _sparse_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, device)
    big_v = _sparse_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, device)
    used = sorted({b for seq in blocks for b in seq})
    compact_id = {b: i for i, b in enumerate(used)}
    small_k = torch.zeros(len(used), block_size, num_kv_heads, head_size, dtype=dtype, device=device)
    small_v = torch.zeros_like(small_k)

    # fill every slot of every sequence through the write kernel: big and compact caches alike
    g = torch.Generator().manual_seed(0)
    for cache_k, cache_v, ids in [(big_k, big_v, lambda b: b), (small_k, small_v, compact_id.get)]:
        g.manual_seed(0)
        for seq, (_, seq_len) in enumerate(pairs):
            slots = torch.tensor([ids(blocks[seq][p // block_size]) * block_size + p % block_size
                                  for p in range(seq_len)], device=device)
            key = torch.randn(seq_len, num_kv_heads, head_size, generator=g).to(dtype).to(device)
            value = torch.randn(seq_len, num_kv_heads, head_size, generator=g).to(dtype).to(device)
            write_kv_cache(key, value, cache_k, cache_v, slots)

    def tables(ids):
        return torch.tensor([[ids(b) for b in seq] + [0] * (3 - len(seq)) for seq in blocks], dtype=torch.int32)

    query = torch.randn(4, 4, head_size, generator=g).to(dtype).to(device)
    far, near = make_metadata(pairs, tables(lambda b: b), device), make_metadata(pairs, tables(compact_id.get), device)
    assert int(far.block_tables.max()) * block_elements > 2**31
    args = lambda md: (md.block_tables, md.query_start_loc, md.seq_lens, md.max_query_len, 0.125)  # noqa: E731
    assert torch.equal(paged_attention(query, big_k, big_v, *args(far)),
                       paged_attention(query, small_k, small_v, *args(near)))
    assert torch.equal(small_k[compact_id[first_far_block]], big_k[first_far_block])

    decodes = [(1, 40), (1, 21)]
    far, near = make_metadata(decodes, tables(lambda b: b), device), make_metadata(decodes, tables(compact_id.get),
                                                                                  device)
    q = query[:2]
    assert torch.equal(flash_decode(q, big_k, big_v, far.block_tables, far.seq_lens, 40, 0.125, partition_size=64),
                       flash_decode(q, small_k, small_v, near.block_tables, near.seq_lens, 40, 0.125,
                                    partition_size=64))
