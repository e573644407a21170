"""KV cache groups: the hybrid KV cache manager for models that mix full and sliding-window layers (Gemma 2/3,
gpt-oss). Pure Python, no torch.

A full layer reads every position; a layer with window W reads only the last W. With one block table for all
layers nothing could be freed (``kv_window``); here the layers are grouped by attention type, vLLM's way:

- Each type's layers (in model order) are cut into groups of ``group_size`` layers, the fewest layers any type
  has; so gpt-oss (alternating) gets one full and one sliding group, Gemma 3 (5 local : 1 global) one full and
  five sliding groups. A group's layer j writes into the j-th of ``group_size`` cache tensors (a slot): one
  pool of blocks, each ``group_size`` layers deep, serves every group, and a block belongs to one group at a time.
- Each group has its own block table per sequence (one ``BlockManager`` per group, sharing the pool). A sliding
  group drops the blocks wholly behind its window as the sequence grows: their entries become NULL_BLOCK (the
  attention paths never read before the window) and the blocks go back to the pool, findable by their hash.
- A prefix hit must hold in every group: the full group's hit is its longest cached prefix; a sliding group's
  is the longest, no longer, whose window's blocks are still cached; the hit is shrunk until all agree.
- Allocation, swap-in and swap-out are all or nothing across groups: the needs are summed before anything is
  taken from the shared pool.

Models whose layers are all full, or all windowed, keep the single ``BlockManager`` (``kv_window`` for the
latter); ``--disable-hybrid-kv-cache-manager`` makes a mixed model's windowed layers keep full-length KV too.
"""

import logging
from dataclasses import dataclass

from pagoda.core.block_manager import BlockManager
from pagoda.core.kv_window import blocks_per_sequence
from pagoda.core.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCacheGroup:
    window: int | None  # None: full attention
    layers: tuple[int, ...]  # the model's layer indices; layers[j] writes into cache slot j


@dataclass(frozen=True)
class KVCacheGroups:
    groups: tuple[KVCacheGroup, ...]  # the full-attention groups first

    @property
    def group_size(self) -> int:
        """Cache slots: the layers one block holds (of the one group that owns it)."""
        return max(len(g.layers) for g in self.groups)

    def placement(self) -> dict[int, tuple[int, int]]:
        """layer index -> (its group, its slot)."""
        return {layer: (g, slot) for g, group in enumerate(self.groups) for slot, layer in enumerate(group.layers)}

    def blocks_per_sequence(self, max_model_len: int, block_size: int, max_num_batched_tokens: int) -> int:
        """The most blocks one sequence holds at once, all groups together."""
        return sum(blocks_per_sequence(max_model_len, block_size, g.window, max_num_batched_tokens)
                   for g in self.groups)

    def describe(self) -> str:
        return ", ".join(f"{'full' if g.window is None else f'window {g.window}'} {list(g.layers)}"
                         for g in self.groups)


def kv_cache_groups(windows: list[int | None]) -> KVCacheGroups | None:
    """The groups of a model whose layers' windows are `windows`; None unless full and windowed layers mix."""
    by_type: dict[int | None, list[int]] = {}
    for i, window in enumerate(windows):
        by_type.setdefault(window, []).append(i)
    if len(by_type) < 2 or None not in by_type:
        return None
    size = min(len(layers) for layers in by_type.values())
    types = sorted(by_type, key=lambda w: (w is not None, w or 0))  # full first, then by window
    return KVCacheGroups(tuple(KVCacheGroup(w, tuple(by_type[w][i : i + size]))
                               for w in types for i in range(0, len(by_type[w]), size)))


def kv_cache_groups_for(config, windows: list[int | None], log: bool = False) -> KVCacheGroups | None:
    """The groups an engine with `config` (an EngineConfig) runs, or None for one block table for all layers.
    The engine core and every model runner call it alike, so they agree."""
    groups = kv_cache_groups(windows)
    if groups is None:
        return None
    reason = None
    if config.cache.disable_hybrid_kv_cache_manager:
        reason = "--disable-hybrid-kv-cache-manager"
    elif config.draft_model is not None:
        reason = "a draft model reads through the target's block tables"
    elif config.parallel.pipeline_parallel_size > 1:
        reason = "pipeline parallelism"
    elif config.kv_transfer is not None:
        reason = "a KV connector moves whole block tables"
    if reason is not None:
        if log:
            logger.info("hybrid KV cache manager off (%s): windowed layers keep full-length KV", reason)
        return None
    if log:
        logger.info("hybrid KV cache manager: %d groups of %d layers: %s", len(groups.groups), groups.group_size,
                    groups.describe())
    return groups


def log_max_concurrency(max_model_len: int, num_blocks: int, blocks_per_request: int) -> float:
    """vLLM's start-up line: how many requests of max_model_len tokens the cache holds at once."""
    concurrency = num_blocks / blocks_per_request
    logger.info("Maximum concurrency for %s tokens per request: %.2fx", f"{max_model_len:,}", concurrency)
    return concurrency


class GroupedHit(list):
    """A prefix-cache hit across groups: the list itself is the first group's blocks (its length is the hit's,
    as the scheduler counts it); by_group holds every group's, each as long."""

    def __init__(self, by_group: list[list[int]]):
        super().__init__(by_group[0] if by_group else [])
        self.by_group = by_group


