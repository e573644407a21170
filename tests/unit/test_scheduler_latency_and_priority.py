"""The scheduler's latency budget (--target-itl-ms: a step's prefill share from learnt step costs) and the
priority policy (--scheduling-policy priority), with fake step costs: no model, no clock."""

import math

import pytest

from pagoda.config import SchedulerConfig
from pagoda.core.block_manager import BlockManager
from pagoda.core.itl_tail import ItlTail
from pagoda.core.scheduler import Scheduler
from pagoda.core.sequence import Sequence
from pagoda.core.step_cost import DECODE_PRICE_RATIO, StepCostModel
from pagoda.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

FIXED_S, PER_TOKEN_S = 0.005, 0.0001  # a fake machine: 5 ms a step plus 0.1 ms a token
# the auto target's factor in these tests (the figures below are worked for it; the engine's default is
# AUTO_TARGET_FACTOR, chosen on the load matrix: tests/unit/test_schedule_sim.py)
AUTO_TARGET_FACTOR = 2.75


def fake_cost(tokens: int) -> float:
    return FIXED_S + PER_TOKEN_S * tokens


def tokens_within(seconds: float) -> int:
    """The tokens the fake machine computes in `seconds`."""
    return int((seconds - FIXED_S) / PER_TOKEN_S + 1e-6)


def make(target_itl_ms=None, policy="fcfs", budget=2048, num_blocks=512, max_seqs=16):
    config = SchedulerConfig(max_seqs, budget, True, 10_000, target_itl_ms=target_itl_ms,
                             scheduling_policy=policy)
    sched = Scheduler(config, BlockManager(num_blocks, 16, False), auto_target_factor=AUTO_TARGET_FACTOR)
    sched.itl_tail = ItlTail(share=0.0)  # no burst taken whole (test_prefill_budget.py): the target alone
    return sched


def seq(n, start=0, req="r", priority=0, arrival=0.0):
    s = Sequence(req, list(range(start, start + n)), SamplingParams(max_tokens=1000), 0, arrival)
    s.priority = priority
    return s


def run_step(sched):
    """Play the runner and the engine core: finish the step, charge its fake cost, sample where due."""
    out = sched.schedule()
    sched.step_done(out)
    sched.step_costs.observe(out.num_batched_tokens, fake_cost(out.num_batched_tokens), out.num_decodes)
    for s in out.scheduled:
        if s.num_samples:
            sched._live[s.seq_id].append_token(7)
    return out


def test_the_cost_model_learns_the_line_and_the_tokens_a_budget_holds():
    model = StepCostModel()
    assert model.prompt_tokens_within(0.02) is None  # nothing measured yet
    for tokens in (4, 200, 4, 512, 37, 4):
        model.observe(tokens, fake_cost(tokens))
    costs = model.costs()
    assert costs.fixed == pytest.approx(FIXED_S)
    assert costs.per_prompt_token == pytest.approx(PER_TOKEN_S) == pytest.approx(costs.per_decode)
    assert model.prompt_tokens_within(0.020) == 150  # (20 ms - 5 ms) / 0.1 ms
    assert model.prompt_tokens_within(0.020, num_decodes=10) == 140


def test_the_cost_model_prices_a_decode_apart_from_a_prompt_token():
    # a machine where a decode costs 4 prompt tokens (its logits, its sample, its attention): one price for both
    # would put a step of 32 decodes well under what it takes
    def cost(prompt_tokens, decodes):
        return FIXED_S + PER_TOKEN_S * prompt_tokens + 4 * PER_TOKEN_S * decodes

    model = StepCostModel()
    for prompt_tokens, decodes in ((0, 32), (2048, 0), (120, 12), (0, 8), (150, 20), (110, 28), (0, 32)):
        model.observe(prompt_tokens + decodes, cost(prompt_tokens, decodes), decodes)
    costs = model.costs()
    assert costs.fixed == pytest.approx(FIXED_S)
    assert costs.per_prompt_token == pytest.approx(PER_TOKEN_S)
    assert costs.per_decode == pytest.approx(4 * PER_TOKEN_S)
    assert model.seconds_for(32, num_decodes=32) == pytest.approx(cost(0, 32))
    assert model.seconds_for(20 + 170, num_decodes=20) == pytest.approx(0.030)  # 5 + 20 x 0.4 + 170 x 0.1 ms
    # steps that never change their mix cannot tell the prices apart: one price, the line through the totals
    model = StepCostModel()
    for prompt_tokens, decodes in ((100, 10), (200, 20), (300, 30)):
        model.observe(prompt_tokens + decodes, cost(prompt_tokens, decodes), decodes)
    costs = model.costs()
    assert costs.per_prompt_token == costs.per_decode
    assert model.seconds_for(220, num_decodes=20) == pytest.approx(cost(200, 20))


