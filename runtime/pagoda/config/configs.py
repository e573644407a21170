"""The validated configs built once from EngineArgs (pagoda.config.resolve) and never changed after."""

import math
from dataclasses import dataclass

from pagoda.config.quantization import QuantizationConfig
from pagoda.errors import InvalidParam

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # LLM() and `pagoda serve` with no model
DEFAULT_CPU_KV_CACHE_GIB = 2.0
DEFAULT_GPU_SWAP_SPACE_GIB = 4.0  # as vLLM
# on a CPU the "host" pool shares RAM with the KV cache itself: a quarter of the default cache's size
DEFAULT_CPU_SWAP_SPACE_GIB = 0.5


def kv_block_bytes(block_size: int, num_kv_heads: int, head_size: int, itemsize: int, num_layers: int,
                   planes: int = 2) -> int:
    """Bytes one KV block takes over num_layers layers: a key and a value (planes=2) per token, head and layer;
    MLA's latent cache is one plane of one "head" kv_lora_rank + qk_rope_head_dim wide."""
    return planes * block_size * num_kv_heads * head_size * itemsize * num_layers


@dataclass(frozen=True)
class ModelConfig:
    path: str
    tokenizer_path: str
    served_model_name: str
    hf_config: object  # transformers.PretrainedConfig
    dtype: str  # resolved: float32 | float16 | bfloat16
    max_model_len: int
    quantization: QuantizationConfig | None = None
    trust_remote_code: bool = False
    generation_config: str = "auto"  # where default sampling parameters come from (EngineArgs)
    dtype_reason: str = ""  # why this dtype (resolve.choose_dtype)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    enable_prefix_caching: bool
    gpu_memory_utilization: float
    kv_cache_memory_gib: float | None
    swap_space_gib: float = 0.0  # host memory per worker for swapped-out blocks
    num_swap_blocks: int = 0  # host blocks in that space (counted for the largest pipeline stage)
    preemption_mode: str = "recompute"
    cache_dtype: str = "auto"  # kv_cache_dtype: auto | fp8 | fp8_e4m3 | fp8_e5m2
    calculate_kv_scales: bool = False
    disable_hybrid_kv_cache_manager: bool = False  # windowed layers keep full-length KV too


AUTO_TARGET = "auto"  # target_itl_ms relative to the running decodes' own step time


def relative_itl_target(target) -> float | None:
    """A target_itl_ms given as a multiple of a step of the running decodes alone ("3x": every step within 3 times
    it): the multiple, >= 1; None for milliseconds, "auto" or no target. Raises ValueError for another string."""
    if not isinstance(target, str) or target == AUTO_TARGET:
        return None
    try:
        factor = float(target[:-1]) if target.endswith("x") else math.nan
    except ValueError:
        factor = math.nan
    if not 1 <= factor < math.inf:
        raise ValueError(f"{target!r} is not a multiple of the decodes' step >= 1 (such as '3x')")
    return factor


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    max_model_len: int
    preemption_mode: str = "recompute"
    max_loras: int | None = None  # LoRA: the distinct adapters running sequences may use at once
    # a step's prefill share is sized so running decodes keep this inter-token latency (None: no cap; AUTO_TARGET:
    # a multiple of what the decodes' own step costs, core/scheduler.py; "3x": a bound at 3 times that step)
    target_itl_ms: float | str | None = None
    scheduling_policy: str = "fcfs"  # "fcfs" | "priority" (lower `priority` first, then arrival), as vLLM's
    long_prefill_token_threshold: int = 0  # a prompt's tokens a step at most, with chunked prefill (0: no cap)
    # schedule step N+1 while step N runs, decodes on the token N will sample (core/scheduler.py); resolved
    # on only where it applies: one process (TP = PP = 1), no speculative decoding
    async_scheduling: bool = False
    # vLLM 0.32's admission knobs (core/step_limits.py applies them; their flags in docs/server.md)
    max_num_active_seqs: int | None = None  # None: max_num_seqs
    max_num_scheduled_tokens: int | None = None  # None: max_num_batched_tokens
    long_prefill_token_threshold_adaptive: bool = False
    watermark: float = 0.0
    reserve_full_isl: bool = True
    prefill_schedule_interval: int = 1


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str = "uni"
    pp_layer_partition: list[int] | None = None
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    distributed_timeout: float = 300.0
    pipeline_fill: bool = True  # keep up to pipeline_parallel_size batches in flight
    enable_expert_parallel: bool = False
    data_parallel_size: int = 1  # engines, each over its own TP group; the ranks are DP-major
    data_parallel_size_local: int = 0  # DP ranks on this node (0: all of them); fewer: DP over many nodes
    data_parallel_start_rank: int = 0  # the first DP rank this node runs (a --headless node: > 0)
    # --data-parallel-rank R (external load balancing): this engine is DP rank R alone (data_parallel_size 1
    # here): its KV events' data_parallel_rank and endpoint offset, its metrics' engine label
    data_parallel_rank: int = 0

    @property
    def world_size(self) -> int:
        return self.data_parallel_size * self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters: max_loras device slots (the distinct adapters one step may hold), adapters up to
    max_lora_rank, and up to max_cpu_loras host copies kept for reloading (LRU)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1


