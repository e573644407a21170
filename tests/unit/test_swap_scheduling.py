"""Swap space in the block manager and scheduler, no torch: a fake runner holds each block's tokens in
place of its KV, does the swap and copy-on-write copies the scheduler asks for, and checks before every
step that each sequence's cached positions hold its own tokens (what attention would read)."""

import random

import pytest

from pagoda.config import SchedulerConfig
from pagoda.core.block_manager import BlockManager
from pagoda.core.scheduler import Scheduler
from pagoda.core.sequence import Sequence
from pagoda.sampling_params import SamplingParams

pytestmark = pytest.mark.unit


def make(num_blocks=8, num_swap_blocks=16, block_size=4, budget=64, max_seqs=8, mode="swap", prefix=True):
    bm = BlockManager(num_blocks, block_size, prefix, num_swap_blocks)
    return Scheduler(SchedulerConfig(max_seqs, budget, True, 10_000, preemption_mode=mode), bm)


def seq(n, start=0, max_tokens=100):
    return Sequence("r", list(range(start, start + n)), SamplingParams(max_tokens=max_tokens))


class FakeRunner:
    """Blocks hold token ids instead of KV; the tables and tokens come from the scheduler's deltas."""

    def __init__(self, num_blocks, num_swap_blocks, block_size):
        self.bs = block_size
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
        # each layer writes the whole batch's new KV, then attention reads (a prefix hit may read a block
        # that another sequence of the same batch writes)
        for s in out.scheduled:
            tokens, table = self.tokens[s.seq_id], self.tables[s.seq_id]
            for p in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens):
                self.device[table[p // self.bs]][p % self.bs] = tokens[p]
        for s in out.scheduled:
            tokens, table = self.tokens[s.seq_id], self.tables[s.seq_id]
            for p in range(s.num_computed_tokens):
                assert self.device[table[p // self.bs]][p % self.bs] == tokens[p], (s.seq_id, p)


def run_step(sched, runner, rng=None):
    out = sched.schedule()
    runner.execute(out)
    sched.step_done(out)
    for s in out.scheduled:
        if s.num_samples:
            sched._live[s.seq_id].append_token(rng.randrange(50) if rng else 7)
    return out


def run_to_end(sched, runner, seqs, max_steps=200):
    """Steps until every sequence reached its max_tokens (each finished as it does)."""
    outs = []
    for _ in range(max_steps):
        outs.append(run_step(sched, runner))
        for s in seqs:
            if not s.is_finished and s.num_output_tokens >= s.params.max_tokens:
                sched.finish(s, "length")
        if all(s.is_finished for s in seqs):
            return outs
    raise AssertionError("the sequences did not finish")


def test_block_manager_swaps_out_and_back_in_without_leaks():
    bm = BlockManager(8, 4, True, num_swap_blocks=4)
    a = seq(10)
    assert bm.allocate(a, 10) == []
    a.num_computed_tokens = 10
    device = list(bm.block_table(a))
    assert bm.can_swap_out(a)
    pairs = bm.swap_out(a)
    assert [d for d, _ in pairs] == device and bm.num_used_swap_blocks == 3 and bm.num_used_blocks == 0
    assert bm.swap_usage() == 0.75
    back = bm.swap_in(a, 1)
    assert [h for h, _ in back] == [h for _, h in pairs]
    assert bm.block_table(a)[:3] == [d for _, d in back] and bm.num_used_swap_blocks == 0
    bm.free(a)
    bm.check_no_leaks()


def test_swap_out_is_refused_when_the_swap_space_is_full_and_leaks_are_caught():
    bm = BlockManager(8, 4, True, num_swap_blocks=2)
    a = seq(10)
    bm.allocate(a, 10)
    assert not bm.can_swap_out(a)  # 3 blocks, 2 host blocks
    b = seq(4, start=50)
    bm.allocate(b, 4)
    b.num_computed_tokens = 4
    bm.swap_out(b)
    bm.free(a)
    with pytest.raises(AssertionError, match="swap blocks leaked"):
        bm.check_no_leaks()
    bm.free(b)  # a finished swapped-out sequence gives its host blocks back
    bm.check_no_leaks()


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempted_sequences_resume_with_their_own_kv(mode):
    sched = make(num_blocks=6, mode=mode)
    runner = FakeRunner(6, 16, 4)
    a, b = seq(8, max_tokens=8), seq(8, start=100, max_tokens=8)
    sched.add(a)
    sched.add(b)
    run_to_end(sched, runner, [a, b])
    assert sched.num_preemptions >= 1
    if mode == "swap":
        assert sched.num_swapped_out >= 1 and sched.num_swapped_in >= 1 and sched.num_recomputed == 0
    else:
        assert sched.num_swapped_out == 0 and sched.num_recomputed >= 1
    sched.block_manager.check_no_leaks()


def test_swap_falls_back_to_recompute_when_the_swap_space_is_full():
    sched = make(num_blocks=8, num_swap_blocks=2)
    runner = FakeRunner(8, 2, 4)
    seqs = [seq(6, start=100 * i, max_tokens=14) for i in range(4)]
    for s in seqs:
        sched.add(s)
    run_to_end(sched, runner, seqs)
    assert sched.num_swapped_out >= 1 and sched.num_recomputed >= 1
    sched.block_manager.check_no_leaks()


def test_swap_copies_travel_in_the_scheduler_output():
    sched = make(num_blocks=6)
    runner = FakeRunner(6, 16, 4)
    a, b = seq(8, max_tokens=8), seq(8, start=100, max_tokens=8)
    sched.add(a)
    sched.add(b)
    outs = run_to_end(sched, runner, [a, b])
    out_pairs = [p for o in outs for p in o.blocks_to_swap_out]
    in_pairs = [p for o in outs for p in o.blocks_to_swap_in]
    assert out_pairs and in_pairs
    assert {h for _, h in out_pairs} >= {h for h, _ in in_pairs}
    # a sequence swapped in comes back whole (reset), at the position it had reached
    resumed = [s for o in outs if o.blocks_to_swap_in for s in o.scheduled if s.reset and s.num_computed_tokens]
    assert resumed


@pytest.mark.parametrize("num_swap_blocks", [3, 40])
def test_random_workload_with_aborts_keeps_kv_right_and_never_leaks(num_swap_blocks):
    rng = random.Random(num_swap_blocks)
    sched = make(num_blocks=24, num_swap_blocks=num_swap_blocks, budget=24, max_seqs=6)
    runner = FakeRunner(24, num_swap_blocks, 4)
    live = []
    for step in range(400):
        if rng.random() < 0.3 and len(live) < 12:
            s = seq(rng.randint(1, 30), start=rng.choice([0, 1000 + step]), max_tokens=rng.randint(1, 20))
            sched.add(s)
            live.append(s)
        run_step(sched, runner, rng)
        assert sched.running or not (sched.waiting or sched.swapped)  # progress is always possible
        for s in list(live):
            if s.num_output_tokens >= s.params.max_tokens or rng.random() < 0.02:
                sched.finish(s, "length")
                live.remove(s)
    for s in live:
        sched.finish(s, "abort")
    sched.schedule()
    sched.block_manager.check_no_leaks()
    assert sched.num_swapped_out > 0 and sched.num_swapped_in > 0
    if num_swap_blocks == 3:
        assert sched.num_recomputed > 0