def test_a_long_prompt_is_cut_into_as_many_chunks_as_the_itl_target_needs():
    target_ms = 20.0
    sched = make(target_itl_ms=target_ms)
    decodes = [seq(8, start=1000 * i, req=f"d{i}") for i in range(4)]
    for d in decodes:
        sched.add(d)
    for _ in range(6):  # the decodes prefill and run; their steps teach the cost model (one size, then two)
        run_step(sched)
    for tokens in (300, 40):  # two more sizes seen (as a real engine's mixed steps would show)
        sched.step_costs.observe(tokens, fake_cost(tokens))
    fit = sched.step_costs.prompt_tokens_within(target_ms / 1000, num_decodes=len(decodes))
    assert fit == 146
    long_prompt = seq(1000, start=50_000, req="long")
    sched.add(long_prompt)
    chunks = []
    while not chunks or long_prompt.num_computed_tokens < long_prompt.num_prompt_tokens:
        out = run_step(sched)
        by_id = {s.seq_id: s.num_new_tokens for s in out.scheduled}
        assert all(by_id[d.seq_id] == 1 for d in decodes)  # every decode runs every step
        assert fake_cost(out.num_batched_tokens) <= target_ms / 1000 + 1e-12
        chunks.append(by_id[long_prompt.seq_id])
    assert sum(chunks) == 1000
    assert len(chunks) == math.ceil(1000 / fit)  # 146 prompt tokens a step: 7 chunks


def test_without_a_target_or_without_decodes_a_prompt_takes_the_whole_budget():
    sched = make(target_itl_ms=None, budget=512)
    sched.add(seq(1000))
    assert run_step(sched).num_batched_tokens == 512
    sched = make(target_itl_ms=20.0, budget=512)
    for tokens in (1, 100, 200, 300):
        sched.step_costs.observe(tokens, fake_cost(tokens))
    sched.add(seq(1000))  # no decode waits on this step: the prompt goes at full speed
    assert run_step(sched).num_batched_tokens == 512


def test_a_target_tighter_than_the_decodes_still_moves_prompts_a_block_a_step():
    sched = make(target_itl_ms=5.5)  # 5 tokens' worth: the 4 decodes alone nearly fill it
    for i in range(4):
        sched.add(seq(8, start=1000 * i, req=f"d{i}"))
    for tokens in (1, 100, 200, 300):
        sched.step_costs.observe(tokens, fake_cost(tokens))
    for _ in range(2):
        run_step(sched)
    long_prompt = seq(100, start=50_000, req="long")
    sched.add(long_prompt)
    out = run_step(sched)
    assert {s.seq_id: s.num_new_tokens for s in out.scheduled}[long_prompt.seq_id] == 16  # one block


def test_priority_policy_admits_lower_priority_values_first_then_by_arrival():
    sched = make(policy="priority", max_seqs=1)
    late_urgent = seq(4, req="late-urgent", priority=-1, arrival=3.0)
    early_normal = seq(4, start=100, req="early-normal", priority=0, arrival=1.0)
    early_urgent = seq(4, start=200, req="early-urgent", priority=-1, arrival=2.0)
    for s in (early_normal, late_urgent, early_urgent):
        sched.add(s)
    assert [s.request_id for s in sched.waiting] == ["early-urgent", "late-urgent", "early-normal"]
    out = run_step(sched)
    assert [s.seq_id for s in out.scheduled] == [early_urgent.seq_id]


def test_fcfs_policy_keeps_arrival_order():
    sched = make(policy="fcfs")
    first, second = seq(4, req="a"), seq(4, start=100, req="b")
    second.priority = -5  # not consulted under fcfs (the engine refuses a priority here)
    for s in (first, second):
        sched.add(s)
    assert [s.request_id for s in sched.waiting] == ["a", "b"]


def test_priority_policy_preempts_the_least_urgent_running_sequence():
    # 7 blocks of 16 tokens. The relaxed request comes first: its 48-token prompt takes 3 blocks, its first
    # decode a fourth; then the urgent one's prompt the last 3. The urgent one's first decode needs an eighth
    # block: first come, first served would preempt the newest (the urgent one itself); priority the relaxed.
    sched = make(policy="priority", num_blocks=7)
    relaxed = seq(48, start=100, req="relaxed", priority=5, arrival=1.0)
    urgent = seq(48, req="urgent", priority=0, arrival=2.0)
    sched.add(relaxed)
    run_step(sched)
    sched.add(urgent)
    run_step(sched)
    assert sched.num_preemptions == 0
    out = run_step(sched)
    assert [s.seq_id for s in out.scheduled] == [urgent.seq_id]
    assert sched.num_preemptions == 1 and relaxed not in sched.running


