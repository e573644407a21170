"""`pagoda bench router`'s pure parts: the workload, the overhead histogram's median, its flags."""

import random

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagoda.bench.router import (
    PolicyResult,
    TurnResult,
    around,
    eviction_spread,
    overhead_ms,
    parse_args,
    replica_counters,
    system_prompts,
    table,
)

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
                          (["--active", "0"], "--active"), (["--user-words", "-1"], "--user-words"),
                          (["--kv-cache-memory", "0"], "--kv-cache-memory"),
                          (["--kv-cache-memory", "x"], "--kv-cache-memory"),
                          (["--kv-cache-memory", "1", "--backend", "http://a"], "--kv-cache-memory")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err


def test_kv_cache_memory_flag_and_the_replicas_counters():
    assert parse_args(["--kv-cache-memory", "0.025"]).kv_cache_memory == 0.025
    assert parse_args([]).kv_cache_memory is None
    registry = CollectorRegistry()
    Gauge("pagoda:kv_cache_total_blocks", "x", registry=registry).set(72)
    Counter("pagoda:num_preemptions", "x", registry=registry).inc(3)
    Counter("pagoda:num_recomputed", "x", registry=registry).inc(1)
    Counter("pagoda:prefix_cache_evicted_blocks", "x", registry=registry).inc(40)
    assert replica_counters(generate_latest(registry).decode()) == {"kv_blocks": 72, "preemptions": 3, "recomputed": 1,
                                                                    "evicted": 40}


def test_each_replicas_evictions_and_their_spread_are_in_the_table():
    assert eviction_spread([30, 45, 40]) == 1.5 and eviction_spread([0, 0]) is None
    assert eviction_spread([0, 5]) == float("inf") and eviction_spread([]) is None
    result = PolicyResult("precise", system_tokens={0: 100}, backends=["c", "a", "b"])
    result.turns = [TurnResult(0.1 * (i + 1), 150, 96, 20, "a", i, 0) for i in range(10)]
    result.duration = 1.0
    result.replicas = {"kv_blocks": [80, 80, 80], "preemptions": [0, 0, 0], "evicted": [30, 45, 40]}
    s = result.summary()
    assert s["ttft_ms_median"] == pytest.approx(550) and s["ttft_ms_p90"] == pytest.approx(1000)
    row = table([s]).splitlines()[1]
    assert row.startswith("precise") and "[30, 45, 40] (1.50x)" in row
    assert "TTFT p90" in table([s]).splitlines()[0]
    # every per-replica list in the replicas' order (the evictions' order), idle replicas included
    assert s["requests_per_backend"] == {"c": 0, "a": 10, "b": 0} and "[0, 10, 0]  [30, 45, 40]" in row


def test_working_set_counts_live_conversations_histories_and_the_system_prompts():
    result = PolicyResult("x", system_prompt_tokens=[20, 40])  # 2 + 3 blocks
    # conversation 0 lives from t=0 (2 blocks) to t=10 (4 blocks, its end); conversation 1 from t=5 to t=20
    result.turns = [TurnResult(0.1, 20, 0, 12, "a", 0, 0, end=0.0), TurnResult(0.1, 50, 0, 14, "a", 0, 1, end=10.0),
                    TurnResult(0.1, 60, 0, 4, "b", 1, 0, end=5.0), TurnResult(0.1, 90, 0, 6, "b", 1, 1, end=20.0)]
    w = result.working_set_blocks()
    assert w["peak"] == 5 + 2 + 4  # at t=5: conversation 0's 2 blocks + conversation 1's 4
    # 0-5: 2 blocks, 5-10: 2 + 4, 10-20: conversation 1's 4 (0 ended): (10 + 30 + 40) / 20 = 4
    assert w["mean"] == pytest.approx(5 + 4)
