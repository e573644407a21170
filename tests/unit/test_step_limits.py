"""vLLM 0.32's admission knobs (core/step_limits.py) through the real scheduler and block manager, and their
flags: --max-num-active-seqs, --max-num-scheduled-tokens, --long-prefill-token-threshold(-adaptive),
--watermark, --scheduler-reserve-full-isl, --prefill-schedule-interval, --scheduler-cls."""

import argparse

import pytest

from pagoda.config import EngineArgs, SchedulerConfig
from pagoda.config.args import InvalidParam
from pagoda.core.block_manager import BlockManager
from pagoda.core.scheduler import Scheduler
from pagoda.core.sequence import Sequence
from pagoda.entrypoints.openai.cli_args import add_serve_arguments, flagify, split_args
from pagoda.sampling_params import SamplingParams

pytestmark = pytest.mark.unit


def make(num_blocks=2048, budget=256, max_seqs=64, **limits):
    """No latency target: the budget alone sizes a step, so each test sees its knob only."""
    config = SchedulerConfig(max_seqs, budget, True, 10_000, **limits)
    return Scheduler(config, BlockManager(num_blocks, 16, False))


def seq(n, start=0, req="r", max_tokens=1000):
    return Sequence(req, list(range(start, start + n)), SamplingParams(max_tokens=max_tokens))


def run_step(sched):
    out = sched.schedule()
    sched.step_done(out)
    for s in out.scheduled:
        if s.num_samples:
            sched._live[s.seq_id].append_token(7)
    return out


def add(sched, *seqs):
    for s in seqs:
        sched.add(s)
    return seqs


def add_and(sched, *seqs):
    add(sched, *seqs)
    return sched


def test_max_num_active_seqs_bounds_the_running_not_the_runner():
    sched = make(max_seqs=64, max_num_active_seqs=2)
    add(sched, *(seq(8, start=1000 * i, req=f"p{i}") for i in range(5)))
    run_step(sched)
    assert len(sched.running) == 2 and len(sched.waiting) == 3
    for _ in range(3):
        run_step(sched)
        assert len(sched.running) == 2
    default = make(max_seqs=64)  # no knob: max_num_seqs bounds it
    add(default, *(seq(8, start=1000 * i, req=f"p{i}") for i in range(5)))
    run_step(default)
    assert len(default.running) == 5


def test_max_num_scheduled_tokens_caps_a_step_below_the_batched_tokens():
    sched = make(budget=256, max_num_scheduled_tokens=100)
    prompt, = add(sched, seq(300))
    assert [s.num_new_tokens for s in run_step(sched).scheduled] == [100]
    assert [s.num_new_tokens for s in run_step(sched).scheduled] == [100]
    assert prompt.num_computed_tokens == 200
    assert [s.num_new_tokens for s in run_step(add_and(make(budget=256), seq(300))).scheduled] == [256]


def test_the_long_prefill_threshold_spares_a_lone_request_and_its_adaptive_floor_is_the_fair_share():
    lone = make(long_prefill_token_threshold=40)
    add(lone, seq(300))
    assert [s.num_new_tokens for s in run_step(lone).scheduled] == [256]  # nobody to starve: the whole budget
    pair = make(long_prefill_token_threshold=40)
    add(pair, seq(300, req="a"), seq(300, start=5000, req="b"))
    assert [s.num_new_tokens for s in run_step(pair).scheduled] == [40, 40]
    adaptive = make(long_prefill_token_threshold=40, long_prefill_token_threshold_adaptive=True)
    add(adaptive, seq(300, req="a"), seq(300, start=5000, req="b"))
    assert [s.num_new_tokens for s in run_step(adaptive).scheduled] == [128, 128]  # 256 tokens over 2 requests
    four = make(long_prefill_token_threshold=100, long_prefill_token_threshold_adaptive=True)
    add(four, *(seq(300, start=5000 * i, req=f"p{i}") for i in range(4)))
    assert [s.num_new_tokens for s in run_step(four).scheduled] == [100, 100, 56]  # the threshold above 64


def test_reserve_full_isl_admits_a_prompt_only_if_all_of_it_fits_beside_the_running():
    def scheduler(reserve):
        # 40 blocks of 16: a running answer holds 10, so 30 stay free; the new prompt's 600 tokens need 38
        sched = make(num_blocks=40, budget=256, reserve_full_isl=reserve)
        running, = add(sched, seq(150, req="running"))
        run_step(sched)
        assert running.num_computed_tokens == 150
        add(sched, seq(600, start=9000, req="long"))
        return sched

    reserved = scheduler(True)
    out = run_step(reserved)
    assert [s.num_new_tokens for s in out.scheduled] == [1] and len(reserved.waiting) == 1  # the answer alone
    first_chunk_only = scheduler(False)
    out = run_step(first_chunk_only)
    assert sorted(s.num_new_tokens for s in out.scheduled) == [1, 255]  # as before vLLM 0.32: its first chunk
    # a prompt alone is admitted whatever it needs later: nothing else runs, so nothing is crowded out
    alone = make(num_blocks=40, budget=256, reserve_full_isl=True)
    add(alone, seq(600))
    assert [s.num_new_tokens for s in run_step(alone).scheduled] == [256]


