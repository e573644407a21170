"""Paged attention in plain torch: the CPU path and the reference for the Triton kernels.

KV cache of one layer: ``kv_cache[0]`` keys, ``kv_cache[1]`` values, each
[num_blocks, block_size, num_kv_heads, head_size].
"""

import torch
import torch.nn.functional as F

from pagoda.attention.metadata import AttentionMetadata


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    num_kv_heads, head_size = key.shape[1], key.shape[2]
    flat = kv_cache.view(2, -1, num_kv_heads, head_size)  # [2, num_slots, H_kv, D]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    flat[0].index_copy_(0, slot_mapping, key.to(flat.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(flat.dtype))


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
) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
    """Each query row attends causally to its sequence's context through the block table."""
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
        # query j sits at absolute position s_len - q_len + j: it sees keys 0..that position
        mask = torch.ones(q_len, s_len, dtype=torch.bool, device=query.device).tril(s_len - q_len)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, scale=scale,
            enable_gqa=group > 1,
        )
        out[start : start + q_len] = o[0].transpose(0, 1)
        start += q_len
    if decode_rows:
        _batched_decode(query, key_cache, value_cache, metadata, decode_rows, scale, out)
    return out


_workspaces: dict[tuple, torch.Tensor] = {}


def _workspace(slot: int, num_blocks: int, cache: torch.Tensor) -> torch.Tensor:
    """A reused [num_blocks, block_size, H_kv, D] buffer for gathered blocks: fresh multi-MB allocations
    every layer cost more in page faults than the copy itself."""
    key = (slot, cache.device, cache.dtype, cache.shape[1:])
    buf = _workspaces.get(key)
    if buf is None or buf.shape[0] < num_blocks:
        buf = torch.empty((int(num_blocks * 1.25) + 1, *cache.shape[1:]), dtype=cache.dtype, device=cache.device)
        _workspaces[key] = buf
    return buf[:num_blocks]


def _batched_decode(query, key_cache, value_cache, metadata, rows, scale, out):
    """All single-token queries at once: gather their contexts padded to the longest."""
    device = query.device
    all_decode = len(rows) == metadata.num_seqs  # then query row i is sequence i: no indexing needed
    max_len = max(metadata.seq_lens_cpu[i] for i in rows)
    block_size = key_cache.shape[1]
    num_blocks = (max_len + block_size - 1) // block_size
    if all_decode:
        seq_lens = metadata.seq_lens.long()
        tables = metadata.block_tables[:, :num_blocks]
    else:
        rows_t = torch.tensor(rows, device=device)
        token_idx = metadata.query_start_loc[rows_t].long()  # query row of each decode sequence
        seq_lens = metadata.seq_lens[rows_t].long()
        tables = metadata.block_tables[rows_t, :num_blocks]
    tables = tables.long().clamp_min(0).flatten()  # [B * nb]
    num_kv_heads, head_size = key_cache.shape[2], key_cache.shape[3]
    k_blocks = _workspace(0, tables.numel(), key_cache)
    v_blocks = _workspace(1, tables.numel(), value_cache)
    torch.index_select(key_cache, 0, tables, out=k_blocks)
    torch.index_select(value_cache, 0, tables, out=v_blocks)
    k = k_blocks.view(len(rows), -1, num_kv_heads, head_size)[:, :max_len]  # [B, L, Hkv, D]
    v = v_blocks.view(len(rows), -1, num_kv_heads, head_size)[:, :max_len]
    q = query if all_decode else query[token_idx]  # [B, H, D]
    mask = torch.arange(max_len, device=device)[None, :] < seq_lens[:, None]  # [B, L]
    if query.dtype == torch.float32:
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None, None, :], scale=scale,
            enable_gqa=num_kv_heads != query.shape[1],
        ).squeeze(2)
    else:
        o = _decode_attention_per_kv_head(q, k, v, mask, scale)
    if all_decode:
        out.copy_(o)
    else:
        out[token_idx] = o


def _decode_attention_per_kv_head(
    q: torch.Tensor,  # [B, H, D]
    k: torch.Tensor,  # [B, L, H_kv, D], strided view of the gathered blocks
    v: torch.Tensor,  # [B, L, H_kv, D]
    mask: torch.Tensor,  # [B, L] bool, True = attend
    scale: float,
) -> torch.Tensor:  # [B, H, D]
    """One query row per sequence in bfloat16/float16: per KV head, two batched matmuls that read the
    strided cache views in place, softmax in float32 (as transformers' eager attention). On CPU this
    is ~3.5x faster than SDPA, whose kernel is tuned for long queries; in float32 SDPA is faster."""
    batch, num_heads, head_size = q.shape
    num_kv_heads = k.shape[2]
    q = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_size)  # [B, H_kv, G, D]
    out = torch.empty_like(q)
    masked_out = ~mask[:, None, :]  # [B, 1, L]
    for h in range(num_kv_heads):
        scores = torch.bmm(q[:, h], k[:, :, h].transpose(1, 2)).float().mul_(scale)  # [B, G, L]
        scores.masked_fill_(masked_out, float("-inf"))
        torch.bmm(torch.softmax(scores, dim=-1).to(v.dtype), v[:, :, h], out=out[:, h])
    return out.view(batch, num_heads, head_size)
