"""Sliding-window KV in the block manager (core.kv_window), no torch: blocks wholly behind every layer's window
are released as a sequence advances, stay findable by the prefix cache until evicted, and a fake runner that
holds token ids in place of KV checks before every step that each sequence's window holds its own tokens
(all that windowed attention reads), through chunked prefill, forks, swap and recompute preemption."""

import random

import pytest
from scheduler_workload import run_random_workload, seq
from transformers import AutoConfig

from pagoda.config import SchedulerConfig
from pagoda.core.block_manager import BlockManager, block_hash
from pagoda.core.kv_window import NULL_BLOCK, blocks_per_sequence, droppable_window, num_blocks_behind_window
from pagoda.core.scheduler import Scheduler
from pagoda.models.family import layer_windows

pytestmark = pytest.mark.unit


def test_only_models_whose_every_layer_slides_drop_blocks():
    def windows(model_type, **kw):
        cfg = AutoConfig.for_model(model_type, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=128, vocab_size=100, num_hidden_layers=4, **kw)
        return droppable_window(layer_windows(cfg))

    assert windows("mistral", sliding_window=4096) == 4096  # Mistral v0.1
    assert windows("qwen2", use_sliding_window=True, sliding_window=32, max_window_layers=0) == 32
    assert windows("qwen2", use_sliding_window=True, sliding_window=32, max_window_layers=2) is None
    assert windows("gemma2", sliding_window=16) is None  # global layers read everything
    assert windows("mistral", sliding_window=None) is None  # Mistral v0.2+
    assert droppable_window([8, 16, 8]) == 16 and droppable_window([]) is None


def test_blocks_behind_the_window_and_one_sequences_most():
    # window 8, blocks of 4: the query at position 11 sees 4..11, so block 0 (0..3) is behind it
    assert num_blocks_behind_window(11, 8, 4) == 1
    assert num_blocks_behind_window(12, 8, 4) == 1  # sees 5..12: block 1 (4..7) is still read
    assert num_blocks_behind_window(14, 8, 4) == 1  # sees 7..14
    assert num_blocks_behind_window(15, 8, 4) == 2  # sees 8..15
    assert num_blocks_behind_window(100, None, 4) == 0
    assert blocks_per_sequence(1000, 4, None, 16) == 250
    assert blocks_per_sequence(1000, 4, 8, 16) == 7  # ceil((8 - 1 + 16) / 4) + 1
    assert blocks_per_sequence(12, 4, 8, 16) == 3  # never more than the whole context


def test_decoding_releases_the_blocks_behind_the_window():
    bm = BlockManager(16, 4, sliding_window=8)
    s = seq(10)
    assert bm.allocate(s, 10) == []
    s.num_computed_tokens = 10
    first = list(bm.block_table(s))
    assert len(first) == 3 and bm.num_used_blocks == 3
    for _ in range(20):  # decode: one token a step
        s.append_token(7)
        assert bm.allocate(s, 1) == []
        s.num_computed_tokens += 1
        table = bm.block_table(s)
        behind = num_blocks_behind_window(s.num_computed_tokens - 1, 8, 4)
        assert table[:behind] == [NULL_BLOCK] * behind and NULL_BLOCK not in table[behind:]
        assert bm.num_used_blocks == len(table) - behind <= blocks_per_sequence(10_000, 4, 8, 1)
    assert len(bm.block_table(s)) == 8  # 30 tokens: positions keep their block index
    # the released full blocks went to the prefix cache: a new request with the same prompt finds them
    again = seq(10)
    assert bm.find_cached_prefix(again) == first[:2]
    bm.free(s)
    bm.check_no_leaks()


def test_a_prefix_hit_behind_the_window_is_not_taken():
    bm = BlockManager(16, 4, sliding_window=4)
    a = seq(17)
    bm.allocate(a, 17)
    bm.free(a)
    b = seq(17)
    hits = bm.find_cached_prefix(b)
    assert len(hits) == 4
    assert bm.allocate(b, 1, hits) == []  # computes position 16, which sees 13..16
    assert bm.block_table(b)[:3] == [NULL_BLOCK] * 3 and bm.block_table(b)[3] == hits[3]
    assert [bm.ref_counts[h] for h in hits] == [0, 0, 0, 1]
    bm.free(b)
    bm.check_no_leaks()


def run(bm, s, chunk=4) -> list[int]:
    """Allocate and 'compute' all of s's tokens, chunk tokens a step (blocks behind the window released as it
    goes); returns the block each of its table's entries had."""
    held = []
    while s.num_computed_tokens < s.num_tokens:
        n = min(chunk, s.num_tokens - s.num_computed_tokens)
        assert bm.allocate(s, n) is not None
        s.num_computed_tokens += n
        held += bm.block_table(s)[len(held):]
    return held


def evict(bm, block):
    bm.cached_blocks.pop(bm.hash_of_block[block])
    bm.hash_of_block[block] = None


