"""Async scheduling in the scheduler alone (no model): a sequence whose in-flight step samples its one next
token is scheduled again at once, on a placeholder; the bookkeeping of two steps in flight; who waits."""

import pytest

from pagoda.config import SchedulerConfig
from pagoda.core.block_manager import BlockManager
from pagoda.core.scheduler import Scheduler
from pagoda.core.sequence import Sequence
from pagoda.sampling_params import SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.unit


def make(num_blocks=64, block_size=4, budget=64, max_seqs=8):
    config = SchedulerConfig(max_seqs, budget, True, 10_000, async_scheduling=True)
    return Scheduler(config, BlockManager(num_blocks, block_size, True))


def seq(length, start=0, req="r", **params):
    return Sequence(req, list(range(start, start + length)), SamplingParams(**{"max_tokens": 100, **params}))


def finish_step(sched, out, token=7):
    """Play the runner and the engine for the oldest step in flight: its KV computed, a token per sample."""
    sched.step_done(out)
    for s in out.scheduled:
        if s.num_samples:
            sched._live[s.seq_id].append_token(token)


def test_a_decode_goes_ahead_on_its_placeholder_and_the_runner_is_sent_each_token_once():
    sched = make()
    a = seq(6)
    sched.add(a)
    first = sched.schedule()  # the prompt, which samples the first token
    second = sched.schedule()  # while it runs: a's next decode, on the token it will sample
    (ahead,) = second.scheduled
    assert ahead.placeholder and ahead.num_new_tokens == 1 and ahead.num_computed_tokens == 6
    assert ahead.new_token_ids == [] and sched.steps_in_flight[a.seq_id] == 2
    assert sched.schedule().is_empty  # two steps ahead: never
    finish_step(sched, first, token=50)
    assert a.num_computed_tokens == 6 and a.seq_id in sched.in_flight  # the second step still runs
    third = sched.schedule()  # a third step, on the token the second samples
    assert third.scheduled[0].placeholder and third.scheduled[0].num_computed_tokens == 7
    finish_step(sched, second, token=51)
    finish_step(sched, third, token=52)
    assert a.token_ids[6:] == [50, 51, 52] and a.num_computed_tokens == 8 and a.seq_id not in sched.in_flight
    # out of flight, it is scheduled as before: the runner holds every token but the last sample, which it
    # is sent now (it appended the placeholders' tokens itself)
    (plain,) = sched.schedule().scheduled
    assert not plain.placeholder and plain.new_token_ids == [52] and plain.num_computed_tokens == 8
    # every slot the three steps wrote is a's: positions 0..8 fit its blocks
    assert len(sched.block_manager.block_table(a)) * 4 >= 9


@pytest.mark.parametrize("params", [
    {"max_tokens": 1},  # the in-flight token is its last: nothing after it
    {"n": 2},  # its prompt's end forks: two tokens, not one
    {"structured_outputs": StructuredOutputsParams(choice=["yes", "no"])},  # the grammar needs the token
], ids=["last-token", "forks", "grammar"])
def test_who_waits_for_its_token(params):
    sched = make()
    sched.add(seq(5, **params))
    sched.schedule()
    assert sched.schedule().is_empty


def test_going_ahead_never_preempts_and_waits_for_a_block():
    sched = make(num_blocks=2, block_size=4)  # 8 slots: the prompt's 8 tokens fill them
    a = seq(8)
    sched.add(a)
    first = sched.schedule()
    assert sched.schedule().is_empty  # position 8 needs a third block: it waits, a stays running
    assert sched.num_preemptions == 0 and a in sched.running
    finish_step(sched, first)
    assert a.seq_id not in sched.in_flight


def test_a_prompt_in_chunks_goes_ahead_chunk_after_chunk_then_decodes_from_its_last():
    # as vLLM's async scheduling: the prompt's next chunk is scheduled while the one before runs (its tokens
    # are known), so the oldest prompt keeps the budget; a decode goes ahead only on its last chunk's sample
    sched = make(budget=4)
    a = seq(10)
    sched.add(a)
    first = sched.schedule()  # tokens 0-3: a chunk, no sample
    second = sched.schedule()  # 4-7, while 0-3 run
    (chunk,) = second.scheduled
    assert chunk.num_computed_tokens == 4 and chunk.num_new_tokens == 4 and chunk.num_samples == 0
    assert not chunk.placeholder and chunk.new_token_ids == []
    assert sched.schedule().is_empty  # two steps in flight: never a third
    finish_step(sched, first)
    third = sched.schedule()
    (last,) = third.scheduled  # 8-9, the prompt's end: it samples
    assert last.num_computed_tokens == 8 and last.num_new_tokens == 2 and last.num_samples == 1
    finish_step(sched, second)
    (ahead,) = sched.schedule().scheduled  # the first decode, on the token the last chunk samples
    assert ahead.placeholder and ahead.num_computed_tokens == 10
    finish_step(sched, third, token=40)
    assert a.num_computed_tokens == 10 and a.token_ids[10:] == [40]
