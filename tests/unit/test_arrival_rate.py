"""The arrival pace `--target-itl-ms auto` grants while the requests outgrow the engine (core/arrival_rate.py), and
the prefill budget it opens beside running decodes (core/scheduler.py). Arrival times set by hand: no clock."""

import pytest

from pagoda.config import SchedulerConfig
from pagoda.core.arrival_rate import ArrivalRate
from pagoda.core.block_manager import BlockManager
from pagoda.core.itl_tail import ItlTail
from pagoda.core.scheduler import Scheduler
from pagoda.core.sequence import Sequence
from pagoda.core.step_cost import StepCostModel
from pagoda.sampling_params import SamplingParams

pytestmark = pytest.mark.unit


def test_an_open_loop_outgrowing_the_engine_counts_its_pace():
    rate = ArrivalRate(window=2.0)
    for i in range(40):  # 8 prompts of 128 tokens a second, and every one stays: the requests' number grows
        rate.note(i / 8, 128, num_requests=i + 1)
    assert rate.tokens_per_second() == pytest.approx(8 * 128, rel=0.1)


def test_a_closed_loop_counts_no_pace_however_fast_its_prompts_come_back():
    rate = ArrivalRate(window=2.0)
    for i in range(32):  # the first burst: 32 users at one instant
        rate.note(0.0, 256, num_requests=i + 1)
    assert rate.tokens_per_second() == 0.0
    for i in range(200):  # then each answer that ends brings its user's next prompt: 32 requests, never more
        rate.note(0.5 + i / 20, 256, num_requests=32)
        assert rate.tokens_per_second() == 0.0, i


def test_a_burst_straddling_the_windows_middle_is_no_pace():
    rate = ArrivalRate(window=2.0)
    for i in range(32):  # a burst over 50 ms
        rate.note(i * 0.05 / 32, 32, num_requests=i + 1)
    rate.note(1.02, 32, num_requests=32)  # a returning prompt puts the burst at the window's middle
    assert rate.tokens_per_second() == 0.0


def test_the_count_starts_afresh_when_the_engine_goes_idle():
    rate = ArrivalRate(window=2.0)
    for i in range(40):
        rate.note(i / 8, 128, num_requests=i + 1)
    rate.idle()
    assert rate.tokens_per_second() == 0.0
    for i in range(40):  # the next load's requests grow from nothing again: its highs count, not the last load's
        rate.note(100 + i / 8, 128, num_requests=i + 1)
    assert rate.tokens_per_second() > 0


def test_a_window_of_zero_counts_nothing():
    rate = ArrivalRate(window=0.0)
    for i in range(40):
        rate.note(i / 8, 128, num_requests=i + 1)
    assert rate.tokens_per_second() == 0.0


def scheduler_beside_decodes(arrival_window: float) -> Scheduler:
    """'auto' with 48 decodes of long answers running, prices learnt, the ITL tail granting no burst."""
    config = SchedulerConfig(256, 2048, True, 10_000, target_itl_ms="auto")
    sched = Scheduler(config, BlockManager(8192, 16, False), step_costs=StepCostModel(), arrival_window=arrival_window)
    sched.itl_tail = ItlTail(share=0.0)
    for tokens, decodes in ((600, 0), (40, 4), (4, 4), (300, 8), (8, 8), (48, 48), (48, 48), (150, 2), (176, 48)):
        sched.step_costs.observe(tokens, 0.005 + 0.0001 * (tokens - decodes) + 0.00015 * decodes, decodes)
    for i in range(48):
        sched.add(Sequence(f"d{i}", list(range(1000 * i, 1000 * i + 8)), SamplingParams(max_tokens=1000),
                           arrival_time=0.0))
    out = sched.schedule()
    sched.step_done(out)
    for s in out.scheduled:
        sched.get(s.seq_id).append_token(7)
    return sched


def arrive(sched: Scheduler, arrival_times: list[float]) -> None:
    """Prompts of 128 tokens arriving at those times, each step run until none waits (the pace is of prompts the
    engine has already taken in)."""
    for i, t in enumerate(arrival_times):
        sched.add(Sequence(f"p{t}-{i}", list(range(500_000 + 200 * i, 500_000 + 200 * i + 128)),
                           SamplingParams(max_tokens=128), arrival_time=t))
    while sched.waiting or any(q.num_computed_tokens < q.num_prompt_tokens for q in sched.running):
        out = sched.schedule()
        sched.step_done(out)
        for s in out.scheduled:
            if s.num_samples:
                sched.get(s.seq_id).append_token(7)


def test_prompts_arriving_while_the_requests_grow_get_the_share_their_pace_needs():
    # 48 prompts a second over 2 s, none finishing: the requests' number grows (the fake machine is fast: at 0.1 ms a
    # prompt token, that pace needs 61 % of it)
    stream = [3.0 + i / 48 for i in range(96)]
    paced, burst, off = (scheduler_beside_decodes(w) for w in (2.0, 2.0, 0.0))
    for t in stream:
        arrive(paced, [t])
        arrive(off, [t])
    arrive(burst, [stream[0]] * len(stream))  # the same prompts at one instant: a closed loop's first wave
    for sched in (paced, burst, off):  # then one more prompt waits, the same in each
        sched.add(Sequence("next", list(range(900_000, 900_128)), SamplingParams(max_tokens=128),
                           arrival_time=stream[-1] + 0.125))
    assert paced.arrivals.tokens_per_second() > 0 and burst.arrivals.tokens_per_second() == 0
    # the same queue: only the pace differs
    assert paced.prefill_budget() > burst.prefill_budget() == off.prefill_budget()
    # the pace's share of the engine at the measured price, a step of f / (1 - f) decode steps of prompts more
    share = paced.arrivals.tokens_per_second() * paced.step_costs.prompt_token_seconds()
    assert paced._arrival_seconds(1.0) == pytest.approx(share / (1 - share))
