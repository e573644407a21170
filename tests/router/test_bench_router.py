"""`pagoda bench router`'s pure parts: the workload, the overhead histogram's median, its flags."""

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from pagoda.bench.router import PolicyResult, TurnResult, around, overhead_ms, parse_args, system_prompts

pytestmark = pytest.mark.unit


def test_overhead_median_interpolates_in_its_bucket():
    registry = CollectorRegistry()
    h = Histogram("pagoda_router:proxy_overhead_seconds", "x", buckets=(0.001, 0.002, 0.004), registry=registry)
    for value in (0.0005, 0.0015, 0.0015, 0.0015, 0.003):
        h.observe(value)
    o = overhead_ms(generate_latest(registry).decode())
    assert o["count"] == 5 and o["mean"] == pytest.approx(1.6)
    assert 1.0 < o["median"] < 2.0  # the 3rd of 5 lies in (1 ms, 2 ms]
    assert overhead_ms("") == {}


def test_system_prompts_differ_by_seed_and_lengths_vary_around_their_mean():
    prompts = system_prompts(seed=1, systems=2, system_words=10)
    assert len(set(prompts)) == 2 and system_prompts(seed=2, systems=2, system_words=10)[0] not in prompts
    # another policy (salt): the same words behind another opening, so no cached block is shared
    salted = system_prompts(seed=1, systems=2, system_words=10, salt=1)
    assert [p.split(". ", 1)[1] for p in salted] == [p.split(". ", 1)[1] for p in prompts]
    assert all(a.split(". ", 1)[0] != b.split(". ", 1)[0] for a, b in zip(salted, prompts))
    rng = random.Random(0)
    draws = [around(rng, 40) for _ in range(4000)]
    assert min(draws) == 20 and max(draws) == 60 and abs(sum(draws) / len(draws) - 40) < 1
    assert {around(rng, 1) for _ in range(10)} == {1} and around(rng, 0, low=0) == 0


def test_hit_rate_floor_and_ceiling_count_system_prompt_and_history_in_full_blocks():
    result = PolicyResult("x", system_tokens={0: 100})
    # conversation 0: turn 0 can hit its 100-token system prompt (96 in full blocks), turn 1 its 150-token
    # prompt + 20-token answer of turn 0 (160); conversation 1 has no system prompt
    result.turns = [TurnResult(0.1, 150, 96, 20, "a", 0, 0), TurnResult(0.1, 200, 160, 20, "a", 0, 1),
                    TurnResult(0.1, 50, 0, 20, "b", 1, 0)]
    s = result.summary()
    assert s["hit_rate_ceiling"] == pytest.approx((96 + 160) / 400) == s["prefix_hit_rate"]
    assert s["hit_rate_floor"] == pytest.approx((96 + 96) / 400)  # the system prompt, on both turns
    assert s["prompt_tokens_computed"] == 400 - 256


def test_bad_flags_are_usage_errors(capsys):
    for argv, message in ((["--policies", "random"], "--policies"), (["--turns", "0"], "--turns"),
                          (["--active", "0"], "--active"), (["--user-words", "-1"], "--user-words")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err