def test_the_auto_target_holds_newer_prompts_to_a_few_decode_steps():
    sched = make(target_itl_ms="auto")
    decodes = [seq(8, start=1000 * i, req=f"d{i}") for i in range(4)]
    for d in decodes:
        sched.add(d)
    for _ in range(3):
        run_step(sched)
    for tokens in (300, 40):
        sched.step_costs.observe(tokens, fake_cost(tokens))
    prompts = [seq(30, start=50_000 + 1000 * i, req=f"p{i}") for i in range(12)]
    for p in prompts:
        sched.add(p)
    # a step of the 4 decodes and, soon, the prompts': not measured yet, so the 4-wide steps' 5.4 ms and each
    # further decode at DECODE_PRICE_RATIO times the price per token (about 0.1 ms here)
    decode_step = sched.step_costs.decode_step_seconds(len(decodes) + len(prompts))
    assert decode_step == pytest.approx(fake_cost(4) + 12 * DECODE_PRICE_RATIO * PER_TOKEN_S, rel=0.01)
    # 2.75 x about 7.2 ms holds 146 tokens: the 4 decodes, the oldest prompt's 30 and 112 of newer ones
    out = run_step(sched)
    assert fake_cost(out.num_batched_tokens) <= AUTO_TARGET_FACTOR * decode_step + 1e-12
    assert out.num_batched_tokens == tokens_within(AUTO_TARGET_FACTOR * decode_step) == 146
    while any(p.num_computed_tokens < p.num_prompt_tokens for p in prompts):
        out = run_step(sched)
        assert fake_cost(out.num_batched_tokens) <= AUTO_TARGET_FACTOR * sched.step_costs.decode_step_seconds(
            max(out.num_decodes, len(sched.running) + len(sched.waiting))) * 1.05


def test_the_auto_target_counts_the_prompts_that_will_decode():
    # a burst: 2 decodes running, 14 prompts waiting; sized from the 2 decodes alone, 2.75 x 5.2 ms would leave
    # the prompts 91 tokens a step; counting the 16 that will decode, 2.75 x 6.6 ms leaves them 129
    sched = make(target_itl_ms="auto", max_seqs=16)
    for i in range(2):
        sched.add(seq(8, start=1000 * i, req=f"d{i}"))
    run_step(sched)
    for tokens in (300, 40):
        sched.step_costs.observe(tokens, fake_cost(tokens))
    for i in range(14):
        sched.add(seq(40, start=10_000 * (i + 1), req=f"p{i}"))
    out = run_step(sched)
    assert out.num_batched_tokens == tokens_within(AUTO_TARGET_FACTOR * fake_cost(16)) == 131


def test_the_cost_model_keeps_wide_steps_through_a_long_run_of_one_width():
    model = StepCostModel(window=8)
    model.observe(600, fake_cost(600))
    for _ in range(50):  # decode-only steps, all of one width: they alone would give no line
        model.observe(32, fake_cost(32))
    costs = model.costs()
    assert costs.fixed == pytest.approx(FIXED_S) and costs.per_prompt_token == pytest.approx(PER_TOKEN_S)
    assert model.seconds_for(32) == pytest.approx(fake_cost(32))


def test_a_decode_never_costs_less_than_a_prompt_token():
    # a burst's first steps after a quiet spell (few decodes seen, each step filled to the budget) can fit a
    # decode at next to nothing: served, a step of 32 decodes was put at 13 ms where it took 45. A decode runs
    # through the same layers as a prompt token and more: such a fit gives way to one price for both
    def cheap_decodes(prompt_tokens, decodes):
        return FIXED_S + PER_TOKEN_S * prompt_tokens + 0.1 * PER_TOKEN_S * decodes

    model = StepCostModel()
    for prompt_tokens, decodes in ((0, 4), (2048, 1), (390, 9), (121, 10), (0, 12), (134, 10)):
        model.observe(prompt_tokens + decodes, cheap_decodes(prompt_tokens, decodes), decodes)
    costs = model.costs()
    assert costs.per_decode == costs.per_prompt_token > 0


