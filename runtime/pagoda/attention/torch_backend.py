"""Paged attention in plain torch: the CPU path and the reference for the Triton kernels.

KV cache of one layer: ``kv_cache[0]`` keys, ``kv_cache[1]`` values, each
[num_blocks, block_size, num_kv_heads, head_size], with any strides. The model runner stores it
head-major ([num_blocks, num_kv_heads, block_size, head_size] in memory), so that one head's block is
one contiguous run: decode gathers a head's context in long copies and multiplies it in place.

An fp8 cache (``kv_cache_dtype="fp8"``) holds fp8(k / k_scale) and fp8(v / v_scale): written quantized, read
back block by block (the gathered context, or one head's blocks at decode) in the query's dtype, with
k_scale folded into the softmax scale and v_scale applied to the output. On CPU the C++ kernels
(``cpu_kernels``) do all of it where they are built: float and fp8 caches (widened in registers), sliding
windows and soft-capped scores, and the fp8 write; the torch code here is the fallback and the reference.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagoda.attention import cpu_kernels
from pagoda.attention.metadata import AttentionMetadata
from pagoda.layers import fused_cpu_ops
from pagoda.layers.quantization.fp8_cast import upcast
from pagoda.layers.quantization.kv_scales import is_fp8, quantize


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
    k_scale: float = 1.0,  # fp8 caches: stored = fp8(key / k_scale)
    v_scale: float = 1.0,
) -> None:
    if key.dtype == kv_cache.dtype and fused_cpu_ops.usable(key):
        fused_cpu_ops.write_kv_cache(key, value, kv_cache, slot_mapping)
        return
    if is_fp8(kv_cache) and _cpp_writes_fp8(key, value, kv_cache):
        cpu_kernels.write_kv_cache_fp8(key, value, kv_cache, slot_mapping, k_scale, v_scale)
        return
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    block_size = kv_cache.shape[2]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    if is_fp8(kv_cache):
        key, value = quantize(key, k_scale, kv_cache.dtype), quantize(value, v_scale, kv_cache.dtype)
    kv_cache[0].index_put_((blocks, offsets), key.to(kv_cache.dtype))
    kv_cache[1].index_put_((blocks, offsets), value.to(kv_cache.dtype))


def _cpp_writes_fp8(key, value, kv_cache) -> bool:
    return (key.device.type == "cpu" and key.dtype in _FLOAT_DTYPES and value.dtype == key.dtype
            and key.stride(-1) == 1 and value.stride(-1) == 1 and kv_cache.stride(-1) == 1 and cpu_kernels.available())


def _gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    block_table: torch.Tensor,  # [max_blocks] int32
    seq_len: int,
) -> torch.Tensor:  # [seq_len, H_kv, D]
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache.index_select(0, block_table[:num_blocks].long())
    return blocks.flatten(0, 1)[:seq_len]


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    metadata: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,  # fp8 caches: the stored keys times k_scale are the keys
    v_scale: float = 1.0,
    *,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
    """Each query row attends causally to its sequence's context through the block table: the C++ kernels
    where they are built and read this cache, else ``paged_attention_in_torch`` (``windowed_attention`` for a
    window, soft-capping or sinks). sliding_window: a query at position p sees positions p - sliding_window + 1
    .. p; logit_softcap: scores = cap * tanh(scores / cap); sinks [num_heads] float32: each head's softmax
    denominator gains exp(sink) (gpt-oss's attention sinks)."""
    if query.device.type == "cpu" and query.shape[2] <= cpu_kernels.MAX_HEAD_SIZE and cpp_kernels_read(kv_cache) \
            and query.dtype in _FLOAT_DTYPES and (is_fp8(kv_cache) or kv_cache.dtype == query.dtype) \
            and cpu_kernels.available():
        return _paged_attention_cpu(query, kv_cache, metadata, scale,
                                    _CppVariant(k_scale, v_scale, sliding_window, logit_softcap, sinks))
    if sliding_window is not None or logit_softcap is not None or sinks is not None:
        return windowed_attention(query, kv_cache, metadata, scale, sliding_window, logit_softcap, k_scale, v_scale,
                                  sinks)
    return paged_attention_in_torch(query, kv_cache, metadata, scale, k_scale, v_scale)


_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def cpp_kernels_read(kv_cache: torch.Tensor) -> bool:
    """Whether the C++ CPU attention kernels read a cache of this dtype: float32, bfloat16, float16, and fp8
    (float8_e4m3fn / float8_e5m2, widened in registers as it is read), with or without a window or soft-cap."""
    return kv_cache.dtype in _FLOAT_DTYPES or is_fp8(kv_cache)


def windowed_attention(query, kv_cache, metadata: AttentionMetadata, scale: float, sliding_window: int | None,
                       logit_softcap: float | None, k_scale: float = 1.0, v_scale: float = 1.0,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention with a sliding window, soft-capped scores and/or sinks, a sequence at a time: only the window's
    positions are gathered (a decode reads at most sliding_window of them, whatever the context length)."""
    num_heads, head_size = query.shape[1:]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    start = 0
    for i, (q_len, s_len) in enumerate(zip(metadata.query_lens_cpu, metadata.seq_lens_cpu)):
        first_q = s_len - q_len  # the chunk's first position
        lo = 0 if sliding_window is None else max(0, first_q - sliding_window + 1)
        k = _gather_range(kv_cache[0], metadata.block_tables[i], lo, s_len)  # [L, H_kv, D]
        v = _gather_range(kv_cache[1], metadata.block_tables[i], lo, s_len)
        q_pos = torch.arange(first_q, s_len, device=query.device)[:, None]  # [q_len, 1]
        k_pos = torch.arange(lo, s_len, device=query.device)[None, :]  # [1, L]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        q = query[start : start + q_len].reshape(q_len, num_kv_heads, group, head_size).permute(1, 2, 0, 3)
        scores = torch.matmul(q.float(), k.float().permute(1, 2, 0)[:, None]) * (scale * k_scale)  # [H_kv, G, q_len, L]
        if logit_softcap is not None:
            scores = torch.tanh(scores / logit_softcap) * logit_softcap
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:  # the sink is one more logit in the denominator, with no value behind it
            sink = sinks.float().view(num_kv_heads, group, 1, 1).expand(-1, -1, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        o = torch.matmul(probs, v.float().permute(1, 0, 2)[:, None])  # [H_kv, G, q, D]
        if v_scale != 1.0:  # an fp8 cache's values
            o = o * v_scale
        out[start : start + q_len] = o.permute(2, 0, 1, 3).reshape(q_len, num_heads, head_size).to(out.dtype)
        start += q_len
    return out


def _gather_range(cache: torch.Tensor, block_table: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Context positions [lo, hi) of one sequence: [hi - lo, H_kv, D]."""
    block_size = cache.shape[1]
    first, last = lo // block_size, (hi + block_size - 1) // block_size
    blocks = cache.index_select(0, block_table[first:last].long())
    return blocks.flatten(0, 1)[lo - first * block_size : hi - first * block_size]


def paged_attention_in_torch(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    metadata: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
    """torch ops only (SDPA per prefill, batched matmuls for decodes): the reference the kernels are tested
    against, and the path on other devices. An fp8 cache is read in the query's dtype, a sequence's context
    (prefill) or one head's blocks (decode) at a time, never as a dequantized copy of the whole cache."""
    fp8 = is_fp8(kv_cache)
    num_heads = query.shape[1]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    decode_rows: list[int] = []
    start = 0
    for i, (q_len, s_len) in enumerate(zip(metadata.query_lens_cpu, metadata.seq_lens_cpu)):
        if q_len == 1:
            decode_rows.append(i)
            start += 1
            continue
        q = query[start : start + q_len].transpose(0, 1)  # [H, q_len, D]
        k = _gather_context(key_cache, metadata.block_tables[i], s_len).transpose(0, 1)
        v = _gather_context(value_cache, metadata.block_tables[i], s_len).transpose(0, 1)
        if fp8:  # k_scale folds into the softmax scale, v_scale into the output
            k, v = upcast(k, query.dtype), upcast(v, query.dtype)
        # query j sits at absolute position s_len - q_len + j: it sees keys 0..that position (a whole
        # prompt is plain causal attention, which SDPA does faster than with a mask)
        mask = None if q_len == s_len else \
            torch.ones(q_len, s_len, dtype=torch.bool, device=query.device).tril(s_len - q_len)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, is_causal=mask is None,
            scale=scale * k_scale if fp8 else scale, enable_gqa=group > 1,
        )
        o = o[0].transpose(0, 1)
        out[start : start + q_len] = o * v_scale if fp8 else o
        start += q_len
    if decode_rows:
        decode = _batched_decode
        if fp8:
            def decode(*args):
                _batched_decode(*args, k_scale=k_scale, v_scale=v_scale)
        _decode_rows(query, key_cache, value_cache, metadata, decode_rows, scale, out, decode)
    return out


@dataclass(frozen=True)
class _CppVariant:
    """The kernels' arguments past the scale: fp8 scales, window, soft-cap and sinks (None: none)."""

    k_scale: float = 1.0
    v_scale: float = 1.0
    sliding_window: int | None = None
    logit_softcap: float | None = None
    sinks: torch.Tensor | None = None

    def args(self) -> tuple:
        sinks = None if self.sinks is None else self.sinks.float().contiguous()
        return self.k_scale, self.v_scale, self.sliding_window, self.logit_softcap, sinks


def _paged_attention_cpu(query, kv_cache, metadata: AttentionMetadata, scale: float,
                         variant: _CppVariant = _CppVariant()) -> torch.Tensor:
    """The C++ kernels: one call for every sequence with several query rows, one for the single-row ones."""
    out = torch.empty_like(query)
    if metadata.max_query_len == 1:  # all decodes: query row i is sequence i
        cpu_kernels.paged_decode_attention(query, kv_cache[0], kv_cache[1], metadata.block_tables,
                                           metadata.seq_lens, scale, out, *variant.args())
        return out
    cpu_kernels.paged_prefill_attention(query, kv_cache[0], kv_cache[1], metadata.block_tables,
                                        metadata.query_start_loc, metadata.seq_lens, scale, out, *variant.args())
    decode_rows = metadata.decode_seqs
    if decode_rows:
        def decode(query, key_cache, value_cache, block_tables, seq_lens, max_len, scale, out):
            cpu_kernels.paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, out,
                                               *variant.args())

        _decode_rows(query, kv_cache[0], kv_cache[1], metadata, decode_rows, scale, out, decode)
    return out


def _decode_rows(query, key_cache, value_cache, metadata, rows, scale, out, decode):
    """The batch's single-token queries (sequences `rows`) as one dense decode batch for ``decode`` (the C++
    kernel or ``_batched_decode``): gathered out of the query rows, and scattered back, only when prefill chunks
    sit among them."""
    max_len = max(metadata.seq_lens_cpu[i] for i in rows)
    if len(rows) == metadata.num_seqs:  # query row i is sequence i
        decode(query, key_cache, value_cache, metadata.block_tables, metadata.seq_lens, max_len, scale, out)
        return
    token_idx, block_tables, seq_lens = gather_sequences(metadata, rows)
    o = torch.empty((len(rows), *query.shape[1:]), dtype=query.dtype, device=query.device)
    decode(query[token_idx], key_cache, value_cache, block_tables, seq_lens, max_len, scale, o)
    out[token_idx] = o


def gather_sequences(metadata: AttentionMetadata, seqs: list[int]):
    """Single-row sequences `seqs` among prefill chunks -> their query rows [R] int64, block tables
    [R, max_blocks] and context lengths [R]: a dense decode batch."""
    seqs_t = torch.tensor(seqs, device=metadata.seq_lens.device)
    return metadata.query_start_loc[seqs_t].long(), metadata.block_tables[seqs_t], metadata.seq_lens[seqs_t]


_workspaces: dict[tuple, torch.Tensor] = {}


def _workspace(slot: int, num_blocks: int, cache_of_one_head: torch.Tensor) -> torch.Tensor:
    """A reused [num_blocks, block_size, D] buffer for gathered blocks: fresh multi-MB allocations every
    layer cost more in page faults than the copy itself."""
    shape = cache_of_one_head.shape[1:]
    # a buffer made under inference_mode cannot be written outside it
    key = (slot, cache_of_one_head.device, cache_of_one_head.dtype, shape, torch.is_inference_mode_enabled())
    buf = _workspaces.get(key)
    if buf is None or buf.shape[0] < num_blocks:
        buf = torch.empty((int(num_blocks * 1.25) + 1, *shape), dtype=cache_of_one_head.dtype,
                          device=cache_of_one_head.device)
        _workspaces[key] = buf
    return buf[:num_blocks]


def _batched_decode(query, key_cache, value_cache, block_tables, seq_lens, max_len, scale, out,
                    k_scale: float = 1.0, v_scale: float = 1.0):
    """One KV head at a time: gather the head's blocks of every context (padded to the longest, whole
    blocks, contiguous) and attend with two batched matmuls, softmax in float32. Faster on CPU than SDPA,
    whose kernel is tuned for long queries, in every dtype. An fp8 cache's head is gathered in fp8 and
    upcast to the query's dtype (one head's context at a time)."""
    fp8 = is_fp8(key_cache)
    device = query.device
    block_size, num_kv_heads, head_size = key_cache.shape[1:]
    num_blocks = (max_len + block_size - 1) // block_size
    seq_lens = seq_lens.long()
    tables = block_tables[:, :num_blocks].long().clamp_min(0).flatten()  # [B * nb]
    batch, padded_len = query.shape[0], num_blocks * block_size
    q = query.reshape(batch, num_kv_heads, -1, head_size)  # [B, H_kv, G, D]
    masked_out = (torch.arange(padded_len, device=device)[None, :] >= seq_lens[:, None])[:, None, :]  # [B, 1, L]
    o = torch.empty_like(q)
    for h in range(num_kv_heads):
        k = _workspace(0, tables.numel(), key_cache[:, :, h])
        v = _workspace(1, tables.numel(), value_cache[:, :, h])
        torch.index_select(key_cache[:, :, h], 0, tables, out=k)  # [B * nb, block_size, D]
        torch.index_select(value_cache[:, :, h], 0, tables, out=v)
        k, v = k.view(batch, padded_len, head_size), v.view(batch, padded_len, head_size)
        if fp8:
            k, v = upcast(k, query.dtype), upcast(v, query.dtype)
        scores = torch.bmm(q[:, h], k.transpose(1, 2)).float().mul_(scale * k_scale)  # [B, G, L]
        scores.masked_fill_(masked_out, float("-inf"))
        o[:, h] = torch.bmm(torch.softmax(scores, dim=-1).to(v.dtype), v)
        if v_scale != 1.0:
            o[:, h] *= v_scale
    out.copy_(o.view(batch, -1, head_size))