SPECULATIVE_METHODS = ("ngram", "draft_model")
_SPECULATIVE_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")
DEFAULT_PROMPT_LOOKUP_MAX = 5
DEFAULT_PROMPT_LOOKUP_MIN = 1


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: each step a sequence proposes up to num_speculative_tokens draft tokens that
    the target model verifies in one forward pass."""

    method: str  # "ngram" (prompt lookup) | "draft_model"
    num_speculative_tokens: int
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP_MAX  # ngram: longest suffix looked up
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP_MIN  # ngram: shortest suffix looked up
    model: str | None = None  # draft_model: the draft checkpoint (a local path once resolved)

    @classmethod
    def from_dict(cls, raw) -> "SpeculativeConfig":
        """vLLM's speculative_config dict -> the config; InvalidParam("speculative_config") naming the key."""
        def bad(message: str) -> InvalidParam:
            return InvalidParam("speculative_config", f"speculative_config: {message}")

        if not isinstance(raw, dict):
            raise bad(f"must be a JSON object / dict; got {raw!r}")
        unknown = sorted(set(raw) - set(_SPECULATIVE_KEYS))
        if unknown:
            raise bad(f"unknown key {unknown[0]!r}; the keys are {', '.join(_SPECULATIVE_KEYS)}")
        model = raw.get("model")
        method = raw.get("method") or ("draft_model" if model is not None else None)
        if method is None:
            raise bad('give "method": "ngram" or a draft "model"')
        if method not in SPECULATIVE_METHODS:
            raise bad(f"method {method!r} is not supported; use one of {', '.join(SPECULATIVE_METHODS)}")
        if method == "draft_model" and not (isinstance(model, str) and model):
            raise bad('method "draft_model" needs "model": the draft checkpoint\'s path or Hub id')
        if method == "ngram" and model is not None:
            raise bad('method "ngram" takes no "model"')
        k = raw.get("num_speculative_tokens")
        if not _is_int(k) or k < 1:
            raise bad(f"num_speculative_tokens must be an integer >= 1; got {k!r}")
        lookup = {}
        for key in ("prompt_lookup_max", "prompt_lookup_min"):
            value = raw.get(key)
            if value is None:
                continue
            if method != "ngram":
                raise bad(f"{key} applies to method \"ngram\" only")
            if not _is_int(value) or value < 1:
                raise bad(f"{key} must be an integer >= 1; got {value!r}")
            lookup[key] = value
        hi = lookup.get("prompt_lookup_max", max(DEFAULT_PROMPT_LOOKUP_MAX, lookup.get("prompt_lookup_min", 0)))
        lo = lookup.get("prompt_lookup_min", min(DEFAULT_PROMPT_LOOKUP_MIN, hi))
        if lo > hi:
            raise bad(f"prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
        return cls(method=method, num_speculative_tokens=k, prompt_lookup_max=hi, prompt_lookup_min=lo,
                   model=model)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class EngineConfig:
    """Built once from EngineArgs, validated, never changed after (a part that needs another value, such as
    a free port, makes a changed copy with dataclasses.replace)."""

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: str
    attention_backend: str
    seed: int
    log_stats: bool = False  # the periodic stats log line
    stats_log_interval: float = 5.0
    speculative: SpeculativeConfig | None = None
    draft_model: ModelConfig | None = None  # speculative method draft_model: the draft checkpoint
    lora: LoRAConfig | None = None  # enable_lora
    kv_events: object = None  # a core.kv_events.KVEventsConfig that publishes, or None
    kv_transfer: object = None  # P/D disaggregation: a config.kv_transfer.KVTransferConfig, or None
    # decode batch sizes captured as CUDA graphs (worker/cuda_graphs.py), ascending; () = every step eager
    cudagraph_capture_sizes: tuple[int, ...] = ()
