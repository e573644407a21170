"""The prefill budget (core/scheduler.py, core/step_cost.py): first come, first served prompts under one token
budget, the whole --max-num-batched-tokens while no decode waits, a chunk bounded by --target-itl-ms while
decodes run. Fake step costs: no model, no clock."""

import pytest

from pagoda.config import SchedulerConfig
from pagoda.core.block_manager import BlockManager
from pagoda.core.itl_tail import ItlTail
from pagoda.core.scheduler import AUTO_TARGET_FACTOR as ENGINE_AUTO_TARGET_FACTOR
from pagoda.core.scheduler import MAX_QUEUE_STEPS, Scheduler
from pagoda.core.sequence import Sequence
from pagoda.core.step_cost import StepCostModel
from pagoda.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

FIXED_S, PER_PROMPT_S, PER_DECODE_S = 0.005, 0.0001, 0.00015  # a fake machine
# the auto target's factor in these tests (the figures below are worked for it; the engine's default is
# ENGINE_AUTO_TARGET_FACTOR, chosen on the load matrix: tests/unit/test_schedule_sim.py)
AUTO_TARGET_FACTOR = 2.0


def fake_cost(tokens: int, decodes: int = 0) -> float:
    return FIXED_S + PER_PROMPT_S * (tokens - decodes) + PER_DECODE_S * decodes


def make(target_itl_ms=None, budget=2048, max_seqs=64, chunked=True, num_blocks=2048, itl_tail_share=0.0,
         max_queue_steps=0):
    """A scheduler whose ITL tail grants no burst and whose queue adds nothing unless asked (itl_tail_share,
    max_queue_steps): the tests here check the target, the backlog and the queue apart."""
    config = SchedulerConfig(max_seqs, budget, chunked, 10_000, target_itl_ms=target_itl_ms)
    sched = Scheduler(config, BlockManager(num_blocks, 16, False), auto_target_factor=AUTO_TARGET_FACTOR,
                      max_queue_steps=max_queue_steps)
    sched.itl_tail = ItlTail(share=itl_tail_share)
    return sched


def seq(n, start=0, req="r", max_tokens=1000):
    return Sequence(req, list(range(start, start + n)), SamplingParams(max_tokens=max_tokens))


def run_step(sched):
    """Play the runner and the engine core: finish the step, charge its fake cost, sample where due."""
    out = sched.schedule()
    sched.step_done(out)
    sched.step_costs.observe(out.num_batched_tokens, fake_cost(out.num_batched_tokens, out.num_decodes),
                             out.num_decodes)
    for s in out.scheduled:
        if s.num_samples:
            sched._live[s.seq_id].append_token(7)
    return out


def teach(model: StepCostModel):
    """Steps of several mixes, as a real engine's first seconds show."""
    for tokens, decodes in ((600, 0), (40, 4), (4, 4), (300, 8), (8, 8), (8, 8), (8, 8), (150, 2), (4, 4),
                            (4, 4)):
        model.observe(tokens, fake_cost(tokens, decodes), decodes)


def with_decodes(sched, n):
    decodes = [seq(8, start=100_000 + 1000 * i, req=f"d{i}") for i in range(n)]
    for d in decodes:
        sched.add(d)
    run_step(sched)  # their prompts
    return decodes


@pytest.mark.parametrize("target", [30.0, "auto"])
def test_the_oldest_prompt_finishes_its_prefill_before_newer_ones_start(target):
    sched = make(target_itl_ms=target)
    teach(sched.step_costs)
    with_decodes(sched, 4)
    old = seq(1200, req="old")
    newer = [seq(40, start=10_000 * (i + 1), req=f"new{i}") for i in range(6)]
    sched.add(old)
    for s in newer:
        sched.add(s)
    finished_at = {}
    started_at = {}
    for step in range(200):
        out = run_step(sched)
        for s in out.scheduled:
            started_at.setdefault(s.seq_id, step)
        for s in [old, *newer]:
            if s.seq_id not in finished_at and s.num_computed_tokens >= s.num_prompt_tokens:
                finished_at[s.seq_id] = step
        if len(finished_at) == 7:
            break
    assert len(finished_at) == 7
    # no newer prompt takes a token of the budget while the old one still has prompt tokens to compute
    assert all(started_at[s.seq_id] >= finished_at[old.seq_id] for s in newer)
    # and they go in their order of arrival
    assert [finished_at[s.seq_id] for s in newer] == sorted(finished_at[s.seq_id] for s in newer)


