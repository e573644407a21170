"""The launchers reject bad arguments with a message naming the tensor, what was expected and what it got."""

import pytest
import torch

from pagoda.attention import triton_backend
from pagoda.kernels.flash_decode import flash_decode
from pagoda.kernels.kv_cache import write_kv_cache
from pagoda.kernels.paged_attention import paged_attention
from pagoda.kernels.rmsnorm import fused_add_rms_norm, rms_norm
from pagoda.kernels.rotary import apply_rotary_

pytestmark = pytest.mark.kernels


def attention_args(device, **overrides):
    args = dict(
        query=torch.zeros(3, 4, 32, device=device),
        key_cache=torch.zeros(5, 16, 2, 32, device=device),
        value_cache=torch.zeros(5, 16, 2, 32, device=device),
        block_tables=torch.zeros(2, 4, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, 2, 3], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([2, 1], dtype=torch.int32, device=device),
        max_query_len=2, scale=0.1)
    args.update(overrides)
    return args


@pytest.mark.parametrize("override,match", [
    (dict(query=torch.zeros(3, 4, 32, dtype=torch.int32)),
     r"paged_attention: query must be float16 or bfloat16 or float32; got int32 \[3, 4, 32\]"),
    (dict(query=torch.zeros(3, 128)), r"query must be of shape \[num_tokens, num_heads, head_size\] = \[\*, \*, \*\]; "
                                      r"got float32 \[3, 128\]"),
    (dict(key_cache=torch.zeros(5, 16, 2, 64)), r"key_cache must be of shape .* = \[\*, \*, \*, 32\]; got float32 \[5, 16, 2, 64\]"),
    (dict(key_cache=torch.zeros(5, 16, 2, 32, dtype=torch.float16)), r"key_cache must be float32 or float8_e4m3fn or float8_e5m2; got float16"),
    (dict(value_cache=torch.zeros(5, 32, 2, 32)), r"value_cache must be of shape .* = \[5, 16, 2, 32\]"),
    (dict(query=torch.zeros(3, 3, 32)), r"query must be .*num_heads a multiple of num_kv_heads \(2\); got float32 \[3, 3, 32\]"),
    (dict(block_tables=torch.zeros(2, 4, dtype=torch.int64)), r"block_tables must be int32; got int64 \[2, 4\]"),
    (dict(block_tables=torch.zeros(4, 2, dtype=torch.int32).t()), r"block_tables must be contiguous along its last "
                                                                  r"dimension; got int32 \[2, 4\] with strides \[1, 2\]"),
    (dict(seq_lens=torch.tensor([2, 1, 1], dtype=torch.int32)), r"seq_lens must be of shape \[num_seqs\] = \[2\]; got"),
    (dict(query_start_loc=torch.tensor([0, 3], dtype=torch.int32)),
     r"query_start_loc must be of shape \[num_seqs \+ 1\] = \[3\]; got int32 \[2\]"),
], ids=["query-dtype", "query-rank", "cache-head-size", "cache-dtype", "value-cache-shape", "gqa-ratio",
        "table-dtype", "table-strides", "seq-lens-shape", "query-start-loc-shape"])
def test_paged_attention_rejects(override, match):
    with pytest.raises(ValueError, match=match):
        paged_attention(**attention_args("cpu", **override))


def test_paged_attention_rejects_mixed_devices_and_cpu_without_interpreter(monkeypatch):
    args = attention_args("cpu")
    args["query"] = torch.zeros(3, 4, 32, device="meta")
    with pytest.raises(ValueError, match=r"key_cache is on cpu but query is on meta"):
        paged_attention(**args)
    from pagoda.kernels import _checks

    monkeypatch.setattr(_checks, "is_interpreted", lambda kernel: False)
    with pytest.raises(RuntimeError, match=r"run on CUDA tensors; got tensors on cpu.*TRITON_INTERPRET=1"):
        paged_attention(**attention_args("cpu"))


