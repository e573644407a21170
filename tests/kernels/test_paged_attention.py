"""The mixed-batch kernel against the torch reference: decodes, prefill chunks and prefix-cache hits in
one launch, over GQA ratios, block sizes, head sizes and dtypes (tolerances in paged_batch.TOLERANCES)."""

import pytest
import torch
from paged_batch import MIXED_PAIRS, assert_close, make_batch, reference_attention

from pagoda.kernels.paged_attention import num_warps, paged_attention

pytestmark = pytest.mark.kernels


def run_kernel(batch, max_query_len=None, out=None):
    key_cache, value_cache = batch.kv_cache[0], batch.kv_cache[1]
    md = batch.metadata
    return paged_attention(batch.query, key_cache, value_cache, md.block_tables, md.query_start_loc, md.seq_lens,
                           md.max_query_len if max_query_len is None else max_query_len, batch.scale, out=out)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_mixed_batch_over_gqa_ratios_and_block_sizes(device, group, block_size):
    # one kv head keeps the interpreter quick; the multi-kv-head grid axis is covered below
    batch = make_batch(MIXED_PAIRS, group, 1, 64, block_size, device=device, seed=group * block_size)
    assert_close(run_kernel(batch), reference_attention(batch), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_size", [64, 80, 96, 128])
def test_head_sizes_and_dtypes(device, head_size, dtype):
    pairs = [(1, 300), (37, 90), (5, 5), (1, 1)]
    batch = make_batch(pairs, 8, 2, head_size, 16, dtype=dtype, device=device, seed=head_size)
    assert_close(run_kernel(batch), reference_attention(batch), dtype)


@pytest.mark.parametrize("pairs", [
    [(1, 1), (1, 17), (1, 64), (1, 65), (1, 200)],  # pure decode: one token per program
    [(200, 200)],  # one fresh prefill spanning several query tiles
    [(16, 16), (17, 33), (15, 15), (1, 2)],  # chunks ending exactly on and around tile borders
    [(2, 3 + i) for i in range(20)],  # many sequences: the binary search over query_start_loc
], ids=["decodes", "prefill", "tile-borders", "many-seqs"])
@pytest.mark.parametrize("group", [3, 4])  # 3: padded query-head rows
def test_batch_shapes(device, pairs, group):
    batch = make_batch(pairs, 2 * group, 2, 32, 16, device=device, seed=len(pairs))
    assert_close(run_kernel(batch), reference_attention(batch), torch.float32)


def test_mqa_with_more_heads_than_a_tile(device):
    batch = make_batch([(1, 70), (9, 40)], 32, 1, 16, 16, device=device)
    assert_close(run_kernel(batch), reference_attention(batch), torch.float32)


def test_max_query_len_only_changes_tiling(device):
    """A batch with prefills launched as if it were pure decode (one-token tiles) still gives the right
    answer: the grid is sized from the token count, not from max_query_len."""
    batch = make_batch([(20, 50), (1, 9)], 4, 4, 32, 16, device=device)
    assert_close(run_kernel(batch, max_query_len=1), reference_attention(batch), torch.float32)


def test_strided_query_and_output(device):
    """query and out as views into wider buffers (as q is a slice of the fused qkv projection)."""
    batch = make_batch([(7, 30), (1, 12)], 4, 2, 32, 16, device=device)
    wide = torch.zeros(batch.query.shape[0], 6, 40, device=device)
    wide[:, 1:5, 3:35] = batch.query
    batch.query = wide[:, 1:5, 3:35]
    out_buf = torch.full((batch.query.shape[0], 4, 64), float("nan"), device=device)
    out = out_buf[:, :, ::2]
    result = run_kernel(batch, out=out)
    assert result.data_ptr() == out.data_ptr()
    assert_close(out, reference_attention(batch), torch.float32)
    assert torch.isnan(out_buf[:, :, 1::2]).all()  # the gaps between strided elements stay untouched


def test_kv_cache_with_permuted_strides(device):
    """A cache whose (slot, head) axes are stored head-major: the kernel follows the strides it is given."""
    batch = make_batch([(3, 40), (1, 21)], 4, 2, 32, 16, device=device)
    expected = reference_attention(batch)
    head_major = batch.kv_cache.transpose(2, 3).contiguous().transpose(2, 3)  # same values, other strides
    assert head_major.stride() != batch.kv_cache.stride()
    batch.kv_cache = head_major
    assert_close(run_kernel(batch), expected, torch.float32)


def test_warps_for_prefill_tiles_by_gpu_and_dtype():
    """Hopper runs 16-bit 64 x 128 prefill tiles at 4 warps (1.6-2.1x faster than 8 on an H200, docs/gpu.md); before
    Hopper, float32 and larger heads keep 8 (fewer spills, not measured faster); decode tiles take 4 everywhere."""
    assert num_warps(64, 128, 90, torch.bfloat16) == num_warps(64, 128, 90, torch.float16) == 4
    assert num_warps(64, 128, 80, torch.bfloat16) == num_warps(64, 128, None, torch.bfloat16) == 8
    assert num_warps(64, 128, 90, torch.float32) == num_warps(64, 256, 90, torch.bfloat16) == 8
    assert num_warps(16, 128, 80, torch.bfloat16) == num_warps(16, 128, 90, torch.bfloat16) == 4