def test_only_the_last_admitted_prompt_is_chunked():
    sched = make(target_itl_ms=None, budget=256)
    prompts = [seq(100, start=10_000 * i, req=f"p{i}") for i in range(4)]
    for p in prompts:
        sched.add(p)
    out = run_step(sched)
    assert [s.num_new_tokens for s in out.scheduled] == [100, 100, 56]


@pytest.mark.parametrize("target", [20.0, "auto"])
def test_with_no_decode_running_prompts_take_the_whole_max_num_batched_tokens(target):
    sched = make(target_itl_ms=target, budget=1024)
    teach(sched.step_costs)
    for i in range(8):
        sched.add(seq(300, start=10_000 * i, req=f"p{i}"))
    assert sched.prefill_budget() is None
    assert run_step(sched).num_batched_tokens == 1024


def test_a_prompt_alone_after_decodes_finish_gets_the_whole_budget_again():
    sched = make(target_itl_ms=20.0, budget=1024)
    teach(sched.step_costs)
    decodes = with_decodes(sched, 2)
    for d in decodes:
        sched.finish(d, "stop")
    sched.add(seq(3000, req="long"))
    assert run_step(sched).num_batched_tokens == 1024


@pytest.mark.parametrize("target_ms", [12.0, 20.0, 40.0])
def test_with_decodes_running_the_chunk_keeps_the_step_within_the_itl_target(target_ms):
    sched = make(target_itl_ms=target_ms)
    teach(sched.step_costs)
    decodes = with_decodes(sched, 8)
    long_prompt = seq(3000, req="long")
    sched.add(long_prompt)
    chunks = []
    while long_prompt.num_computed_tokens < long_prompt.num_prompt_tokens:
        out = run_step(sched)
        by_id = {s.seq_id: s.num_new_tokens for s in out.scheduled}
        assert all(by_id[d.seq_id] == 1 for d in decodes)  # no decode stalls
        assert fake_cost(out.num_batched_tokens, out.num_decodes) <= target_ms / 1000 + 1e-9
        chunks.append(by_id[long_prompt.seq_id])
    assert sum(chunks) == 3000
    # the chunk is what the target leaves beside the decodes, not the whole 2048
    expected = int((target_ms / 1000 - fake_cost(8, 8)) / PER_PROMPT_S + 1e-6)
    assert chunks[0] == pytest.approx(expected, abs=1) and chunks[0] < 2048


def test_the_auto_target_computes_the_oldest_prompt_whole_and_bounds_the_newer_ones():
    sched = make(target_itl_ms="auto", max_seqs=12)
    teach(sched.step_costs)
    decodes = with_decodes(sched, 8)
    for _ in range(3):
        run_step(sched)  # steps of the 8 decodes alone: measured
    sched.add(seq(3000, req="old"))
    sched.add(seq(3000, start=20_000, req="new"))
    # the oldest prompt takes all the step's tokens that the decodes leave, as vLLM's chunked prefill: the newer
    # one waits
    out = run_step(sched)
    assert out.num_batched_tokens == 2048 and out.num_decodes == len(decodes)
    assert {s.num_new_tokens for s in out.scheduled if s.num_new_tokens > 1} == {2040}
    # its last 960 tokens whole: a step past the target, so the newer prompt still waits
    step_alone = fake_cost(10, 10)  # 10 rows soon: the 8 and the two prompts'
    assert fake_cost(960 + 8, 8) > AUTO_TARGET_FACTOR * step_alone
    out = run_step(sched)
    assert out.num_batched_tokens - out.num_decodes == 960


