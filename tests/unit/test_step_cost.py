"""core/step_cost.py: a decode step priced at the context its decodes read. Steps from a fake machine whose decode
step costs fixed + per decode + per context token; no model, no clock."""

import pytest

from pagoda.core.scheduler_output import ScheduledSeq, SchedulerOutput
from pagoda.core.step_cost import DECODE_WINDOW, StepCostModel

pytestmark = pytest.mark.unit

FIXED_S, PER_DECODE_S, PER_CONTEXT_S = 0.012, 0.0003, 1.3e-6  # the Xeon's prices, about (bench.schedule_sim)


def decode_step(decodes: int, context: int) -> float:
    """A step of `decodes` decodes reading `context` KV positions in all."""
    return FIXED_S + PER_DECODE_S * decodes + PER_CONTEXT_S * context


def observe_decodes(model: StepCostModel, decodes: int, context: int, scale: float = 1.0) -> None:
    model.observe(decodes, scale * decode_step(decodes, context), decodes, context)


def test_a_context_tokens_price_is_the_fit_through_decode_steps_of_several_widths():
    model = StepCostModel()
    assert model.context_token_seconds() is None
    for decodes, mean_context in ((8, 300), (16, 60), (24, 900), (32, 48), (48, 400), (12, 1200)):
        observe_decodes(model, decodes, decodes * mean_context)
    assert model.context_token_seconds() == pytest.approx(PER_CONTEXT_S, rel=1e-6)


def test_one_width_tells_the_price_by_its_growing_contexts():
    # a closed loop's answers: 48 decodes a step, each context one longer a step
    model = StepCostModel()
    for step in range(40):
        observe_decodes(model, 48, 48 * (384 + step))
    assert model.context_token_seconds() == pytest.approx(PER_CONTEXT_S, rel=1e-6)


@pytest.mark.parametrize("case", ["context with the width", "one context", "too few"])
def test_no_price_where_the_steps_cannot_tell_it(case):
    model = StepCostModel()
    if case == "context with the width":  # every decode at the same context: width and context move together
        points = [(d, 400 * d) for d in (8, 16, 24, 32)]
    elif case == "one context":
        points = [(32, 32 * 400)] * 8
    else:
        points = [(32, 32 * 400), (32, 32 * 500)]
    for decodes, context in points:
        observe_decodes(model, decodes, context)
    assert model.context_token_seconds() is None
    if case == "one context":  # the width as measured, context or none
        assert model.decode_step_seconds(32) == pytest.approx(decode_step(32, 32 * 400))
        assert model.decode_step_seconds(32, 1000.0) == pytest.approx(decode_step(32, 32 * 400))


def test_a_width_measured_at_short_contexts_is_priced_at_the_context_asked_about():
    # short chats (32 decodes over 48-token contexts), then a load of long ones whose answers run 48 at a time: a
    # step of 32 of those is asked about before any has run
    model = StepCostModel()
    for _ in range(8):
        observe_decodes(model, 32, 32 * 48)
    for step in range(40):
        observe_decodes(model, 48, 48 * (384 + step))
    short = decode_step(32, 32 * 48)
    assert model.decode_step_seconds(32) == pytest.approx(short)  # as measured
    assert model.decode_step_seconds(32, 48.0) == pytest.approx(short)
    at_500 = model.decode_step_seconds(32, 500.0)
    assert at_500 == pytest.approx(decode_step(32, 32 * 500), rel=1e-6) and at_500 > 1.5 * short
    # and the prompt tokens a step may take beside them follow: more context, fewer prompt tokens
    for tokens, decodes in ((600, 0), (300, 32), (150, 32)):
        model.observe(tokens, decode_step(decodes, 32 * 48) + 1.5e-4 * (tokens - decodes), decodes, 32 * 48)
    assert model.prompt_tokens_within(0.1, 32, 48.0) > model.prompt_tokens_within(0.1, 32, 500.0) > 0


def test_the_price_follows_the_recent_steps():
    model = StepCostModel()
    for step in range(40):
        observe_decodes(model, 48, 48 * (384 + step))
    for step in range(DECODE_WINDOW):  # the machine's pace moves: twice the price, over the window's steps
        model.observe(24, FIXED_S + PER_DECODE_S * 24 + 2 * PER_CONTEXT_S * 24 * (100 + 10 * step), 24,
                      24 * (100 + 10 * step))
    assert model.context_token_seconds() == pytest.approx(2 * PER_CONTEXT_S, rel=1e-6)


def test_a_steps_decode_context_is_the_kv_its_decodes_read():
    def scheduled(seq_id, new, computed):
        return ScheduledSeq(seq_id=seq_id, num_new_tokens=new, num_computed_tokens=computed, new_token_ids=[],
                            block_ids_start=0, block_ids=[], num_samples=1)

    out = SchedulerOutput(scheduled=[scheduled(1, 1, 300), scheduled(2, 1, 41), scheduled(3, 256, 0),
                                     scheduled(4, 64, 512)])
    assert out.num_decodes == 2 and out.decode_context_tokens == 341  # prompt chunks read theirs once, not counted


def test_where_the_steps_cannot_tell_it_the_last_price_they_told_stays():
    # a load's end: its answers finish one a step, so width and context fall together; the price is the
    # machine's, and the next load needs it at its start
    model = StepCostModel()
    for step in range(40):
        observe_decodes(model, 48, 48 * (384 + step))
    told = model.context_token_seconds()
    for step in range(DECODE_WINDOW):  # a window of such ends, each width at one context: nothing to tell
        decodes = 47 - step % 47
        observe_decodes(model, decodes, decodes * 600, scale=2.0)
    assert model.context_fit.price() is None and model.context_token_seconds() == told


def test_a_price_the_noise_drowns_is_not_taken():
    # one decode a step over a context that grows a token a step: 1.3 us a step against the machine's 3 % (0.4 ms),
    # over 40 steps
    model = StepCostModel()
    for step in range(40):
        noise = 1 + 0.03 * (-1) ** step * ((step * 7919) % 13) / 13
        observe_decodes(model, 1, 256 + step, scale=noise)
    assert model.context_token_seconds() is None
