"""vLLM's metric families under pagoda: names, the iteration-tokens histogram from the engine's counts, and
the vllm: mirror that --metrics-vllm-names adds."""

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagoda.engine.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
from pagoda.entrypoints.openai.metrics import ServerMetrics, buckets_1_2_5
from pagoda.sampling_params import SamplingParams

pytestmark = pytest.mark.unit


def samples(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    text = metrics.render().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def finished(num_tokens: int) -> RequestOutput:
    m = RequestMetrics(arrival_time=0.0, first_scheduled_time=0.5, first_token_time=1.0,
                       last_token_time=1.0 + 0.25 * (num_tokens - 1), finished_time=2.0)
    return RequestOutput("r", "p", [1, 2, 3], [CompletionOutput(0, "", list(range(num_tokens)))], True, m)


def test_buckets_1_2_5():
    assert buckets_1_2_5(100) == (1, 2, 5, 10, 20, 50, 100)
    assert buckets_1_2_5(60) == (1, 2, 5, 10, 20, 50)


def test_per_request_histograms():
    metrics = ServerMetrics("m", lambda: None, max_model_len=100)
    metrics.tracker(SamplingParams(n=1, max_tokens=9)).observe(finished(5))
    got = {name: v for (name, labels), v in samples(metrics).items() if "le" not in dict(labels)}
    assert got["pagoda:request_prompt_tokens_sum"] == 3
    assert got["pagoda:request_generation_tokens_sum"] == 5
    assert got["pagoda:request_params_max_tokens_sum"] == 9
    assert got["pagoda:request_params_n_sum"] == 1
    assert got["pagoda:request_prefill_time_seconds_sum"] == pytest.approx(0.5)
    assert got["pagoda:request_decode_time_seconds_sum"] == pytest.approx(1.0)
    assert got["pagoda:request_inference_time_seconds_sum"] == pytest.approx(1.5)
    assert got["pagoda:request_time_per_output_token_seconds_sum"] == pytest.approx(0.25)


def test_iteration_tokens_histogram_and_vllm_names():
    stats = EngineStats(num_requests_waiting=3, kv_cache_usage=0.25)
    for tokens in (1, 7, 8, 300, 5000):
        stats.observe_iteration(tokens)
    metrics = ServerMetrics("m", lambda: stats, max_num_batched_tokens=2048, vllm_names=True,
                            cache_info={"block_size": "16"})
    got = samples(metrics)
    bucket = lambda le: got[("pagoda:iteration_tokens_total_bucket", (("le", le), ("model_name", "m")))]  # noqa: E731
    assert (bucket("1.0"), bucket("8.0"), bucket("256.0"), bucket("512.0"), bucket("2048.0"), bucket("+Inf")) == (
        1, 3, 3, 4, 4, 5)
    assert ("pagoda:iteration_tokens_total_bucket", (("le", "4096.0"), ("model_name", "m"))) not in got
    assert got[("pagoda:iteration_tokens_total_sum", (("model_name", "m"),))] == 5316
    assert got[("pagoda:cache_config_info", (("block_size", "16"), ("model_name", "m")))] == 1
    for (name, labels), value in got.items():
        if name.startswith("pagoda:") and "lora" not in name:
            assert got[("vllm:" + name.removeprefix("pagoda:"), labels)] == value
    # the series of one engine carry engine="<rank>", as vLLM's: "0" without data parallelism
    assert got[("vllm:num_requests_waiting", (("engine", "0"), ("model_name", "m")))] == 3
    assert got[("vllm:gpu_cache_usage_perc", (("engine", "0"), ("model_name", "m")))] == 0.25
    assert not any(name.startswith("vllm:") for name, _ in samples(ServerMetrics("m", lambda: stats)))


def test_moe_expert_tokens_counter_per_layer_and_expert():
    """The engine's per-expert counts (summed over steps) as pagoda:moe_expert_tokens_total{layer, expert}; a
    dense model's stats have none, so the family is absent."""
    stats = EngineStats()
    stats.add_expert_tokens({0: [3, 0, 1, 4], 2: [1, 1, 1, 1]})
    stats.add_expert_tokens({0: [1, 1, 0, 0], 2: [0, 0, 0, 8]})
    got = samples(ServerMetrics("m", lambda: stats))
    counts = {(dict(labels)["layer"], dict(labels)["expert"]): value for (name, labels), value in got.items()
              if name == "pagoda:moe_expert_tokens_total"}
    assert counts == {("0", "0"): 4, ("0", "1"): 1, ("0", "2"): 1, ("0", "3"): 4,
                      ("2", "0"): 1, ("2", "1"): 1, ("2", "2"): 1, ("2", "3"): 9}
    assert not any(name.startswith("pagoda:moe_") for name, _ in samples(ServerMetrics("m", lambda: EngineStats())))


def test_data_parallel_ranks_are_series_of_their_own():
    from pagoda.engine.outputs import RankStats

    stats = EngineStats(num_requests_waiting=5, kv_cache_usage=0.3, generation_tokens=30,
                        data_parallel=[RankStats(num_requests_waiting=2, kv_cache_usage=0.1, generation_tokens=10),
                                       RankStats(num_requests_waiting=3, kv_cache_usage=0.5, generation_tokens=20)])
    got = samples(ServerMetrics("m", lambda: stats))
    for rank, (waiting, usage, tokens) in enumerate([(2, 0.1, 10), (3, 0.5, 20)]):
        labels = (("engine", str(rank)), ("model_name", "m"))
        assert got[("pagoda:num_requests_waiting", labels)] == waiting
        assert got[("pagoda:kv_cache_usage_perc", labels)] == usage
        assert got[("pagoda:generation_tokens_total", labels)] == tokens
    assert not any(dict(labels).get("engine") == "2" for _, labels in got)


def test_request_families_carry_the_engine_that_served_each_request():
    """vLLM labels the request histograms and request_success with engine="<DP rank>": each request's series
    is its rank's; with --data-parallel-rank R the one engine is R, not 0."""
    from pagoda.engine.outputs import RankStats

    stats = EngineStats(finished_reasons={"stop": 3, "length": 1},
                        data_parallel=[RankStats(finished_reasons={"stop": 1}),
                                       RankStats(finished_reasons={"stop": 2, "length": 1})])
    metrics = ServerMetrics("m", lambda: stats, max_model_len=100, engines=range(2))
    out = finished(5)
    out.metrics.data_parallel_rank = 1
    metrics.tracker(SamplingParams(max_tokens=9)).observe(out)
    got = samples(metrics)
    count = lambda family, engine: got[(f"pagoda:{family}_count", (("engine", engine), ("model_name", "m")))]  # noqa: E731
    assert (count("e2e_request_latency_seconds", "0"), count("e2e_request_latency_seconds", "1")) == (0, 1)
    assert (count("request_prompt_tokens", "0"), count("time_to_first_token_seconds", "1")) == (0, 1)
    success = {(dict(labels)["engine"], dict(labels)["finished_reason"]): v for (name, labels), v in got.items()
               if name == "pagoda:request_success_total"}
    assert (success["0", "stop"], success["1", "stop"], success["1", "length"], success["0", "length"]) == (1, 2, 1, 0)

    external = EngineStats(num_requests_waiting=2, finished_reasons={"stop": 4}, data_parallel_rank=3)
    metrics = ServerMetrics("m", lambda: external, engines=[3])
    out = finished(2)
    out.metrics.data_parallel_rank = 3
    metrics.tracker().observe(out)
    got = samples(metrics)
    assert got[("pagoda:num_requests_waiting", (("engine", "3"), ("model_name", "m")))] == 2
    assert got[("pagoda:request_success_total", (("engine", "3"), ("finished_reason", "stop"), ("model_name", "m")))] == 4
    assert got[("pagoda:e2e_request_latency_seconds_count", (("engine", "3"), ("model_name", "m")))] == 1
    assert not any(dict(labels).get("engine") == "0" for _, labels in got)