def test_newer_prompts_join_the_oldest_within_a_multiple_of_the_decode_step():
    sched = make(target_itl_ms="auto", max_seqs=16)
    teach(sched.step_costs)
    decodes = with_decodes(sched, 8)
    for _ in range(3):
        run_step(sched)
    for i in range(6):  # short prompts: the oldest whole leaves room within the target for newer ones
        sched.add(seq(40, start=20_000 + 1000 * i, req=f"p{i}"))
    out = run_step(sched)
    step_alone = sched.step_costs.decode_step_seconds(14)  # 14 rows soon: the 8 and the 6 prompts'
    assert fake_cost(out.num_batched_tokens, len(decodes)) <= AUTO_TARGET_FACTOR * step_alone * 1.05
    assert 40 < out.num_batched_tokens - out.num_decodes < 6 * 40  # more than the oldest, less than all


def test_a_target_below_the_decodes_own_step_still_moves_a_block_a_step():
    sched = make(target_itl_ms=1.0)
    teach(sched.step_costs)
    with_decodes(sched, 8)
    long_prompt = seq(100, req="long")
    sched.add(long_prompt)
    out = run_step(sched)
    assert {s.seq_id: s.num_new_tokens for s in out.scheduled}[long_prompt.seq_id] == 16  # one block


def test_without_chunked_prefill_there_is_no_prefill_budget():
    sched = make(target_itl_ms=20.0, chunked=False)
    teach(sched.step_costs)
    with_decodes(sched, 4)
    assert sched.prefill_budget() is None


def test_the_price_of_a_prompt_token_is_learnt_online_from_the_steps():
    model = StepCostModel()
    assert model.prompt_token_seconds() is None and model.prompt_tokens_within(0.02, 4) is None
    teach(model)
    assert model.prompt_token_seconds() == pytest.approx(PER_PROMPT_S, rel=0.01)
    # the machine slows down by half: the price follows the steps it runs
    for tokens, decodes in ((200, 8), (8, 8), (120, 8), (8, 8)) * 20:
        model.observe(tokens, 1.5 * fake_cost(tokens, decodes), decodes)
    assert model.prompt_token_seconds() == pytest.approx(1.5 * PER_PROMPT_S, rel=0.02)


def test_a_run_of_decode_steps_of_one_width_prices_the_next_prompt_step_from_its_last_prompt_steps():
    # a burst's edge: many steps of one width, then the next prompts. The price per prompt token comes from
    # the last steps that carried prompt tokens beside decodes (kept apart from the window), the base from the
    # measured decode step; once that step has run, its own price sizes the next
    model = StepCostModel()
    for tokens, decodes in ((600, 0), (160, 14), (161, 15), (161, 16), (160, 17)):
        model.observe(tokens, fake_cost(tokens, decodes), decodes)
    for _ in range(200):
        model.observe(32, fake_cost(32, 32), 32)
    target = 0.030
    tokens = model.prompt_tokens_within(target, num_decodes=31)
    assert tokens > 16 and fake_cost(31 + tokens, 31) <= 1.05 * target
    model.observe(31 + tokens, fake_cost(31 + tokens, 31), 31)
    tokens = model.prompt_tokens_within(target, num_decodes=31)
    assert fake_cost(31 + tokens, 31) <= target + 1e-9


def test_the_help_of_target_itl_ms_states_the_factor_the_code_uses():
    import argparse

    from pagoda.entrypoints.openai.cli_args import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    (action,) = [a for a in parser._actions if "--target-itl-ms" in a.option_strings]
    assert f"up to {ENGINE_AUTO_TARGET_FACTOR:g}x a step of the running decodes alone" in action.help
    assert f"up to {MAX_QUEUE_STEPS:g} decode steps a step" in action.help
    assert "4x" not in action.help


