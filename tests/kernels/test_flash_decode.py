"""The split-K decode kernels against the torch reference (forced, with small partitions so short contexts
still span several), and the backend's rule for when to use them."""

import pytest
import torch
from paged_batch import assert_close, make_batch, make_metadata, reference_attention

from pagoda.attention import triton_backend
from pagoda.kernels.flash_decode import flash_decode

pytestmark = pytest.mark.kernels


def run_split_k(batch, partition_size):
    md = batch.metadata
    return flash_decode(batch.query, batch.kv_cache[0], batch.kv_cache[1], md.block_tables, md.seq_lens,
                        md.max_seq_len, batch.scale, partition_size=partition_size)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_long_and_short_decodes(device, group, block_size):
    # 1328 spans 11 partitions of 128; the shorter sequences leave trailing partitions empty, 256 ends
    # exactly on a partition border
    pairs = [(1, 1328), (1, 256), (1, 5), (1, 1)]
    batch = make_batch(pairs, group, 1, 64, block_size, device=device, seed=group + block_size)
    assert_close(run_split_k(batch, 128), reference_attention(batch), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_size", [64, 80, 96, 128])
def test_head_sizes_and_dtypes(device, head_size, dtype):
    batch = make_batch([(1, 300), (1, 130), (1, 7)], 8, 2, head_size, 16, dtype=dtype, device=device,
                       seed=head_size)
    assert_close(run_split_k(batch, 64), reference_attention(batch), dtype)


def test_default_partition_size(device):
    batch = make_batch([(1, 1100), (1, 600)], 4, 1, 64, 16, device=device)
    assert_close(run_split_k(batch, 512), reference_attention(batch), torch.float32)


def _decode_metadata(seq_lens, device="cpu"):
    tables = torch.zeros(len(seq_lens), 1, dtype=torch.int32)
    return make_metadata([(1, s) for s in seq_lens], tables, device)


def test_dispatch_rule():
    cpu = torch.device("cpu")  # dispatches as a GPU with FALLBACK_NUM_SMS SMs
    slots = triton_backend.ONE_PASS_PROGRAMS_PER_SM * triton_backend.FALLBACK_NUM_SMS
    long = 2 * triton_backend.SPLIT_K_PARTITION_SIZE
    assert triton_backend.use_split_k(_decode_metadata([long, 3]), 8, cpu)
    assert not triton_backend.use_split_k(_decode_metadata([long - 1, 3]), 8, cpu), "short contexts: one pass"
    assert not triton_backend.use_split_k(_decode_metadata([long] * (slots // 8)), 8, cpu), "enough programs"
    assert triton_backend.use_split_k(_decode_metadata([long] * (slots // 8 - 1)), 8, cpu)
    mixed = make_metadata([(1, long), (4, 10)], torch.zeros(2, 1, dtype=torch.int32), "cpu")
    assert not triton_backend.use_split_k(mixed, 8, cpu), "split-K serves pure decode batches only"


def test_partitions_shrink_until_every_sm_has_work():
    cpu = torch.device("cpu")
    slots = triton_backend.SPLIT_K_PROGRAMS_PER_SM * triton_backend.FALLBACK_NUM_SMS  # 432
    one_seq = _decode_metadata([32768])  # 64 partitions of 512 for one kv head: halve to 128 (256 programs)
    assert triton_backend.split_k_partition_size(one_seq, 1, cpu) == triton_backend.SPLIT_K_MIN_PARTITION_SIZE
    assert triton_backend.split_k_partition_size(one_seq, 4, cpu) == 256  # 4 kv heads x 128 partitions >= 432
    many = _decode_metadata([32768] * -(-slots // 64))  # 64 partitions of 512 each already fill every slot
    assert triton_backend.split_k_partition_size(many, 1, cpu) == triton_backend.SPLIT_K_PARTITION_SIZE


def test_backend_takes_split_k_for_few_long_decodes(device, monkeypatch):
    batch = make_batch([(1, 1328), (1, 40)], 4, 1, 64, 16, device=device)
    calls = []
    real = triton_backend._flash_decode.flash_decode
    monkeypatch.setattr(triton_backend._flash_decode, "flash_decode",
                        lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    out = triton_backend.paged_attention(batch.query, batch.kv_cache, batch.metadata, batch.scale)
    assert [c["partition_size"] for c in calls] == [triton_backend.SPLIT_K_MIN_PARTITION_SIZE]  # 2 x 11 partitions
    assert_close(out, reference_attention(batch), torch.float32)
