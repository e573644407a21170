"""`pagoda bench router`'s pure parts: the workload, the overhead histogram's median, its flags."""

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from pagoda.bench.router import conversations, overhead_ms, parse_args

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


def test_conversations_share_system_prompts_and_differ_by_seed():
    convs = conversations(seed=1, n=6, systems=2, system_words=10)
    assert len({c[0]["content"] for c in convs}) == 2
    assert conversations(seed=2, n=1, systems=1, system_words=10)[0] != convs[0]


def test_bad_flags_are_usage_errors(capsys):
    for argv, message in ((["--policies", "random"], "--policies"), (["--turns", "0"], "--turns")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err