def test_a_step_of_decodes_alone_is_measured_not_extrapolated():
    model = StepCostModel()
    for prompt_tokens, decodes in ((2048, 0), (300, 4), (0, 4)):
        model.observe(prompt_tokens + decodes, fake_cost(prompt_tokens + decodes), decodes)
    # no step of about 32 decodes alone yet: the 4-wide one's, and 28 decodes at the ratio times a token's price
    assert model.decode_step_seconds(32) == pytest.approx(fake_cost(4) + 28 * DECODE_PRICE_RATIO * PER_TOKEN_S,
                                                          rel=0.01)
    for seconds in (0.0090, 0.0120, 0.0100, 0.0300):  # steps of 31-33 decodes alone (one slowed by the machine)
        model.observe(32, seconds, 32)
    model.observe(4, 0.004, 4)  # narrow steps, however many, do not count for a wide one
    assert model.decode_step_seconds(32) == pytest.approx(0.0120)  # the median of the four
    for _ in range(2):
        model.observe(4, 0.004, 4)
    assert model.decode_step_seconds(4) == pytest.approx(0.004)


def test_before_any_wide_decode_step_one_price_sizes_it_not_the_two():
    # served, a burst's first 19 steps after the warm-up's (4 decodes each): prompt tokens near
    # constant, decodes growing one a step, the machine's noise on top. The two prices put a decode at 3.3 ms
    # (it takes about 1) and a step of 32 decodes alone at 106 ms (it took 45): the budget at twice its multiple
    warm_up = (13.3, 13.2, 14.4, 13.3, 14.2, 12.8, 13.5, 15.2, 13.0, 13.1, 13.9, 13.9, 13.4, 14.1, 12.6, 13.6, 13.3,
               13.8, 13.7, 13.3, 14.0, 13.5, 12.9, 14.1, 13.6, 13.4, 13.8, 13.4, 13.2, 13.3, 13.8, 14.8, 13.9, 13.9,
               13.9, 14.2, 17.1, 13.3, 14.0, 14.9, 16.9, 13.7, 18.1, 13.3, 13.7)  # ms
    steps = [(4, 4, ms / 1000) for ms in warm_up] + [
        (256, 0, 0.178), (125, 1, 0.073), (124, 1, 0.082), (124, 1, 0.074), (124, 2, 0.076), (124, 2, 0.074),
        (124, 3, 0.077), (124, 3, 0.087), (121, 4, 0.092), (121, 4, 0.090), (121, 5, 0.090), (120, 5, 0.091),
        (120, 6, 0.089), (120, 6, 0.092), (120, 7, 0.096), (120, 7, 0.105), (119, 7, 0.092), (119, 8, 0.089),
        (119, 8, 0.093)]
    model = StepCostModel()
    for num_tokens, decodes, seconds in steps:
        model.observe(num_tokens, seconds, decodes)
    costs = model.costs()
    assert costs.per_decode > 3 * costs.per_prompt_token
    assert model.seconds_for(32, 32) > 0.1
    # the 4-wide steps' 13.7 ms + 28 decodes at 1.5 x 0.63 ms: 40 ms (a decode at a prompt token's price: 31)
    assert 0.036 < model.decode_step_seconds(32) < 0.046


def test_before_any_wide_decode_step_it_is_anchored_on_the_widest_narrower_one():
    # once the window holds only a burst's steps of 100-125 tokens, the line through them extrapolates anyhow
    # (here flat with a high fixed cost: 59 ms for 32 decodes alone, where 23-30 was read a step before); the
    # warm-up's 4-wide decode steps, kept by width, anchor it
    model = StepCostModel()
    for _ in range(5):
        model.observe(4, 0.014, 4)
    for i in range(70):
        model.observe(*((100, 0.0746, 25) if i % 2 else (125, 0.0804, 25)))
    # the steps' 87.5 prompt tokens at a price, their 21 decodes beyond the anchor's at the ratio times it
    per_token = (0.0775 - 0.014) / (87.5 + DECODE_PRICE_RATIO * 21)
    assert model.decode_step_seconds(32) == pytest.approx(0.014 + DECODE_PRICE_RATIO * per_token * 28)


