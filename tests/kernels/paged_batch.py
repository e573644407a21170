"""Random paged-attention batches for the kernel tests, and the tolerances they are compared with.

The reference is the torch backend run in float32 on the same (already rounded) inputs, so the tolerance
only covers the kernel's own rounding: float16/bfloat16 probabilities feed the P @ V product, and the
output is rounded to the input dtype.
"""

from dataclasses import dataclass

import torch

from pagoda.attention.metadata import AttentionMetadata

TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=1e-5),
    torch.float16: dict(atol=3e-3, rtol=1e-2),
    torch.bfloat16: dict(atol=2.5e-2, rtol=2e-2),
}

# (query_len, context_len): a long decode, a chunked prefill after a prefix-cache hit, a fresh prefill,
# and the shortest possible decode, in one batch
MIXED_PAIRS = [(1, 1328), (129, 463), (5, 5), (1, 1)]


@dataclass
class PagedBatch:
    query: torch.Tensor  # [num_tokens, num_heads, head_size]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_size]
    metadata: AttentionMetadata
    scale: float


def make_metadata(pairs, tables: torch.Tensor, device) -> AttentionMetadata:
    query_lens = [q for q, _ in pairs]
    seq_lens = [s for _, s in pairs]
    query_start_loc = torch.zeros(len(pairs) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(query_lens).cumsum(0)
    return AttentionMetadata(
        query_start_loc=query_start_loc.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        slot_mapping=torch.full((sum(query_lens),), -1, dtype=torch.int64, device=device),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens, seq_lens_cpu=seq_lens)


def make_batch(pairs, num_heads: int, num_kv_heads: int, head_size: int, block_size: int,
               dtype=torch.float32, device="cpu", seed: int = 0, spare_blocks: int = 3) -> PagedBatch:
    """Each sequence gets distinct blocks in shuffled order; table entries past a sequence's end are
    random block ids or -1 (the torch reference reads them and masks them out, so they must be one of
    those), which the kernels must never use."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for _, s in pairs]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=g).to(dtype)
    order = torch.randperm(num_blocks, generator=g).to(torch.int32)
    width = max(blocks_per_seq) + 2
    tables = torch.randint(-1, num_blocks, (len(pairs), width), generator=g, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = order[used : used + n]
        used += n
    num_tokens = sum(q for q, _ in pairs)
    query = torch.randn(num_tokens, num_heads, head_size, generator=g).to(dtype)
    return PagedBatch(query.to(device), kv_cache.to(device), make_metadata(pairs, tables, device),
                      head_size**-0.5)


def reference_attention(batch: PagedBatch) -> torch.Tensor:
    from pagoda.attention import torch_backend

    return torch_backend.paged_attention_in_torch(batch.query.float(), batch.kv_cache.float(), batch.metadata, batch.scale)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), **TOLERANCES[dtype])