@pytest.mark.parametrize("target", [None, 30.0])
def test_with_async_scheduling_the_oldest_prompt_still_finishes_first(target):
    # two steps in flight: while the old prompt's chunk runs, the next step takes its next chunk (its tokens are
    # known), not a newer prompt's first one, as vLLM's async scheduling
    config = SchedulerConfig(64, 256, True, 10_000, target_itl_ms=target, async_scheduling=True)
    sched = Scheduler(config, BlockManager(2048, 16, False))
    teach(sched.step_costs)
    old = seq(1200, req="old")
    newer = [seq(40, start=10_000 * (i + 1), req=f"new{i}") for i in range(4)]
    for s in [old, *newer]:
        sched.add(s)
    in_flight, order, positions = [], [], []
    for _ in range(100):
        out = sched.schedule()
        if out.has_work:
            in_flight.append(out)
            order += [s.seq_id for s in out.scheduled if s.num_computed_tokens < sched._live[s.seq_id].num_prompt_tokens]
            positions += [(s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled if s.seq_id == old.seq_id
                          and s.num_computed_tokens < old.num_prompt_tokens]
        if len(in_flight) == 2 or not out.has_work:
            if not in_flight:
                break
            done = in_flight.pop(0)
            sched.step_done(done)
            sched.step_costs.observe(done.num_batched_tokens, fake_cost(done.num_batched_tokens, done.num_decodes),
                                     done.num_decodes)
            for s in done.scheduled:
                if s.num_samples and s.seq_id in sched._live:
                    sched._live[s.seq_id].append_token(7)
        if all(s.num_computed_tokens >= s.num_prompt_tokens for s in [old, *newer]):
            break
    last_old = max(i for i, seq_id in enumerate(order) if seq_id == old.seq_id)
    assert all(order.index(s.seq_id) > last_old for s in newer)
    # the old prompt's chunks follow each other without a gap or an overlap
    assert [start for start, _ in positions] == [sum(n for _, n in positions[:i]) for i in range(len(positions))]
    assert sum(n for _, n in positions) == 1200 and old.num_computed_tokens >= 1200


def test_long_prefill_token_threshold_caps_each_prompt_a_step_as_vllms():
    config = SchedulerConfig(64, 256, True, 10_000, long_prefill_token_threshold=40)
    sched = Scheduler(config, BlockManager(2048, 16, False))
    prompts = [seq(100, start=10_000 * i, req=f"p{i}") for i in range(3)] + [seq(30, start=90_000, req="short")]
    for p in prompts:
        sched.add(p)
    out = run_step(sched)
    assert [s.num_new_tokens for s in out.scheduled] == [40, 40, 40, 30]  # the short one whole: under the cap
    out = run_step(sched)
    assert [s.num_new_tokens for s in out.scheduled][:3] == [40, 40, 40]
    # without chunked prefill a prompt is never cut: the threshold does not apply
    config = SchedulerConfig(64, 256, False, 10_000, long_prefill_token_threshold=40)
    sched = Scheduler(config, BlockManager(2048, 16, False))
    sched.add(seq(100))
    assert [s.num_new_tokens for s in run_step(sched).scheduled] == [100]


def test_a_bad_long_prefill_token_threshold_is_refused_by_name():
    import argparse

    from pagoda.config import EngineArgs
    from pagoda.entrypoints.openai.cli_args import add_serve_arguments, split_args
    from pagoda.errors import InvalidParam

    with pytest.raises(InvalidParam, match="long_prefill_token_threshold must be an integer >= 0"):
        EngineArgs(long_prefill_token_threshold=-1).validate()
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    engine, _ = split_args(parser.parse_args(["--long-prefill-token-threshold", "512"]))
    assert engine.long_prefill_token_threshold == 512
    with pytest.raises(SystemExit):
        parser.parse_args(["--long-prefill-token-threshold", "-5"])


def answers_about_to_end_beside_long_prompts(target):
    """4 answers with 8 tokens left, then 10 prompts of 1,500 tokens waiting."""
    sched = make(target_itl_ms=target)
    teach(sched.step_costs)
    for i in range(4):
        sched.add(seq(8, start=100_000 + 1000 * i, req=f"d{i}", max_tokens=9))
    run_step(sched)
    for i in range(10):
        sched.add(seq(1500, start=10_000 * (i + 1), req=f"p{i}"))
    return sched


def test_prompts_waiting_beside_answers_about_to_end_take_most_of_the_step():
    # the backlog rule (auto): the target alone would give the prompts a few hundred tokens a step; spread over
    # the decodes' steps left (over the factor) they take the whole --max-num-batched-tokens, as vLLM's chunked
    # prefill
    sched = answers_about_to_end_beside_long_prompts("auto")
    costs = sched.step_costs
    within_target = costs.prompt_tokens_within(AUTO_TARGET_FACTOR * costs.decode_step_seconds(14), num_decodes=4)
    assert within_target < 1024
    out = run_step(sched)
    assert out.num_batched_tokens == 2048 and out.num_decodes == 4


def test_a_target_in_milliseconds_is_a_bound_whatever_waits():
    # the user's SLO: the same backlog does not stretch the step past it
    sched = answers_about_to_end_beside_long_prompts(20.0)
    out = run_step(sched)
    assert out.num_decodes == 4
    assert fake_cost(out.num_batched_tokens, out.num_decodes) <= 0.020 + 1e-9
    assert out.num_batched_tokens - 4 == sched.step_costs.prompt_tokens_within(0.020, num_decodes=4)


@pytest.mark.parametrize("factor", [1.5, 3.0])
def test_a_relative_target_bounds_every_step_by_that_multiple_of_the_decodes_step(factor):
    # "3x": the user's SLO against this machine's own decode step, a bound like milliseconds: the oldest prompt
    # is cut too, and the backlog of long prompts beside answers about to end does not stretch the step
    sched = answers_about_to_end_beside_long_prompts(f"{factor:g}x")
    step_alone = sched.step_costs.decode_step_seconds(14)  # 14 rows soon: the 4 decodes and 10 prompts
    out = run_step(sched)
    assert out.num_decodes == 4
    assert out.num_batched_tokens - 4 == sched.step_costs.prompt_tokens_within(factor * step_alone, num_decodes=4)
    assert fake_cost(out.num_batched_tokens, 4) <= factor * step_alone + 1e-9
    assert out.num_batched_tokens - 4 < 1500  # the oldest prompt cut too
    # where "auto" would take the whole --max-num-batched-tokens
    assert run_step(answers_about_to_end_beside_long_prompts("auto")).num_batched_tokens == 2048


def test_a_relative_target_of_a_larger_multiple_gives_prompts_more_of_each_step():
    def first_chunk(target):
        sched = make(target_itl_ms=target)
        teach(sched.step_costs)
        with_decodes(sched, 8)
        sched.add(seq(3000, req="long"))
        return run_step(sched).num_batched_tokens - 8

    assert 16 <= first_chunk("1.5x") < first_chunk("3x") < first_chunk("6x") < 2040


@pytest.mark.parametrize("bad", ["0.5x", "x", "3y", "nanx", "infx", "-2x"])
def test_a_bad_relative_target_is_refused_by_name(bad, capsys):
    import argparse

    from pagoda.config import EngineArgs
    from pagoda.entrypoints.openai.cli_args import add_serve_arguments, split_args
    from pagoda.errors import InvalidParam

    with pytest.raises(InvalidParam, match="target_itl_ms must be > 0 milliseconds, a multiple >= 1"):
        EngineArgs(target_itl_ms=bad).validate()
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args([f"--target-itl-ms={bad}"])  # (the = form: "-2x" alone would read as a flag)
    assert f"argument --target-itl-ms: {bad!r} is not a target: milliseconds > 0, a multiple >= 1" \
        in capsys.readouterr().err
    engine, _ = split_args(parser.parse_args(["--target-itl-ms", "2.5x"]))
    assert engine.target_itl_ms == "2.5x"
    EngineArgs(target_itl_ms="2.5x").validate()


@pytest.mark.parametrize("answer_tokens", [8, 200, 1000])
def test_the_backlog_is_spread_over_the_decodes_steps_left(answer_tokens):
    # one 1,500-token prompt beside 4 answers: the longer the answers still run, the smaller its share
    # (never under the auto target's)
    sched = make(target_itl_ms="auto")
    teach(sched.step_costs)
    for i in range(4):
        sched.add(seq(8, start=100_000 + 1000 * i, req=f"d{i}", max_tokens=answer_tokens + 1))
    run_step(sched)  # their prompts; 1 token each sampled
    sched.add(seq(40, start=50_000, req="short"))  # the oldest prompt, whole whatever the rest
    sched.add(seq(1500, req="long"))
    costs = sched.step_costs
    steps_left = answer_tokens / AUTO_TARGET_FACTOR
    backlog = 1540 * costs.prompt_token_seconds() / steps_left
    cap = AUTO_TARGET_FACTOR * costs.decode_step_seconds(6)  # the 4 decoding and the prompts'
    seconds = max(cap, costs.decode_step_seconds(4) + backlog)
    assert sched.prefill_budget() == max(costs.prompt_tokens_within(seconds, num_decodes=4), 40)
    if answer_tokens == 1000:  # long answers: the target governs
        assert sched.prefill_budget() == costs.prompt_tokens_within(cap, num_decodes=4)
    if answer_tokens == 8:  # answers about to end: the backlog
        assert sched.prefill_budget() > costs.prompt_tokens_within(cap, num_decodes=4)


def test_an_answer_without_max_tokens_counts_as_running_to_the_model_length():
    sched = make(target_itl_ms="auto")
    teach(sched.step_costs)
    for i in range(4):
        sched.add(Sequence(f"d{i}", list(range(100_000 + 1000 * i, 100_008 + 1000 * i)),
                           SamplingParams(max_tokens=None)))
    run_step(sched)
    for i in range(3):
        sched.add(seq(1500, start=10_000 * (i + 1), req=f"p{i}"))
    cap = AUTO_TARGET_FACTOR * sched.step_costs.decode_step_seconds(7)  # the 4 decoding and the 3 prompts'
    # no backlog stretch: the oldest prompt whole, the target's tokens being fewer
    assert sched.step_costs.prompt_tokens_within(cap, num_decodes=4) < 1500
    assert sched.prefill_budget() == 1500


def test_the_oldest_prompt_is_the_one_schedule_admits_next_not_one_its_adapter_keeps_waiting():
    # max_loras 1, adapter 1 running: a prompt for adapter 2 waits, so the prompt behind it is the oldest one that
    # runs, and the step is not stretched to the waiting one's 1,500 tokens
    from pagoda.lora.request import LoRARequest

    config = SchedulerConfig(64, 2048, True, 10_000, max_loras=1, target_itl_ms="auto")
    sched = Scheduler(config, BlockManager(2048, 16, False), auto_target_factor=AUTO_TARGET_FACTOR)
    sched.itl_tail = ItlTail(share=0.0)
    teach(sched.step_costs)
    decodes = [seq(8, start=100_000 + 1000 * i, req=f"d{i}") for i in range(4)]
    for d in decodes:
        d.lora_request = LoRARequest("one", 1, "/adapters/one")
        sched.add(d)
    run_step(sched)
    blocked = seq(1500, start=20_000, req="blocked")
    blocked.lora_request = LoRARequest("two", 2, "/adapters/two")
    sched.add(blocked)
    sched.add(seq(40, start=30_000, req="base"))
    within = sched.step_costs.prompt_tokens_within(
        AUTO_TARGET_FACTOR * sched.step_costs.decode_step_seconds(6), num_decodes=4)
    assert 40 < within < 1500
    assert sched.prefill_budget() == within


def test_the_itl_tail_grants_delays_within_its_share_and_starts_afresh_when_idle():
    tail = ItlTail(share=0.01)
    assert tail.grant(8, gaps_to_come=800)  # 8 delayed of 800 gaps: within 1 %
    assert not tail.grant(8, gaps_to_come=800)  # 16 would not be: nothing spent
    assert tail.gaps_delayed == 8
    for _ in range(100):
        tail.step_done(8)  # 800 gaps given
    assert tail.grant(8, gaps_to_come=800)  # 16 of 1,600
    tail.idle()
    assert (tail.gaps_given, tail.gaps_delayed) == (0, 0)


def test_the_itl_tail_grants_a_burst_only_if_its_whole_wave_fits_and_spends_its_step():
    tail = ItlTail(share=0.01)
    assert not tail.grant(8, gaps_to_come=800, foreseen=9)  # this step's 8 would fit, the wave's 9 would not
    assert tail.gaps_delayed == 0
    assert tail.grant(8, gaps_to_come=800, foreseen=8) and tail.gaps_delayed == 8
    assert not tail.grant(8, gaps_to_come=800, foreseen=1)  # never less than the step's own gaps


def burst_beside_decodes(target_itl_ms, itl_tail_share, num_prompts=20):
    """8 decodes running, then `num_prompts` short prompts at once (20: 2,000 tokens, more than the target leaves
    them and one full step)."""
    sched = make(target_itl_ms=target_itl_ms, itl_tail_share=itl_tail_share)
    teach(sched.step_costs)
    decodes = with_decodes(sched, 8)
    for _ in range(3):
        run_step(sched)  # steps of the 8 decodes alone: measured
    burst = [seq(100, start=20_000 + 1000 * i, req=f"p{i}") for i in range(num_prompts)]
    for p in burst:
        sched.add(p)
    return sched, decodes, burst


def test_a_burst_beside_decodes_is_taken_whole_while_the_itl_tail_allows_it():
    bounded, _, _ = burst_beside_decodes("auto", itl_tail_share=0.0)
    out = run_step(bounded)
    assert out.num_batched_tokens - out.num_decodes < 2000  # the target's share: the burst over several steps
    whole, decodes, burst = burst_beside_decodes("auto", itl_tail_share=1.0)
    out = run_step(whole)
    # prefill-first's step beside the decodes: every prompt of the burst whole, each decode delayed once
    assert out.num_decodes == len(decodes) and out.num_batched_tokens == 2000 + len(decodes)
    assert all(p.num_computed_tokens == 100 for p in burst)
    assert whole.itl_tail.gaps_delayed == len(decodes)
    out = run_step(whole)  # no prompt waits: a step of decodes, nothing spent
    assert out.num_batched_tokens == out.num_decodes and whole.itl_tail.gaps_delayed == len(decodes)


def test_a_burst_is_taken_whole_only_if_every_step_of_its_wave_fits_the_itl_tail():
    # 40 prompts (4,000 tokens): two full steps. Foreseen: the 8 decodes' gaps in each, 16, where the first step
    # alone delays 8
    def share_for(sched, gaps):
        return gaps / (sched.itl_tail.gaps_given + sched._tokens_to_come())

    refused, _, _ = burst_beside_decodes("auto", itl_tail_share=0.0, num_prompts=40)
    refused.itl_tail.share = share_for(refused, 15.5)
    out = run_step(refused)
    assert out.num_batched_tokens - out.num_decodes < 2048 and refused.itl_tail.gaps_delayed == 0
    granted, decodes, _ = burst_beside_decodes("auto", itl_tail_share=0.0, num_prompts=40)
    granted.itl_tail.share = share_for(granted, 16.5)
    out = run_step(granted)
    assert out.num_batched_tokens == 2048 and granted.itl_tail.gaps_delayed == len(decodes)


def test_only_the_auto_target_takes_a_burst_whole_and_only_past_its_budget():
    # a target in milliseconds is the user's bound: never stretched
    sched, _, _ = burst_beside_decodes(30.0, itl_tail_share=1.0)
    out = run_step(sched)
    assert fake_cost(out.num_batched_tokens, out.num_decodes) <= 0.030 + 1e-9 and sched.itl_tail.gaps_delayed == 0
    # one short prompt fits the target's budget: the step is not stretched, nothing spent
    sched = make(target_itl_ms="auto", itl_tail_share=1.0)
    teach(sched.step_costs)
    with_decodes(sched, 8)
    run_step(sched)
    sched.add(seq(40, start=50_000, req="short"))
    out = run_step(sched)
    assert out.num_batched_tokens == 40 + 8 and sched.itl_tail.gaps_delayed == 0


def test_the_itl_tail_account_starts_afresh_when_the_last_sequence_finishes():
    sched, decodes, burst = burst_beside_decodes("auto", itl_tail_share=1.0)
    run_step(sched)
    assert sched.itl_tail.gaps_given > 0 and sched.itl_tail.gaps_delayed > 0
    for q in [*decodes, *burst][:-1]:
        sched.finish(q, "stop")
    assert sched.itl_tail.gaps_delayed > 0  # one sequence left: the load goes on
    sched.finish(burst[-1], "stop")
    assert (sched.itl_tail.gaps_given, sched.itl_tail.gaps_delayed) == (0, 0)


def queue_beside_long_answers(num_prompts, max_queue_steps, target="auto"):
    """8 answers with ~1,000 tokens to go (no backlog stretch), then num_prompts prompts of 64 tokens waiting."""
    sched = make(target_itl_ms=target, max_seqs=64, max_queue_steps=max_queue_steps)
    teach(sched.step_costs)
    with_decodes(sched, 8)
    for _ in range(3):
        run_step(sched)  # steps of the 8 decodes alone: measured
    for i in range(num_prompts):
        sched.add(seq(64, start=20_000 + 1000 * i, req=f"p{i}"))
    return sched


@pytest.mark.parametrize("num_prompts, steps", [(24, 3.0), (40, 6.0)])
def test_a_queue_takes_the_share_of_the_step_its_tokens_are_of_a_full_batch(num_prompts, steps):
    # 24 x 64 = 1,536 waiting tokens of a 2,048 batch: prompts get 3/4 of the engine's time, 3 decode steps of
    # prompts a step; 40 x 64 = 2,560, more than a batch: the cap's 6
    sched = queue_beside_long_answers(num_prompts, max_queue_steps=6)
    costs = sched.step_costs
    decode_step = costs.decode_step_seconds(8)
    target = AUTO_TARGET_FACTOR * costs.decode_step_seconds(8 + num_prompts)  # what the target alone leaves
    assert sched.prefill_budget() == costs.prompt_tokens_within(decode_step * (1 + steps), num_decodes=8)
    assert sched.prefill_budget() > costs.prompt_tokens_within(target, num_decodes=8)
    out = run_step(sched)
    assert out.num_decodes == 8  # the decodes keep their token every step
    assert fake_cost(out.num_batched_tokens, 8) <= decode_step * (1 + steps) * 1.05


def test_a_few_prompts_beside_many_decodes_are_left_to_the_target():
    # 2 x 64 waiting tokens: a sixteenth of a batch, well within what the target leaves
    with_queue = queue_beside_long_answers(2, max_queue_steps=6).prefill_budget()
    assert with_queue == queue_beside_long_answers(2, max_queue_steps=0).prefill_budget()


@pytest.mark.parametrize("target", [20.0, "3x"])
def test_a_target_the_user_states_is_a_bound_whatever_queues(target):
    # the queue rule is auto's: a user's SLO in milliseconds or as a multiple bounds the step as before
    assert (queue_beside_long_answers(40, 6, target).prefill_budget()
            == queue_beside_long_answers(40, 0, target).prefill_budget())