def test_before_any_wide_decode_step_a_decode_is_dearer_than_a_prompt_token():
    # served (vllm bench serve, c=32, Zen 4): the warm-up's steps of 1-4 decodes alone, kept by width, then the
    # first burst's steps (a 512-token step, then ~120 prompt tokens beside a few decodes). Its first step of 32
    # decodes alone took 46.3 ms (the median of 16). A decode at a prompt token's price put it at 31-32 ms there,
    # and the burst's prompts went at 2.75x that: a quarter slower than at the budget the run then measured
    warm_up = {4: (13.1, 13.2, 13.8, 12.6, 12.6, 13.6, 13.5, 12.8), 3: (13.3, 12.5, 12.5, 17.5, 12.9, 13.4, 13.9, 13.3),
               2: (13.5, 12.1, 12.9, 11.9, 11.8, 12.1, 12.1, 12.9), 1: (11.9, 11.7, 12.0, 11.9, 12.2, 11.8, 11.7, 11.8)}
    burst = [(512, 0, 355.5), (123, 2, 89.7), (122, 2, 93.9), (122, 2, 91.9), (123, 3, 94.4), (123, 3, 91.5),
             (123, 4, 90.5), (123, 4, 90.7), (121, 5, 89.1), (121, 5, 91.9), (122, 6, 84.2), (122, 6, 92.1),
             (122, 6, 88.1), (123, 7, 88.7), (123, 7, 93.3), (124, 8, 87.6), (123, 8, 88.8), (124, 9, 85.3),
             (124, 9, 90.9), (124, 9, 86.2), (125, 10, 93.9), (125, 10, 92.7), (125, 11, 84.5), (126, 11, 89.7)]
    model = StepCostModel()
    for width, times in warm_up.items():
        for ms in times:
            model.observe(width, ms / 1000, width)
    for num_tokens, decodes, ms in burst:
        model.observe(num_tokens, ms / 1000, decodes)
        assert 0.85 * 0.0463 < model.decode_step_seconds(32) < 1.1 * 0.0463


def test_the_auto_target_is_a_multiple_of_the_measured_decode_step():
    sched = make(target_itl_ms="auto", max_seqs=18)
    decodes = [seq(8, start=1000 * i, req=f"d{i}") for i in range(16)]
    for d in decodes:
        sched.add(d)
    run_step(sched)
    for tokens in (300, 40):
        sched.step_costs.observe(tokens, fake_cost(tokens))
    for seconds in (0.010, 0.030, 0.012):  # 16 decodes alone, once slowed by the machine: the median is 12 ms
        sched.step_costs.observe(16, seconds, 16)
    assert abs(sched.step_costs.seconds_for(17, 17) - 0.012) > 0.002  # the fitted prices follow the slow one
    # 18 rows soon (the 16 and the prompts'): 2.75 x the 12 ms measured for about as many decodes alone
    expected = sched.step_costs.prompt_tokens_within(AUTO_TARGET_FACTOR * 0.012, num_decodes=16)
    short_prompt, long_prompt = seq(20, start=40_000, req="short"), seq(1000, start=50_000, req="long")
    sched.add(short_prompt)  # the oldest, whole; the newer long one gets what the target leaves
    sched.add(long_prompt)
    out = run_step(sched)
    assert {s.seq_id: s.num_new_tokens for s in out.scheduled}[long_prompt.seq_id] == expected - 20 > 100


def test_a_burst_edge_after_a_long_run_of_decode_steps_is_priced_from_the_last_prompt_steps():
    # served (vllm bench serve, c=32, Zen 4): the warm-up's 4-wide decode steps, the first burst's last wide steps
    # (about 145 prompt tokens beside 14-18 decodes), then 64 steps of 32 decodes alone as the burst decoded. The
    # line through those put every token at 0.44 ms and let the next prompts take 192 tokens beside 31 decodes
    # (197 here): the step took 173 ms against a budget of 129 (a prompt token beyond the 47 ms of decodes alone
    # took 0.66 ms). Priced from the measured decode step and the last prompt steps' own price, the first step
    # overruns by a fifth at most; what it took prices the next
    burst_edge = [(162, 14, 101.9), (161, 14, 99.7), (161, 15, 102.8), (161, 15, 102.1), (161, 16, 101.8),
                  (161, 16, 99.2), (160, 17, 101.7), (160, 18, 100.3)]
    decodes_alone = (53.0, 49.5, 46.0, 45.6, 45.9, 47.0, 46.6, 47.1)  # ms, 32 decodes each
    model = StepCostModel()
    for _ in range(64):
        model.observe(4, 0.0135, 4)
    for num_tokens, decodes, ms in burst_edge:
        model.observe(num_tokens, ms / 1000, decodes)
    for i in range(64):
        model.observe(32, decodes_alone[i % 8] / 1000, 32)
    measured, true_price = 0.0470, 0.00066
    budget = AUTO_TARGET_FACTOR * model.decode_step_seconds(32)
    assert budget == pytest.approx(AUTO_TARGET_FACTOR * measured)
    edge = model.prompt_tokens_within(budget, num_decodes=31)
    assert 32 <= edge and measured + true_price * edge <= 1.2 * budget < 173 / 1000
    model.observe(31 + edge, measured + true_price * edge, 31)
    assert model.prompt_tokens_within(budget, num_decodes=31) == pytest.approx((budget - measured) / true_price,
                                                                                abs=1)
