"""Sliding-window KV: which of a sequence's blocks no query will read again. Pure Python, no torch.

A layer with window W lets the query at position p see positions p - W + 1 .. p. When every layer slides,
the next query of a sequence that has computed q tokens is at position q or later, so no layer reads a
position before q - W + 1 (W the largest window): the blocks wholly before it can be freed, as vLLM's
sliding-window manager does. A freed full block keeps its hash, so the prefix cache can still hand it to
a request with the same prefix until it is evicted; and a prefix hit needs cached only the blocks its
window reaches (``BlockManager.find_cached_prefix`` searches from the end).

One full-attention layer reads every position, and all layers share one block table here: a model that
mixes local and global layers (Gemma 2/3, gpt-oss) gets a table per group of layers instead (``kv_cache_groups``),
whose windowed groups apply these rules; with --disable-hybrid-kv-cache-manager nothing is freed for it.

A freed entry stays in the block table as ``NULL_BLOCK``, so every position keeps its block index; the
attention paths never read before the window (torch gathers from the window's first position, the Triton
kernels start their tiles there).
"""

from collections.abc import Iterable

NULL_BLOCK = -1


def droppable_window(windows: Iterable[int | None]) -> int | None:
    """The window behind which KV blocks can be dropped: the largest of the layers' windows when every
    layer has one (the draft model's layers too: it reads through the same block tables); None when any
    layer attends to the whole context."""
    windows = list(windows)
    if not windows or any(w is None for w in windows):
        return None
    return max(windows)


def num_blocks_behind_window(num_computed: int, window: int | None, block_size: int) -> int:
    """How many leading blocks of a sequence no query at position num_computed or later can see."""
    if window is None:
        return 0
    return max(0, num_computed - window + 1) // block_size


def blocks_per_sequence(max_model_len: int, block_size: int, window: int | None, max_num_batched_tokens: int) -> int:
    """The most blocks one sequence holds at once: its whole context, or with a droppable window the
    window behind a chunk plus the chunk (and one block the window's start may straddle), as vLLM's
    sliding-window spec counts."""
    if window is None:
        return -(-max_model_len // block_size)
    tokens = min(window - 1 + max_num_batched_tokens, max_model_len)
    return min(-(-tokens // block_size) + 1, -(-max_model_len // block_size))
