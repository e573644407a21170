"""Prometheus metrics: vLLM's families under `pagoda:` names (`pagoda:<vLLM's name>`), same labels.

Gauges and counters are read from the engine's `EngineStats` at scrape time (a custom collector: the
engine already counts, so nothing is counted twice); per-request histograms are observed here, from each
request's timestamps and sizes, as its outputs arrive. Per-engine families (the request histograms, request
success, the scheduler's gauges) carry engine="<DP rank>", as vLLM's: "0" without data parallelism, R on a
--data-parallel-rank R server. With `vllm_names` (`--metrics-vllm-names`) every
family is published a second time under `vllm:` (and `pagoda:kv_cache_usage_perc` also as V0's
`vllm:gpu_cache_usage_perc`), so dashboards, autoscaler triggers and the Gateway API Inference Extension
written for vLLM read Pagoda unchanged.
"""

import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from pagoda.engine.outputs import ITERATION_TOKENS_BUCKETS, EngineStats, RequestOutput
from pagoda.entrypoints.openai.kv_transfer_metrics import KVTransferCollector
from pagoda.sampling_params import SamplingParams

PREFIX = "pagoda:"
VLLM_PREFIX = "vllm:"
# vLLM names a family differently from its pagoda: twin (besides the prefix): the extra names it also gets
VLLM_ALIASES = {"kv_cache_usage_perc": ("gpu_cache_usage_perc",)}
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
# why a request got a 503 at admission: the limit it met (vLLM's reasons, its flags' names)
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")


