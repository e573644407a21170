"""What the engine hands back to its callers, vLLM-compatible (cumulative, not deltas)."""

import bisect
from dataclasses import dataclass, field

from pagoda.kv_transfer.base import KVTransferStats


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely
    decoded_token: str | None = None


# One entry per generated token: candidate token id -> its Logprob (the sampled token always included).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    data_parallel_rank: int = 0  # the DP rank (engine) that served it: its request metrics' engine label


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # set when this request (alone) failed inside the engine
    # SamplingParams.prompt_logprobs: None for the first prompt token, then token id -> Logprob per token
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    embedding: list[float] | None = None  # an embedding request's pooled vector (PoolingParams)
    kv_transfer_params: dict | None = None  # P/D: a prefill's, for the decode engine (vLLM's, kv_transfer)


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """`LLM.embed`'s result, as vLLM's."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


# tokens computed in one engine step (prompt and generated), as vLLM's iteration_tokens_total buckets
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class RankStats:
    """One data-parallel rank's share (engine/data_parallel.py): what its scheduler and KV cache hold, and
    what it was given and made. /metrics publishes these under engine="<rank>"."""

    num_requests_running: int = 0  # sequences, by the rank's schedulers
    num_requests_waiting: int = 0
    num_requests_swapped: int = 0
    kv_cache_usage: float = 0.0
    num_blocks_total: int = 0
    num_blocks_used: int = 0
    num_cached_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_requests_added: int = 0  # sequences the balancer gave the rank
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_steps: int = 0
    finished_reasons: dict[str, int] = field(default_factory=dict)  # the rank's finished requests by reason


@dataclass
class EngineStats:
    """A snapshot for /metrics: gauges now, counters since start."""

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks in use by running requests
    num_blocks_total: int = 0
    num_blocks_used: int = 0
    num_cached_blocks: int = 0  # blocks the prefix cache can find (what KV events announce as stored)
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    prefix_cache_evicted_blocks: int = 0  # cached blocks evicted (taken for other tokens), a counter
    prompt_tokens: int = 0  # of the requests whose prompt is in (their first token sampled), cached ones included
    generation_tokens: int = 0
    num_preemptions: int = 0  # sequences preempted, by swap or recompute
    num_requests_swapped: int = 0  # requests whose KV is in the swap space now
    num_swap_blocks_total: int = 0  # host blocks of the swap space
    num_swap_blocks_used: int = 0
    swap_space_usage: float = 0.0  # fraction of the host blocks in use
    num_swapped_out: int = 0  # sequences swapped out (counter)
    num_swapped_in: int = 0  # sequences swapped back in (counter)
    num_recomputed: int = 0  # preemptions that dropped the KV, to recompute (swap space full or mode recompute)
    finished_reasons: dict[str, int] = field(default_factory=dict)
    # steps by tokens computed: [i] counts steps with at most ITERATION_TOKENS_BUCKETS[i] tokens (and more
    # than the bucket before), the last entry those above every bucket
    iteration_tokens_counts: list[int] = field(default_factory=lambda: [0] * (len(ITERATION_TOKENS_BUCKETS) + 1))
    iteration_tokens_sum: int = 0

    def observe_iteration(self, num_tokens: int) -> None:
        self.iteration_tokens_counts[bisect.bisect_left(ITERATION_TOKENS_BUCKETS, num_tokens)] += 1
        self.iteration_tokens_sum += num_tokens
    # speculative decoding (counters): verification steps, draft tokens proposed, accepted; accepted by position
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_accepted_per_pos: list[int] = field(default_factory=list)
    # mixtures of experts (counters): MoE layer index -> rows routed to each expert (a row per token and
    # choice); the layers of the stage that samples (every layer without pipeline parallelism)
    expert_tokens: dict[int, list[int]] = field(default_factory=dict)
    # LoRA (vLLM's lora_requests_info): device slots, and the adapters of running and of waiting requests
    max_lora: int = 0
    running_lora_adapters: list[str] = field(default_factory=list)
    waiting_lora_adapters: list[str] = field(default_factory=list)
    lora_requests: dict[str, int] = field(default_factory=dict)  # requests added, by adapter name
    # the engine's step timer (engine_core.StepTimer, counters): seconds in the executor, and the gaps
    # between one batch's result and the next batch's submit while work was waiting
    num_steps: int = 0
    step_forward_seconds: float = 0.0
    num_step_gaps: int = 0
    step_gap_seconds: float = 0.0
    kv_transfer: KVTransferStats | None = None  # P/D: the KV connector's transfers (None without one)
    # data parallelism: each rank's share, by rank (empty with one rank)
    data_parallel: list[RankStats] = field(default_factory=list)
    # the DP rank of this engine's first (or only) rank: --data-parallel-rank R's R, else 0; /metrics' engine label
    data_parallel_rank: int = 0

    def add_expert_tokens(self, step: dict[int, list[int]]) -> None:
        for layer, counts in step.items():
            total = self.expert_tokens.setdefault(layer, [0] * len(counts))
            for i, n in enumerate(counts):
                total[i] += n