def test_a_hit_needs_only_the_blocks_its_window_reaches():
    """Window 8, blocks of 4: a hit of h blocks needs blocks (4h - 7) // 4 .. h - 1 cached. 6 blocks hold a
    30-token sequence only by reusing the blocks it freed behind its window, so its first blocks are
    evicted while it runs; the same tokens then hit 7 blocks (28 tokens) of which only the last two are
    taken, as vLLM's sliding-window lookup (one from the first block would find nothing)."""
    bm = BlockManager(6, 4, sliding_window=8)
    a = seq(30)
    table = run(bm, a)
    bm.free(a)
    assert bm.hash_of_block[table[0]] != block_hash(None, (0, 1, 2, 3))
    hits = bm.find_cached_prefix(seq(30))
    assert hits == [NULL_BLOCK] * 5 + table[5:7]
    b = seq(30)
    assert bm.allocate(b, 2, hits) == []
    assert bm.block_table(b)[:7] == hits and NULL_BLOCK not in bm.block_table(b)[5:]
    bm.free(b)
    bm.check_no_leaks()


def test_the_longest_hit_whose_window_is_cached_wins():
    bm = BlockManager(16, 4, sliding_window=8)
    a = seq(30)
    table = run(bm, a)
    bm.free(a)
    assert bm.find_cached_prefix(seq(30)) == [NULL_BLOCK] * 5 + table[5:7]
    evict(bm, table[6])  # a hit of 7 blocks would need it: the next run down, 6 blocks, needs blocks 4 and 5
    assert bm.find_cached_prefix(seq(30)) == [NULL_BLOCK] * 4 + table[4:6]
    evict(bm, table[4])  # 5 blocks would need 3 and 4; 4 blocks need 2 and 3
    assert bm.find_cached_prefix(seq(30)) == [NULL_BLOCK] * 2 + table[2:4]
    evict(bm, table[2])
    evict(bm, table[0])  # every other block gone: no two neighbours, and every hit past one block needs two
    assert bm.find_cached_prefix(seq(30)) == []
    assert BlockManager(16, 4, enable_prefix_caching=False, sliding_window=8).find_cached_prefix(seq(30)) == []


class WindowRunner:
    """Blocks hold token ids instead of KV; tables and tokens come from the scheduler's deltas, as the model
    runner keeps them. Every position a query of the step can see must hold its sequence's own token."""

    def __init__(self, num_blocks, num_swap_blocks, block_size, window):
        self.bs, self.window = block_size, window
        self.device = [[None] * block_size for _ in range(num_blocks)]
        self.host = [[None] * block_size for _ in range(num_swap_blocks)]
        self.tokens: dict[int, list[int]] = {}
        self.tables: dict[int, list[int]] = {}

    def execute(self, out):
        for d, h in out.blocks_to_swap_out:
            self.host[h] = list(self.device[d])
        for h, d in out.blocks_to_swap_in:
            self.device[d] = list(self.host[h])
        for src, dst in out.blocks_to_copy:
            self.device[dst] = list(self.device[src])
        for s in out.scheduled:
            if s.reset:
                self.tokens[s.seq_id], self.tables[s.seq_id] = list(s.new_token_ids), list(s.block_ids)
            else:
                self.tokens[s.seq_id] += s.new_token_ids
                del self.tables[s.seq_id][s.block_ids_start:]
                self.tables[s.seq_id] += s.block_ids
        for s in out.scheduled:
            tokens, table = self.tokens[s.seq_id], self.tables[s.seq_id]
            for p in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens):
                assert table[p // self.bs] != NULL_BLOCK, (s.seq_id, p)
                self.device[table[p // self.bs]][p % self.bs] = tokens[p]
        for s in out.scheduled:
            tokens, table = self.tokens[s.seq_id], self.tables[s.seq_id]
            for p in range(max(0, s.num_computed_tokens - self.window + 1), s.num_computed_tokens):
                assert self.device[table[p // self.bs]][p % self.bs] == tokens[p], (s.seq_id, p)


@pytest.mark.parametrize("mode,num_swap_blocks", [("swap", 40), ("swap", 3), ("recompute", 0)])
def test_random_workload_keeps_every_window_right_and_never_leaks(mode, num_swap_blocks):
    rng = random.Random(num_swap_blocks)
    window, bs, budget = 6, 4, 8
    bm = BlockManager(8, bs, True, num_swap_blocks, sliding_window=window)
    sched = Scheduler(SchedulerConfig(4, budget, True, 10_000, preemption_mode=mode), bm)
    runner = WindowRunner(8, num_swap_blocks, bs, window)
    longest, _ = run_random_workload(sched, runner, bm, rng, 500, lambda step: seq(
        rng.randint(1, 40), start=rng.choice([0, 1000 + step]), max_tokens=rng.randint(1, 60),
        n_out=rng.choice([1, 1, 2])))
    bm.check_no_leaks()
    assert longest > 2 * 8 * bs  # sequences twice as long as the whole cache ran
    assert sched.num_preemptions > 0
    if num_swap_blocks:
        assert sched.num_swapped_out > 0 and sched.num_swapped_in > 0