def buckets_1_2_5(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (token-count histograms, as vLLM's)."""
    out, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > limit:
                return tuple(out)
            out.append(step * scale)
        scale *= 10


class EngineStatsCollector(Collector):
    def __init__(self, get_stats: Callable[[], EngineStats | None], model_name: str,
                 cache_info: dict[str, str] | None = None, max_num_batched_tokens: int | None = None):
        self.get_stats = get_stats
        self.model_name = model_name
        self.cache_info = cache_info or {}
        self.iteration_buckets = len(ITERATION_TOKENS_BUCKETS)
        if max_num_batched_tokens is not None:  # no step computes more: drop the buckets above it
            self.iteration_buckets = sum(b <= max_num_batched_tokens for b in ITERATION_TOKENS_BUCKETS)

    def collect(self):
        stats = self.get_stats() or EngineStats()
        labels, values = ["model_name"], [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        def per_engine(kind, name: str, doc: str, field: str):
            """A series per engine (data-parallel rank), labelled engine="<rank>" as vLLM's; engine="0" alone
            without data parallelism."""
            family = kind(PREFIX + name, doc, labels=[*labels, "engine"])
            for rank, share in enumerate(stats.data_parallel or [stats], start=stats.data_parallel_rank):
                family.add_metric([*values, str(rank)], getattr(share, field))
            return family

        yield per_engine(GaugeMetricFamily, "num_requests_running", "Requests in the running batch.",
                         "num_requests_running")
        yield per_engine(GaugeMetricFamily, "num_requests_waiting", "Requests waiting to be scheduled.",
                         "num_requests_waiting")
        yield per_engine(GaugeMetricFamily, "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).",
                         "kv_cache_usage")
        yield per_engine(GaugeMetricFamily, "kv_cache_used_blocks", "KV-cache blocks held by requests.",
                         "num_blocks_used")
        yield per_engine(GaugeMetricFamily, "kv_cache_total_blocks", "KV-cache blocks in the pool.",
                         "num_blocks_total")
        yield per_engine(GaugeMetricFamily, "prefix_cache_blocks",
                         "KV-cache blocks the prefix cache can find (held or evictable).", "num_cached_blocks")
        yield per_engine(CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                         "prefix_cache_queries")
        yield per_engine(CounterMetricFamily, "prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                         "prefix_cache_hits")
        yield counter("prefix_cache_evicted_blocks", "Prefix-cache blocks evicted (taken for other tokens).",
                      stats.prefix_cache_evicted_blocks)
        yield per_engine(CounterMetricFamily, "prompt_tokens", "Prefill tokens processed.", "prompt_tokens")
        yield per_engine(CounterMetricFamily, "generation_tokens", "Tokens generated.", "generation_tokens")
        yield per_engine(CounterMetricFamily, "num_preemptions",
                         "Sequences preempted (swapped out or recomputed) for lack of KV blocks.", "num_preemptions")
        yield gauge("num_requests_swapped", "Requests whose KV blocks are in the swap space.",
                    stats.num_requests_swapped)
        yield gauge("cpu_cache_usage_perc", "Fraction of the swap space's host blocks in use (1 = full).",
                    stats.swap_space_usage)
        yield gauge("swap_space_used_blocks", "Swap-space host blocks holding swapped-out KV.",
                    stats.num_swap_blocks_used)
        yield gauge("swap_space_total_blocks", "Swap-space host blocks in the pool.", stats.num_swap_blocks_total)
        yield counter("num_swapped_out", "Sequences swapped out to the swap space.", stats.num_swapped_out)
        yield counter("num_swapped_in", "Sequences swapped back in from the swap space.", stats.num_swapped_in)
        yield counter("num_recomputed", "Preempted sequences whose KV was dropped, to be recomputed.",
                      stats.num_recomputed)
        if stats.spec_decode_accepted_per_pos:  # speculative decoding is on (k positions)
            yield counter("spec_decode_num_drafts", "Verification steps of sequences that had drafts.",
                          stats.spec_decode_num_drafts)
            yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed.", stats.spec_decode_num_draft_tokens)
            yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted by the target.",
                          stats.spec_decode_num_accepted_tokens)
            per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                          "Draft tokens accepted, by their position in the draft.",
                                          labels=["model_name", "position"])
            for position, accepted in enumerate(stats.spec_decode_accepted_per_pos):
                per_pos.add_metric([self.model_name, str(position)], accepted)
            yield per_pos
        success = CounterMetricFamily(PREFIX + "request_success", "Finished requests by finish reason.",
                                      labels=["model_name", "engine", "finished_reason"])
        for rank, share in enumerate(stats.data_parallel or [stats], start=stats.data_parallel_rank):
            for reason in sorted({"stop", "length", "abort", *share.finished_reasons}):
                success.add_metric([self.model_name, str(rank), reason], share.finished_reasons.get(reason, 0))
        yield success
        yield self._iteration_tokens(stats)
        # the engine's step timer: forward passes, and the gaps between them while work waited
        yield per_engine(CounterMetricFamily, "engine_steps", "Batches run by the executor.", "num_steps")
        yield counter("engine_forward_seconds", "Seconds in the executor (submit to result).",
                      stats.step_forward_seconds)
        yield counter("engine_step_gaps", "Gaps between a batch's result and the next submit, work waiting.",
                      stats.num_step_gaps)
        yield counter("engine_step_gap_seconds", "Seconds between a batch's result and the next submit, work "
                                                 "waiting (update, outputs, scheduling).", stats.step_gap_seconds)
        if stats.expert_tokens:  # a mixture-of-experts model: load balance per expert
            experts = CounterMetricFamily(PREFIX + "moe_expert_tokens", "Rows routed to each expert (a row per "
                                          "token and choice), by MoE layer.", labels=["model_name", "layer", "expert"])
            for layer, counts in sorted(stats.expert_tokens.items()):
                for expert, n in enumerate(counts):
                    experts.add_metric([self.model_name, str(layer), str(expert)], n)
            yield experts
        info = GaugeMetricFamily(PREFIX + "cache_config_info", "The KV cache's configuration (value 1).",
                                 labels=["model_name", *self.cache_info])
        info.add_metric([self.model_name, *self.cache_info.values()], 1.0)
        yield info
        # vLLM's labels, read by LoRA-aware routers (the Gateway API Inference Extension): max_lora 0 without LoRA
        lora = GaugeMetricFamily(PREFIX + "lora_requests_info", "Running and waiting LoRA adapters.",
                                 labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        lora.add_metric([str(stats.max_lora), ",".join(stats.running_lora_adapters),
                         ",".join(stats.waiting_lora_adapters)], time.time())  # vLLM's value: when last seen
        yield lora
        per_adapter = CounterMetricFamily(PREFIX + "lora_requests", "Requests received, by LoRA adapter.",
                                          labels=["model_name", "lora_name"])
        for name, count in sorted(stats.lora_requests.items()):
            per_adapter.add_metric([self.model_name, name], count)
        yield per_adapter

    def _iteration_tokens(self, stats: EngineStats) -> HistogramMetricFamily:
        counts = stats.iteration_tokens_counts
        kept = ITERATION_TOKENS_BUCKETS[: self.iteration_buckets]
        cumulative, buckets = 0, []
        for bound, count in zip(kept, counts):
            cumulative += count
            buckets.append((str(float(bound)), cumulative))
        buckets.append(("+Inf", sum(counts)))
        family = HistogramMetricFamily(PREFIX + "iteration_tokens_total",
                                       "Tokens computed per engine step (prompt and generated).",
                                       labels=["model_name"])
        family.add_metric([self.model_name], buckets, stats.iteration_tokens_sum)
        return family


class VllmNamesCollector(Collector):
    """Every family of `source` again, named `vllm:` (plus VLLM_ALIASES), with the same labels."""

    def __init__(self, source: CollectorRegistry):
        self.source = source

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            if not family.name.startswith(PREFIX):
                continue
            base = family.name[len(PREFIX):]
            for name in (base, *VLLM_ALIASES.get(base, ())):
                renamed = Metric(VLLM_PREFIX + name, family.documentation, family.type, family.unit)
                for sample in family.samples:
                    suffix = sample.name[len(family.name):]
                    renamed.add_sample(VLLM_PREFIX + name + suffix, sample.labels, sample.value, sample.timestamp,
                                       sample.exemplar)
                yield renamed


class ServerMetrics:
    """One registry per server, so tests (and the worker mode) can build several apps in one process."""

    def __init__(self, model_name: str, get_stats: Callable[[], EngineStats | None], *, max_model_len: int = 8192,
                 cache_info: dict[str, str] | None = None, max_num_batched_tokens: int | None = None,
                 vllm_names: bool = False, engines: Iterable[int] = (0,)):
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(get_stats, model_name, cache_info, max_num_batched_tokens))
        self.registry.register(KVTransferCollector(get_stats, model_name))  # P/D: vLLM's NIXL families
        self.vllm_registry: CollectorRegistry | None = None
        if vllm_names:
            self.vllm_registry = CollectorRegistry()
            self.vllm_registry.register(VllmNamesCollector(self.registry))

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, ["model_name", "engine"], buckets=buckets, registry=self.registry)

        self.model_name = model_name
        self.max_model_len = max_model_len
        token_buckets = buckets_1_2_5(max_model_len)
        self.families = dict(
            ttft=histogram("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS),
            itl=histogram("inter_token_latency_seconds", "Time between generated tokens.", _ITL_BUCKETS),
            e2e=histogram("e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS),
            queue=histogram("request_queue_time_seconds", "Arrival to first scheduled.", _LATENCY_BUCKETS),
            tpot=histogram("request_time_per_output_token_seconds",
                           "Per request: decode time over its output tokens after the first.", _TPOT_BUCKETS),
            prefill=histogram("request_prefill_time_seconds", "First scheduled to first token.", _LATENCY_BUCKETS),
            decode=histogram("request_decode_time_seconds", "First token to last token.", _LATENCY_BUCKETS),
            inference=histogram("request_inference_time_seconds", "First scheduled to last token.",
                                _LATENCY_BUCKETS),
            prompt_tokens=histogram("request_prompt_tokens", "Prompt tokens per finished request.", token_buckets),
            generation_tokens=histogram("request_generation_tokens",
                                        "Generated tokens per finished request (all its n outputs).", token_buckets),
            params_n=histogram("request_params_n", "The n of finished requests.", _PARAMS_N_BUCKETS),
            params_max_tokens=histogram("request_params_max_tokens", "The max_tokens of finished requests.",
                                        token_buckets))
        rejections = Counter(PREFIX + "admission_rejections",
                             "Number of admission attempts rejected by a queue limit, by reason.",
                             ["model_name", "reason"], registry=self.registry)
        # every reason exported (at zero) before its first 503, as vLLM's
        self._rejections = {reason: rejections.labels(model_name, reason) for reason in ADMISSION_REASONS}
        self._engines: dict[int, EngineHistograms] = {}
        for rank in engines:  # each engine's series exported (at zero) before its first request
            self.engine(rank)

    def engine(self, rank: int) -> "EngineHistograms":
        """The per-request histograms of engine (DP rank) `rank`."""
        if rank not in self._engines:
            self._engines[rank] = EngineHistograms(self.families, self.model_name, rank)
        return self._engines[rank]

    def admission_rejected(self, reason: str) -> None:
        """A request got a 503 at a queue limit (`reason`: one of ADMISSION_REASONS)."""
        self._rejections[reason].inc()

    def render(self) -> bytes:
        body = generate_latest(self.registry)
        if self.vllm_registry is not None:
            body += generate_latest(self.vllm_registry)
        return body

    def tracker(self, params: SamplingParams | None = None) -> "RequestTracker":
        return RequestTracker(self, params)


class EngineHistograms:
    """One engine's series of each per-request histogram (ServerMetrics.families' names)."""

    def __init__(self, families: dict[str, Histogram], model_name: str, rank: int):
        for name, family in families.items():
            setattr(self, name, family.labels(model_name, str(rank)))


class RequestTracker:
    """Follows one request's cumulative outputs and observes its latencies once each. Inter-token latency
    is per sequence: each of n choices' tokens counts the interval since that choice's previous token."""

    def __init__(self, metrics: ServerMetrics, params: SamplingParams | None = None):
        self.metrics = metrics
        self.params = params
        self.num_tokens: dict[int, int] = {}  # choice index -> tokens seen
        self.last_token_time: float | None = None
        self.done = False

    def observe(self, out: RequestOutput) -> None:
        m = out.metrics
        if m is None or self.done:
            return
        engine = self.metrics.engine(m.data_parallel_rank)
        if m.first_token_time is not None and self.last_token_time is None:
            engine.ttft.observe(max(m.first_token_time - m.arrival_time, 0.0))
            if m.first_scheduled_time is not None:
                engine.queue.observe(max(m.first_scheduled_time - m.arrival_time, 0.0))
            self.last_token_time = m.first_token_time
            # the first step's token of each choice is the TTFT's; later ones are inter-token intervals
            self.num_tokens = {c.index: min(len(c.token_ids), 1) for c in out.outputs}
        if m.last_token_time is not None and self.last_token_time is not None:
            interval = max(m.last_token_time - self.last_token_time, 0.0)
            observed = False
            for c in out.outputs:
                new = len(c.token_ids) - self.num_tokens.get(c.index, 1)
                if new <= 0:
                    continue
                # outputs may bunch up behind a slow client: spread the interval over the tokens it carried
                for _ in range(new):
                    engine.itl.observe(interval / new)
                self.num_tokens[c.index] = len(c.token_ids)
                observed = True
            if observed:
                self.last_token_time = m.last_token_time
        if out.finished:
            self.done = True
            end = m.finished_time or m.last_token_time
            if end is not None:
                engine.e2e.observe(max(end - m.arrival_time, 0.0))
            self._observe_finished(out, engine)

    def _observe_finished(self, out: RequestOutput, metrics: EngineHistograms) -> None:
        m = out.metrics
        metrics.prompt_tokens.observe(len(out.prompt_token_ids))
        metrics.generation_tokens.observe(sum(len(c.token_ids) for c in out.outputs))
        if isinstance(self.params, SamplingParams):  # not an embedding request's PoolingParams
            metrics.params_n.observe(self.params.n)
            max_tokens = self.params.max_tokens  # None: up to the context length
            metrics.params_max_tokens.observe(max_tokens if max_tokens is not None
                                              else max(self.metrics.max_model_len - len(out.prompt_token_ids), 0))
        if m.first_token_time is None or m.last_token_time is None:  # ended before its first token
            return
        decode = max(m.last_token_time - m.first_token_time, 0.0)
        metrics.decode.observe(decode)
        if m.first_scheduled_time is not None:
            metrics.prefill.observe(max(m.first_token_time - m.first_scheduled_time, 0.0))
            metrics.inference.observe(max(m.last_token_time - m.first_scheduled_time, 0.0))
        longest = max((len(c.token_ids) for c in out.outputs), default=0)
        if longest > 1:  # per sequence, as inter-token latency: the longest of the n outputs
            metrics.tpot.observe(decode / (longest - 1))