class HybridBlockManager:
    """The BlockManager interface over one BlockManager per KV cache group, all sharing one pool of blocks."""

    def __init__(self, groups: KVCacheGroups, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_swap_blocks: int = 0):
        first = BlockManager(num_blocks, block_size, enable_prefix_caching, num_swap_blocks, groups.groups[0].window)
        self.managers = [first] + [
            BlockManager(num_blocks, block_size, enable_prefix_caching, num_swap_blocks, g.window, pool=first, group=i)
            for i, g in enumerate(groups.groups[1:], start=1)]
        self.groups = groups
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_swap_blocks = num_swap_blocks
        self.sliding_window = None  # (no single window: each group has its own)
        self.cached_blocks = first.cached_blocks  # the pool's, every group's entries

    # --- the pool, shared ----------------------------------------------------------------------------

    @property
    def events(self):
        return self.managers[0].events

    @events.setter
    def events(self, recorder) -> None:
        for manager in self.managers:  # any group may evict a first-group block and must tell it
            manager.events = recorder

    @property
    def free_queue(self):
        return self.managers[0].free_queue

    @property
    def num_free_blocks(self) -> int:
        return self.managers[0].num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.managers[0].num_used_blocks

    def usage(self) -> float:
        return self.managers[0].usage()

    @property
    def num_used_swap_blocks(self) -> int:
        return self.managers[0].num_used_swap_blocks

    def swap_usage(self) -> float:
        return self.managers[0].swap_usage()

    @property
    def num_evicted_blocks(self) -> int:
        return sum(m.num_evicted_blocks for m in self.managers)

    # --- tables ----------------------------------------------------------------------------------------

    def block_table(self, seq: Sequence) -> list[int]:
        """The first (full-attention) group's table."""
        return self.managers[0].block_table(seq)

    def group_block_ids(self, seq: Sequence, start: int) -> list[list[int]]:
        """The other groups' tables from index start on (all groups' tables are as long)."""
        return [m.tables.get(seq.seq_id, [])[start:] for m in self.managers[1:]]

    def find_cached_prefix(self, seq: Sequence) -> GroupedHit:
        if not self.enable_prefix_caching:
            return GroupedHit([])
        hits = [m.find_cached_prefix(seq) for m in self.managers]
        length = min(len(h) for h in hits)
        while True:  # a windowed group's hit shorter than the others' may be a hit the others lack: agree
            for g, manager in enumerate(self.managers):
                if len(hits[g]) > length:
                    hits[g] = manager.find_cached_prefix_within(seq, length)
            shortest = min(len(h) for h in hits)
            if shortest == length:
                break
            length = shortest
        return GroupedHit([h[:length] for h in hits])

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int] | None = None,
                 keep_free: int = 0) -> list[tuple[int, int]] | None:
        """As BlockManager.allocate, in every group or in none."""
        by_group = getattr(cached, "by_group", None) or [None] * len(self.managers)
        plans = [m.plan_allocation(seq, num_new_tokens, c) for m, c in zip(self.managers, by_group)]
        if sum(plan[-1] for plan in plans) + keep_free > self.num_free_blocks:
            for manager in self.managers:
                if not manager.tables.get(seq.seq_id, True):
                    del manager.tables[seq.seq_id]
            return None
        for manager, plan in zip(self.managers, plans):  # every hit first: taking free blocks may evict them
            manager.take_cached_blocks(plan)
        copies = []
        for manager, plan in zip(self.managers, plans):
            copies += manager.take_new_blocks(seq, num_new_tokens, plan)
        return copies

    def release_slots_after(self, seq: Sequence, num_tokens: int) -> None:
        for manager in self.managers:
            manager.release_slots_after(seq, num_tokens)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        for manager in self.managers:
            manager.fork(parent, child)

    def free(self, seq: Sequence, keep_swapped: bool = False) -> None:
        for manager in self.managers:
            manager.free(seq, keep_swapped)

    # --- swap space --------------------------------------------------------------------------------------

    def can_swap_out(self, seq: Sequence) -> bool:
        from pagoda.core.kv_window import NULL_BLOCK

        held = sum(1 for m in self.managers for b in m.tables.get(seq.seq_id, []) if b != NULL_BLOCK)
        return 0 < held <= len(self.managers[0].free_swap_blocks)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        return [pair for m in self.managers for pair in m.swap_out(seq)]

    def swap_in(self, seq: Sequence, num_new_tokens: int, keep_free: int = 0) -> list[tuple[int, int]] | None:
        needed = sum(m.swap_in_blocks_needed(seq, num_new_tokens) for m in self.managers)
        if needed + keep_free > self.num_free_blocks:
            return None
        return [pair for m in self.managers for pair in m.swap_in(seq, num_new_tokens)]

    # --- the prefix cache and checks -----------------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        if any(m.swap_tables for m in self.managers):
            return False
        return self.managers[0].reset_prefix_cache()  # (the pool's map and hashes, cleared in place)

    def check_no_leaks(self) -> None:
        tables = [seq_id for m in self.managers for seq_id in m.tables]
        if tables:
            raise AssertionError(f"KV blocks leaked: tables={tables}")
        for manager in self.managers:
            manager.check_no_leaks()
