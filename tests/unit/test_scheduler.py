import random

import pytest

from pagoda.config import SchedulerConfig
from pagoda.core.block_manager import BlockManager
from pagoda.core.scheduler import Scheduler
from pagoda.core.sequence import Sequence
from pagoda.sampling_params import SamplingParams

pytestmark = pytest.mark.unit


def make(num_blocks=64, block_size=4, budget=32, max_seqs=8, chunked=True, prefix=True):
    bm = BlockManager(num_blocks, block_size, prefix)
    return Scheduler(SchedulerConfig(max_seqs, budget, chunked, 10_000), bm)


def seq(n, start=0, req="r"):
    return Sequence(req, list(range(start, start + n)), SamplingParams(max_tokens=100))


def run_step(sched, token=7):
    """Play the runner: finish the step and sample a token for sequences that reached their end."""
    out = sched.schedule()
    sched.step_done(out)
    for s in out.scheduled:
        if s.num_samples:
            live = sched._live[s.seq_id]
            live.append_token(token)
    return out


def test_chunked_prefill_splits_long_prompts_while_decodes_continue():
    sched = make(budget=16)
    a = seq(5)
    sched.add(a)
    run_step(sched)  # a prefilled, sampled
    b = seq(40, start=100)
    sched.add(b)
    out = run_step(sched)
    by_id = {s.seq_id: s for s in out.scheduled}
    assert by_id[a.seq_id].num_new_tokens == 1  # decode first
    assert by_id[b.seq_id].num_new_tokens == 15 and by_id[b.seq_id].num_samples == 0
    assert out.num_batched_tokens == 16
    out = run_step(sched)
    assert {s.seq_id: s.num_new_tokens for s in out.scheduled} == {a.seq_id: 1, b.seq_id: 15}
    out = run_step(sched)
    assert {s.seq_id: s.num_new_tokens for s in out.scheduled} == {a.seq_id: 1, b.seq_id: 10}
    assert [s.num_samples for s in out.scheduled] == [1, 1]


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_step():
    sched = make(budget=16, chunked=False)
    a, b = seq(10), seq(10, start=50)
    sched.add(a)
    sched.add(b)
    out = run_step(sched)
    assert [s.seq_id for s in out.scheduled] == [a.seq_id]
    out = run_step(sched)
    assert {s.seq_id: s.num_new_tokens for s in out.scheduled} == {a.seq_id: 1, b.seq_id: 10}


def test_max_num_seqs_caps_the_batch():
    sched = make(max_seqs=2)
    for i in range(3):
        sched.add(seq(3, start=10 * i))
    out = run_step(sched)
    assert len(out.scheduled) == 2 and len(sched.waiting) == 1


def test_prefix_hit_skips_cached_prompt_tokens():
    sched = make(block_size=4)
    a = seq(12)
    sched.add(a)
    run_step(sched)
    b = seq(14)  # shares a's first 12 tokens: 3 full blocks cached
    sched.add(b)
    out = run_step(sched)
    sb = next(s for s in out.scheduled if s.seq_id == b.seq_id)
    assert sb.num_computed_tokens == 12 and sb.num_new_tokens == 2
    assert sched.prefix_cache_hits == 12


def test_preempts_the_newest_when_blocks_run_out_and_recomputes_later():
    sched = make(num_blocks=6, block_size=4, budget=64)
    a, b = seq(8), seq(8, start=100)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # 4 blocks used, 2 free
    for _ in range(6):
        run_step(sched)
    assert sched.num_preemptions >= 1
    assert a in sched.running and b.status.name in ("PREEMPTED", "RUNNING")
    # the preempted sequence keeps its generated tokens and is re-prefilled from scratch
    for s in [a, b]:
        sched.finish(s, "stop")
    sched.block_manager.check_no_leaks()


def test_random_workload_with_aborts_never_leaks_or_deadlocks():
    rng = random.Random(0)
    sched = make(num_blocks=24, block_size=4, budget=24, max_seqs=6)
    live = []
    for step in range(400):
        if rng.random() < 0.3 and len(live) < 12:
            s = seq(rng.randint(1, 30), start=rng.choice([0, 1000 + step]))
            s.params = SamplingParams(max_tokens=rng.randint(1, 20))
            sched.add(s)
            live.append(s)
        run_step(sched)
        # a single sequence can always make progress (checked after the step: the aborts below can empty the
        # running set, and the next step admits the waiting)
        assert sched.running or not sched.waiting
        for s in list(live):
            if s.num_output_tokens >= s.params.max_tokens or rng.random() < 0.02:
                sched.finish(s, "length")
                live.remove(s)
    for s in live:
        sched.finish(s, "abort")
    sched.schedule()
    sched.block_manager.check_no_leaks()
    assert sched.num_preemptions > 0
