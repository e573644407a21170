"""The hybrid KV cache manager (core.kv_cache_groups), no torch: layers grouped by attention type, one shared pool,
a block table per group; windowed groups release the blocks behind their window; prefix hits agree across groups;
a fake runner that holds (group, token id) in place of KV checks before every step that each group's table reads
its own tokens where its layers look (all positions for full groups, the window for sliding ones), through
chunked prefill, prefix hits, forks, swap and recompute preemption."""

import random

import pytest
from scheduler_workload import run_random_workload, seq
from transformers import AutoConfig

from pagoda.config import SchedulerConfig
from pagoda.core.block_manager import BlockManager
from pagoda.core.kv_cache_groups import (
    GroupedHit,
    HybridBlockManager,
    KVCacheGroup,
    kv_cache_groups,
    kv_cache_groups_for,
    log_max_concurrency,
)
from pagoda.core.kv_window import NULL_BLOCK, blocks_per_sequence
from pagoda.core.scheduler import Scheduler
from pagoda.models.family import layer_windows

pytestmark = pytest.mark.unit


def test_groups_by_attention_type():
    # gpt-oss / Gemma 2: alternating -> one full group and one sliding group of as many layers
    g = kv_cache_groups([8, None, 8, None])
    assert g.groups == (KVCacheGroup(None, (1, 3)), KVCacheGroup(8, (0, 2))) and g.group_size == 2
    assert g.placement() == {1: (0, 0), 3: (0, 1), 0: (1, 0), 2: (1, 1)}
    # Gemma 3: 5 local : 1 global -> one full group, five sliding groups of one layer each
    cfg = AutoConfig.for_model("gemma3_text", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                               intermediate_size=128, vocab_size=100, num_hidden_layers=6, sliding_window=32)
    g = kv_cache_groups(layer_windows(cfg))
    assert [x.window for x in g.groups] == [None, 32, 32, 32, 32, 32] and g.group_size == 1
    # a remainder makes a smaller group (its slots stay unused in the blocks it owns)
    g = kv_cache_groups([8, 8, 8, None, None])
    assert [x.layers for x in g.groups] == [(3, 4), (0, 1), (2,)] and g.group_size == 2
    # not mixed: one table for all layers, as before (all windowed ones drop blocks through kv_window)
    assert kv_cache_groups([None, None]) is None and kv_cache_groups([8, 8]) is None
    assert kv_cache_groups([8, 16]) is None


def test_blocks_per_sequence_and_the_concurrency_line(caplog):
    g = kv_cache_groups([8, None])
    # full: 1000 / 4 = 250 blocks; window 8: ceil((8 - 1 + 16) / 4) + 1 = 7
    assert g.blocks_per_sequence(1000, 4, 16) == 257
    assert blocks_per_sequence(1000, 4, None, 16) == 250
    with caplog.at_level("INFO", logger="pagoda.core.kv_cache_groups"):
        assert log_max_concurrency(1000, 514, 257) == 2.0
    assert "Maximum concurrency for 1,000 tokens per request: 2.00x" in caplog.text


def test_windowed_groups_release_their_blocks_full_ones_keep_them():
    bm = HybridBlockManager(kv_cache_groups([8, None]), 64, 4)
    s = seq(10)
    assert bm.allocate(s, 10) == []
    s.num_computed_tokens = 10
    assert bm.num_used_blocks == 6  # 3 blocks in each group
    for _ in range(40):
        s.append_token(7)
        assert bm.allocate(s, 1) is not None
        s.num_computed_tokens += 1
    full, sliding = bm.block_table(s), bm.managers[1].block_table(s)
    assert len(full) == len(sliding) == 13 and NULL_BLOCK not in full
    # the last allocation, at 49 computed, is for the query at 49: it sees 42..49, blocks 10 to 12
    assert sliding[:10] == [NULL_BLOCK] * 10 and NULL_BLOCK not in sliding[10:]
    assert bm.num_used_blocks == 13 + 3
    assert bm.group_block_ids(s, 11) == [sliding[11:]]
    assert set(full).isdisjoint(sliding)  # one pool, a block in one group at a time
    bm.free(s)
    bm.check_no_leaks()


