"""The server's latency histograms count every generated token once, however the cumulative outputs
bunch up behind a slow consumer (the first one included)."""

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagoda.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagoda.entrypoints.openai.metrics import ServerMetrics

pytestmark = pytest.mark.unit


def output(num_tokens: int, last_time: float, finished: bool = False) -> RequestOutput:
    metrics = RequestMetrics(arrival_time=0.0, first_scheduled_time=0.1, first_token_time=1.0,
                             last_token_time=last_time, finished_time=last_time if finished else None)
    return RequestOutput("r", "p", [1], [CompletionOutput(0, "", list(range(num_tokens)))], finished, metrics)


def samples(metrics: ServerMetrics) -> dict[str, float]:
    text = metrics.render().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.mark.parametrize("seen", [[1, 2, 3, 4, 5], [3, 5], [2, 5], [5]])
def test_every_token_after_the_first_is_one_inter_token_latency(seen):
    metrics = ServerMetrics("m", lambda: None)
    tracker = metrics.tracker()
    for n in seen:
        tracker.observe(output(n, last_time=1.0 + 0.5 * (n - 1), finished=n == 5))
    got = samples(metrics)
    assert got["pagoda:time_to_first_token_seconds_count"] == 1
    assert got["pagoda:inter_token_latency_seconds_count"] == 4
    assert got["pagoda:inter_token_latency_seconds_sum"] == pytest.approx(2.0)  # 1.0 s to 3.0 s
    assert got["pagoda:e2e_request_latency_seconds_count"] == 1


def test_inter_token_latency_is_per_sequence_with_n_choices():
    """n = 2 choices stepping together: every token of each is one interval of 0.5 s, not half of it."""
    metrics = ServerMetrics("m", lambda: None)
    tracker = metrics.tracker()
    for step in range(1, 5):
        metrics_ = RequestMetrics(arrival_time=0.0, first_scheduled_time=0.1, first_token_time=1.0,
                                  last_token_time=1.0 + 0.5 * (step - 1), finished_time=None)
        choices = [CompletionOutput(i, "", list(range(step))) for i in range(2)]
        tracker.observe(RequestOutput("r", "p", [1], choices, False, metrics_))
    got = samples(metrics)
    assert got["pagoda:inter_token_latency_seconds_count"] == 6  # 3 intervals x 2 sequences
    assert got["pagoda:inter_token_latency_seconds_sum"] == pytest.approx(3.0)