def test_flash_decode_rejects():
    args = attention_args("cpu")
    common = dict(key_cache=args["key_cache"], value_cache=args["value_cache"], block_tables=args["block_tables"],
                  seq_lens=args["seq_lens"], scale=0.1)
    with pytest.raises(ValueError, match=r"flash_decode: query must be .*one token per sequence \(num_seqs = 2\); "
                                         r"got float32 \[3, 4, 32\]"):
        flash_decode(args["query"], max_seq_len=2, **common)
    with pytest.raises(ValueError, match=r"partition_size must be a positive multiple of 64; got 100"):
        flash_decode(args["query"][:2], max_seq_len=2, partition_size=100, **common)
    with pytest.raises(ValueError, match=r"max_seq_len must be an int >= 1"):
        flash_decode(args["query"][:2], max_seq_len=0, **common)


def test_write_kv_cache_rejects():
    key = torch.zeros(4, 2, 32)
    cache = torch.zeros(3, 16, 2, 32)
    slots = torch.arange(4)
    with pytest.raises(ValueError, match=r"write_kv_cache: slot_mapping must be int64; got int32 \[4\]"):
        write_kv_cache(key, key, cache, cache, slots.int())
    with pytest.raises(ValueError, match=r"value must be of shape .* = \[4, 2, 32\]; got float32 \[4, 2, 16\]"):
        write_kv_cache(key, torch.zeros(4, 2, 16), cache, cache, slots)
    with pytest.raises(ValueError, match=r"key_cache must be of shape .* = \[\*, \*, 2, 32\]; got float32 \[3, 16, 4, 16\]"):
        write_kv_cache(key, key, torch.zeros(3, 16, 4, 16), cache, slots)
    with pytest.raises(ValueError, match=r"write_kv_cache: kv_cache must be \[2, num_blocks, block_size, num_kv_heads, "
                                         r"head_size\] \(keys, values\); got \[3, 16, 2, 32\]"):
        triton_backend.write_kv_cache(key, key, cache, slots)


def test_rms_norm_rejects():
    weight = torch.ones(64)
    with pytest.raises(ValueError, match=r"rms_norm: x must be \[\.\.\., hidden\] with hidden = 64; got float32 \[2, 32\]"):
        rms_norm(torch.zeros(2, 32), weight, 1e-6)
    with pytest.raises(ValueError, match=r"x must be contiguous along its last dimension; got float32 \[64, 2\] "
                                         r"with strides \[1, 64\]"):
        rms_norm(torch.zeros(2, 64).T, torch.ones(2), 1e-6)
    with pytest.raises(ValueError, match=r"fused_add_rms_norm: residual must be float32 \[2, 64\] like x; "
                                         r"got float16 \[2, 64\]"):
        fused_add_rms_norm(torch.zeros(2, 64), torch.zeros(2, 64, dtype=torch.float16), weight, 1e-6)
    with pytest.raises(ValueError, match=r"x must be float16, bfloat16 or float32; got int64"):
        rms_norm(torch.zeros(2, 64, dtype=torch.int64), weight, 1e-6)


def test_rotary_rejects():
    positions = torch.arange(3)
    cache = torch.zeros(8, 16)
    with pytest.raises(ValueError, match=r"apply_rotary_: query must be .* with a multiple of head_size = 16 "
                                         r"columns; got float32 \[3, 40\]"):
        apply_rotary_(positions, torch.zeros(3, 40), torch.zeros(3, 16), cache, 16)
    with pytest.raises(ValueError, match=r"key must be of shape \[num_tokens, num_heads \* head_size\] = \[3, \*\]; "
                                         r"got float32 \[4, 16\]"):
        apply_rotary_(positions, torch.zeros(3, 32), torch.zeros(4, 16), cache, 16)
    with pytest.raises(ValueError, match=r"cos_sin_cache must be float32; got float16"):
        apply_rotary_(positions, torch.zeros(3, 32), torch.zeros(3, 16), cache.half(), 16)
    with pytest.raises(ValueError, match=r"cos_sin_cache must be .*even rotary_dim <= head_size = 16.*; "
                                         r"got float32 \[8, 32\]"):
        apply_rotary_(positions, torch.zeros(3, 32), torch.zeros(3, 16), torch.zeros(8, 32), 16)
    with pytest.raises(ValueError, match=r"query must be contiguous along its last dimension"):
        apply_rotary_(positions, torch.zeros(32, 3).t(), torch.zeros(3, 16), cache, 16)