def test_allocation_is_all_or_nothing_across_groups():
    bm = HybridBlockManager(kv_cache_groups([8, None]), 5, 4)
    s = seq(12)  # 3 blocks per group: 6 > 5
    assert bm.allocate(s, 12) is None
    assert bm.num_used_blocks == 0 and all(s.seq_id not in m.tables for m in bm.managers)
    assert bm.allocate(s, 8) == [] and bm.num_used_blocks == 4
    bm.free(s)
    bm.check_no_leaks()


def test_a_prefix_hit_agrees_across_groups_and_needs_the_window_cached():
    bm = HybridBlockManager(kv_cache_groups([8, None]), 64, 4)
    a = seq(30)
    bm.allocate(a, 30)
    a.num_computed_tokens = 30
    bm.free(a)  # every block cached, free
    b = seq(30)
    hit = bm.find_cached_prefix(b)
    assert isinstance(hit, GroupedHit) and len(hit) == 7  # 29 tokens: 7 full blocks, the last token computed
    full, sliding = hit.by_group
    assert NULL_BLOCK not in full and sliding[:5] == [NULL_BLOCK] * 5  # only the window's blocks are needed
    # evict the sliding group's block 5: its window for a 7-block hit is gone; a 5-block hit needs blocks 3 and 4
    key = next(k for k, v in bm.cached_blocks.items() if v == sliding[5])
    del bm.cached_blocks[key]
    bm.managers[0].hash_of_block[sliding[5]] = None
    hit = bm.find_cached_prefix(b)
    assert len(hit) == 5 and len(hit.by_group[1]) == 5
    assert bm.allocate(b, 10, hit) is not None  # 20 cached + 10 new
    assert bm.managers[1].block_table(b)[:3] == [NULL_BLOCK] * 3
    bm.free(b)
    bm.check_no_leaks()


def test_a_plain_block_manager_says_it_has_no_groups():
    bm = BlockManager(8, 4)
    s = seq(4)
    bm.allocate(s, 4)
    assert bm.group_block_ids(s, 0) is None