def test_the_watermark_keeps_a_share_of_the_blocks_free_while_others_run():
    def scheduler(watermark):
        sched = make(num_blocks=100, budget=512, watermark=watermark)
        add(sched, seq(160, req="running"))  # 10 blocks
        run_step(sched)
        add(sched, seq(480, start=9000, req="new"))  # 30 blocks: 90 are free
        return sched

    assert len(run_step(scheduler(0.0)).scheduled) == 2
    held = scheduler(0.65)  # 65 blocks must stay free: 30 + 65 > 90
    assert len(run_step(held).scheduled) == 1 and len(held.waiting) == 1
    assert len(run_step(scheduler(0.55)).scheduled) == 2  # 30 + 55 <= 90
    alone = make(num_blocks=100, budget=512, watermark=0.9)
    add(alone, seq(480))
    assert len(run_step(alone).scheduled) == 1  # nobody else runs: no headroom to keep


def test_prefill_schedule_interval_lets_prompts_in_every_nth_step_while_decodes_run():
    sched = make(prefill_schedule_interval=3)
    add(sched, seq(8, req="answer"))
    run_step(sched)  # step 0: its prompt (nothing decodes yet)
    admitted_at = []
    for step in range(1, 8):
        add(sched, seq(8, start=1000 * step, req=f"p{step}"))
        out = run_step(sched)
        if any(s.num_new_tokens > 1 for s in out.scheduled):
            admitted_at.append(step)
        assert any(s.num_new_tokens == 1 for s in out.scheduled)  # the decodes move every step
    assert admitted_at == [3, 6]
    every = make()
    add(every, seq(8, req="answer"))
    run_step(every)
    add(every, seq(8, start=1000, req="p"))
    assert any(s.num_new_tokens > 1 for s in run_step(every).scheduled)


def parse(*flags):
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return split_args(parser.parse_args(list(flags)))[0]


def test_the_flags_take_vllms_names_and_defaults():
    engine = parse("--max-num-active-seqs", "8", "--max-num-scheduled-tokens", "512", "--watermark", "0.1",
                   "--no-scheduler-reserve-full-isl", "--prefill-schedule-interval", "2",
                   "--long-prefill-token-threshold-adaptive", "--disable-chunked-mm-input",
                   "--scheduler-cls", "vllm.v1.core.sched.scheduler.Scheduler")
    engine.validate()
    assert (engine.max_num_active_seqs, engine.max_num_scheduled_tokens, engine.watermark,
            engine.scheduler_reserve_full_isl, engine.prefill_schedule_interval,
            engine.long_prefill_token_threshold_adaptive) == (8, 512, 0.1, False, 2, True)
    defaults = parse()
    assert (defaults.max_num_active_seqs, defaults.max_num_scheduled_tokens, defaults.watermark,
            defaults.scheduler_reserve_full_isl, defaults.prefill_schedule_interval) == (None, None, 0.0, True, 1)


@pytest.mark.parametrize("flags, message", [
    (["--watermark", "1.0"], "--watermark must be in [0, 1)"),
    (["--max-num-active-seqs", "300"], "--max-num-active-seqs must be between 1 and --max-num-seqs (256)"),
    (["--scheduler-cls", "my_pkg.MyScheduler"], "--scheduler-cls 'my_pkg.MyScheduler' cannot run in Pagoda"),
])
def test_bad_values_are_refused_naming_the_flag(flags, message):
    with pytest.raises(InvalidParam) as error:
        parse(*flags).validate()
    assert message in flagify(str(error.value))


def test_more_scheduled_tokens_than_a_step_holds_is_refused_at_resolution():
    from pagoda.config.args import check_scheduled_tokens

    with pytest.raises(InvalidParam, match="max_num_scheduled_tokens \\(4096\\) must not exceed max_num_batched_tokens"):
        check_scheduled_tokens(4096, 2048, 8192, True)
    with pytest.raises(InvalidParam, match="without chunked prefill a prompt must fit in one step"):
        check_scheduled_tokens(1024, 8192, 8192, False)
    check_scheduled_tokens(1024, 2048, 8192, True)
    assert EngineArgs().scheduler_reserve_full_isl  # vLLM 0.32's default