class GroupRunner:
    """Blocks hold (group, token id) instead of KV, in one shared pool; tables and tokens come from the scheduler's
    deltas, as the model runner keeps them. Every position a group's layers can see must hold its sequence's own
    token, written through that group's table."""

    def __init__(self, num_blocks, num_swap_blocks, block_size, windows):
        self.bs, self.windows = block_size, windows
        self.device = [[None] * block_size for _ in range(num_blocks)]
        self.host = [[None] * block_size for _ in range(num_swap_blocks)]
        self.tokens: dict[int, list[int]] = {}
        self.tables: dict[int, list[list[int]]] = {}

    def execute(self, out):
        for d, h in out.blocks_to_swap_out:
            self.host[h] = list(self.device[d])
        for h, d in out.blocks_to_swap_in:
            self.device[d] = list(self.host[h])
        for src, dst in out.blocks_to_copy:
            self.device[dst] = list(self.device[src])
        for s in out.scheduled:
            assert s.group_block_ids is not None and len(s.group_block_ids) == len(self.windows) - 1
            deltas = [s.block_ids, *s.group_block_ids]
            if s.reset:
                self.tokens[s.seq_id], self.tables[s.seq_id] = list(s.new_token_ids), [list(d) for d in deltas]
            else:
                self.tokens[s.seq_id] += s.new_token_ids
                for table, delta in zip(self.tables[s.seq_id], deltas):
                    del table[s.block_ids_start:]
                    table += delta
        for s in out.scheduled:
            tokens = self.tokens[s.seq_id]
            for g, table in enumerate(self.tables[s.seq_id]):
                for p in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens):
                    assert table[p // self.bs] != NULL_BLOCK, (s.seq_id, g, p)
                    self.device[table[p // self.bs]][p % self.bs] = (g, tokens[p])
        for s in out.scheduled:
            tokens = self.tokens[s.seq_id]
            for g, (table, window) in enumerate(zip(self.tables[s.seq_id], self.windows)):
                first = 0 if window is None else max(0, s.num_computed_tokens - window + 1)
                for p in range(first, s.num_computed_tokens):
                    assert self.device[table[p // self.bs]][p % self.bs] == (g, tokens[p]), (s.seq_id, g, p)


@pytest.mark.parametrize("mode,num_swap_blocks,chunk", [("swap", 60, 8), ("swap", 5, 8), ("recompute", 0, 8),
                                                         ("recompute", 0, 64)])
def test_random_workload_keeps_every_group_right_and_never_leaks(mode, num_swap_blocks, chunk):
    rng = random.Random(num_swap_blocks + chunk)
    # without chunked prefill a prompt (or a recomputed sequence) takes all its blocks in every group at once
    bs, num_blocks, most_tokens = 4, 24 if chunk < 64 else 48, 40 if chunk < 64 else 20
    groups = kv_cache_groups([6, None, 6, 6, None, 6])  # one full group, two sliding groups (window 6)
    windows = [g.window for g in groups.groups]
    bm = HybridBlockManager(groups, num_blocks, bs, True, num_swap_blocks)
    sched = Scheduler(SchedulerConfig(4, chunk, chunk < 64, 10_000, preemption_mode=mode), bm)
    runner = GroupRunner(num_blocks, num_swap_blocks, bs, windows)
    longest, peak = run_random_workload(sched, runner, bm, rng, 600, lambda step: seq(
        rng.randint(1, 30), start=rng.choice([0, 0, 1000 + step]), max_tokens=rng.randint(1, most_tokens),
        n_out=rng.choice([1, 1, 2])))
    bm.check_no_leaks()
    assert longest > 2 * 6 + 4 * bs and peak <= num_blocks  # sequences ran well past their windows
    assert sched.prefix_cache_hits > 0
    assert sched.num_preemptions > 0
    if num_swap_blocks:
        assert sched.num_swapped_out > 0 and sched.num_swapped_in > 0


def test_what_keeps_one_table_for_every_layer(caplog):
    from types import SimpleNamespace

    def config(disable=False, draft=None, pp=1, kv_transfer=None):
        return SimpleNamespace(cache=SimpleNamespace(disable_hybrid_kv_cache_manager=disable), draft_model=draft,
                               parallel=SimpleNamespace(pipeline_parallel_size=pp), kv_transfer=kv_transfer)

    windows = [8, None]
    assert kv_cache_groups_for(config(), windows) == kv_cache_groups(windows)
    assert kv_cache_groups_for(config(), [None, None]) is None  # no window: the single-table path, as before
    with caplog.at_level("INFO", logger="pagoda.core.kv_cache_groups"):
        for off, why in [(config(disable=True), "--disable-hybrid-kv-cache-manager"),
                         (config(draft=object()), "draft model"), (config(pp=2), "pipeline parallelism"),
                         (config(kv_transfer=object()), "KV connector")]:
            assert kv_cache_groups_for(off, windows, log=True) is None
            assert why in caplog.text


def test_the_serve_flag_reaches_the_cache_config(tiny_model_factory):
    import argparse

    from pagoda.config import create_engine_config
    from pagoda.entrypoints.openai.cli_args import add_serve_arguments, split_args

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert not split_args(parser.parse_args([]))[0].disable_hybrid_kv_cache_manager
    engine = split_args(parser.parse_args(["--disable-hybrid-kv-cache-manager"]))[0]
    assert engine.disable_hybrid_kv_cache_manager
    engine.model = str(tiny_model_factory("gemma3"))
    assert create_engine_config(engine).cache.disable_hybrid_kv_cache_manager
