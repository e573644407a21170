"""Engine configuration: the user's arguments (EngineArgs) and the validated configs built from them."""

import dataclasses
import logging
import os
from dataclasses import dataclass, field

from pagoda.default_model import DEFAULT_MODEL_NAME
from pagoda.distributed.ray_cluster import RAY_INSTALL_HINT, ray_backend_wanted, ray_installed
from pagoda.errors import InvalidParam
from pagoda.layers.quantization.config import (
    QuantizationConfig,
    check_quantization_args,
    resolve_quantization,
)

logger = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "float16", "bfloat16")
DEFAULT_CPU_KV_CACHE_GIB = 2.0
DEFAULT_GPU_SWAP_SPACE_GIB = 4.0  # as vLLM
# on a CPU the "host" pool shares RAM with the KV cache itself: a quarter of the default cache's size
DEFAULT_CPU_SWAP_SPACE_GIB = 0.5
PREEMPTION_MODES = ("swap", "recompute")
KV_CACHE_DTYPES = ("auto",)
LOAD_FORMATS = ("auto", "safetensors")
EXECUTOR_BACKENDS = ("uni", "mp", "ray")

# vLLM engine arguments Pagoda does not implement yet: refused by name unless left at vLLM's default.
UNSUPPORTED_ARGS = {
    "enable_lora": False,
    "max_loras": 1,
    "max_lora_rank": 16,
    "max_cpu_loras": None,
    "cpu_offload_gb": 0.0,
    "num_scheduler_steps": 1,
    "data_parallel_size": 1,
    "enable_sleep_mode": False,
}


def check_generation_config_arg(value) -> None:
    if value in ("auto", "vllm"):
        return
    if not isinstance(value, str) or not os.path.isfile(os.path.join(value, "generation_config.json")):
        raise InvalidParam("generation_config", f"generation_config must be auto, vllm or a directory holding a "
                                                f"generation_config.json; got {value!r}")


@dataclass
class EngineArgs:
    model: str | None = None  # None = the default model; a local path or a Hub id ORG/NAME
    revision: str | None = None  # of a Hub id: branch, tag or commit (default: main)
    tokenizer: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    seed: int = 0
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # default: 2048 with chunked prefill, else max_model_len
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: float | None = None  # GiB; default on CPU: DEFAULT_CPU_KV_CACHE_GIB
    attention_backend: str = "auto"
    device: str = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # None (automatic) | "uni" | "mp" | "ray"
    pp_layer_partition: list[int] | None = None
    pipeline_fill: bool = True  # keep up to pipeline_parallel_size batches in flight
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    distributed_timeout: float = 300.0
    max_queued_requests: int | None = None
    trust_remote_code: bool = False  # passed to transformers where the config and tokenizer load
    # default sampling parameters: "auto" = the model's generation_config.json, "vllm" = none (vLLM's own
    # defaults), or a directory holding a generation_config.json; a request's own values always win
    generation_config: str = "auto"
    # periodic stats log line (tokens/s, requests, KV-cache use); the server logs them, LLM() does not
    disable_log_stats: bool = False
    stats_log_interval: float = 5.0  # seconds between stats log lines
    enforce_eager: bool = False  # accepted for vLLM compatibility: Pagoda captures no CUDA graphs, always eager
    kv_cache_dtype: str = "auto"  # only "auto" (the model's dtype) is supported
    swap_space: float | None = None  # GiB of host memory per worker for swapped-out KV blocks (None: see docs)
    preemption_mode: str | None = None  # "swap" | "recompute"; None: swap when swap_space > 0
    tokenizer_mode: str = "auto"
    load_format: str = "auto"
    # speculative decoding, as vLLM's dict: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n,
    # "prompt_lookup_min": m} or {"model": PATH, "num_speculative_tokens": k} (see docs/speculative-decoding.md)
    speculative_config: dict | None = None
    # refused unless at their defaults (UNSUPPORTED_ARGS), so vLLM snippets fail by name, before loading
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    cpu_offload_gb: float = 0.0
    num_scheduler_steps: int = 1
    data_parallel_size: int = 1
    enable_sleep_mode: bool = False
    quantization: str | None = None  # int8 | int4 | gptq / awq (found from the checkpoint) | None
    quantization_group_size: int | None = None  # int4: 32 (default) | 64 | 128

    def create_config(self) -> "EngineConfig":
        return EngineConfig.from_args(self)


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
    dtype_reason: str = ""  # why this dtype (choose_dtype)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    enable_prefix_caching: bool
    gpu_memory_utilization: float
    kv_cache_memory_gib: float | None
    swap_space_gib: float = 0.0  # host memory per worker for swapped-out blocks
    num_swap_blocks: int = 0  # host blocks in that space (counted for the largest pipeline stage)
    preemption_mode: str = "recompute"


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    max_model_len: int
    preemption_mode: str = "recompute"


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

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


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
    args: EngineArgs = field(repr=False)
    log_stats: bool = False  # the periodic stats log line
    stats_log_interval: float = 5.0
    speculative: SpeculativeConfig | None = None
    draft_model: ModelConfig | None = None  # speculative method draft_model: the draft checkpoint

    @classmethod
    def from_args(cls, args: EngineArgs) -> "EngineConfig":
        import torch

        from pagoda.attention import resolve_backend_name
        from pagoda.model_loader import load_hf_config, resolve_model_path

        # every check that needs only the arguments comes first: nothing is converted or loaded for a bad value
        _check_positive(args, "block_size", "max_num_seqs", "tensor_parallel_size", "pipeline_parallel_size",
                        "nnodes")
        if args.block_size not in (8, 16, 32, 64, 128):
            raise InvalidParam("block_size", f"block_size must be one of 8, 16, 32, 64, 128; got {args.block_size}")
        if args.dtype not in DTYPES:
            raise InvalidParam("dtype", f"dtype must be one of {', '.join(DTYPES)}; got {args.dtype!r}")
        if not 0 < args.gpu_memory_utilization <= 1:
            raise InvalidParam("gpu_memory_utilization",
                               f"gpu_memory_utilization must be in (0, 1]; got {args.gpu_memory_utilization}")
        if args.kv_cache_memory is not None and args.kv_cache_memory <= 0:
            raise InvalidParam("kv_cache_memory", f"kv_cache_memory must be > 0 GiB; got {args.kv_cache_memory}")
        if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < 1:
            raise InvalidParam("max_num_batched_tokens",
                               f"max_num_batched_tokens must be >= 1; got {args.max_num_batched_tokens}")
        _check_vllm_args(args)
        speculative = None
        if args.speculative_config is not None:
            speculative = SpeculativeConfig.from_dict(args.speculative_config)
        world = args.tensor_parallel_size * args.pipeline_parallel_size
        device = resolve_device(args.device)
        backend = _resolve_executor_backend(args, world, device)
        if not 0 <= args.node_rank < args.nnodes:
            raise InvalidParam("node_rank", f"node_rank must be in [0, nnodes={args.nnodes}); got {args.node_rank}")
        if args.nnodes > 1 and args.nnodes != args.pipeline_parallel_size:
            raise InvalidParam("nnodes", f"nnodes ({args.nnodes}) must equal pipeline_parallel_size "
                                         f"({args.pipeline_parallel_size}): each node is one pipeline stage")
        check_quantization_args(args.quantization, args.quantization_group_size)
        check_generation_config_arg(args.generation_config)
        attention_backend = resolve_backend_name(args.attention_backend, torch.device(device).type)

        path = resolve_model_path(args.model, args.revision)
        hf_config = load_hf_config(path, trust_remote_code=args.trust_remote_code)
        dtype, dtype_reason = choose_dtype(args.dtype, device)
        max_model_len = _resolve_max_model_len(args.max_model_len, hf_config)
        quantization = resolve_quantization(args.quantization, args.quantization_group_size, hf_config,
                                            args.tensor_parallel_size)

        if args.max_num_batched_tokens is not None:
            budget = args.max_num_batched_tokens
            if not args.enable_chunked_prefill and budget < max_model_len:
                raise InvalidParam(
                    "max_num_batched_tokens",
                    f"max_num_batched_tokens ({budget}) is smaller than max_model_len ({max_model_len}): "
                    "without chunked prefill a prompt must fit in one step; enable chunked prefill "
                    "or raise max_num_batched_tokens")
        else:
            budget = 2048 if args.enable_chunked_prefill else max(2048, max_model_len)
        budget = max(budget, args.max_num_seqs) if not args.enable_chunked_prefill else budget

        draft_model = None
        if speculative is not None and speculative.method == "draft_model":
            draft_model = _draft_model_config(speculative, hf_config, dtype, max_model_len, args)
            speculative = dataclasses.replace(speculative, model=draft_model.path)

        served = args.served_model_name or args.model or DEFAULT_MODEL_NAME
        swap_gib = args.swap_space
        if swap_gib is None:
            swap_gib = DEFAULT_GPU_SWAP_SPACE_GIB if device.startswith("cuda") else DEFAULT_CPU_SWAP_SPACE_GIB
        block_bytes = _kv_block_bytes_per_stage(hf_config, dtype, args.block_size, args.tensor_parallel_size,
                                                args.pipeline_parallel_size, args.pp_layer_partition)
        num_swap_blocks = int(swap_gib * 2**30) // block_bytes
        mode = args.preemption_mode or ("swap" if num_swap_blocks > 0 else "recompute")
        return cls(
            model=ModelConfig(path=path, tokenizer_path=args.tokenizer or path, served_model_name=served,
                              hf_config=hf_config, dtype=dtype, max_model_len=max_model_len,
                              quantization=quantization, trust_remote_code=args.trust_remote_code,
                              generation_config=args.generation_config, dtype_reason=dtype_reason),
            cache=CacheConfig(block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching,
                              gpu_memory_utilization=args.gpu_memory_utilization,
                              kv_cache_memory_gib=args.kv_cache_memory, swap_space_gib=swap_gib,
                              num_swap_blocks=num_swap_blocks if mode == "swap" else 0, preemption_mode=mode),
            scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=budget,
                                      enable_chunked_prefill=args.enable_chunked_prefill,
                                      max_model_len=max_model_len, preemption_mode=mode),
            parallel=ParallelConfig(
                tensor_parallel_size=args.tensor_parallel_size,
                pipeline_parallel_size=args.pipeline_parallel_size,
                distributed_executor_backend=backend, pp_layer_partition=args.pp_layer_partition,
                nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
                master_port=args.master_port, distributed_timeout=args.distributed_timeout,
                pipeline_fill=args.pipeline_fill),
            device=device,
            attention_backend=attention_backend,
            seed=args.seed,
            log_stats=not args.disable_log_stats,
            stats_log_interval=args.stats_log_interval,
            speculative=speculative,
            draft_model=draft_model,
            args=args,
        )


def _draft_model_config(spec: SpeculativeConfig, target_hf_config, dtype: str, max_model_len: int,
                        args: EngineArgs) -> ModelConfig:
    """The draft checkpoint, checked against the target: it must share the tokenizer (the same vocabulary)."""
    from pagoda.model_loader import load_hf_config, resolve_model_path

    try:
        path = resolve_model_path(spec.model, None)
        hf_config = load_hf_config(path, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError) as e:
        raise InvalidParam("speculative_config", f"speculative_config: model {spec.model!r} cannot be loaded: {e}"
                           ) from e
    if hf_config.vocab_size != target_hf_config.vocab_size:
        raise InvalidParam("speculative_config", f"speculative_config: the draft model {spec.model!r} has a "
                           f"vocabulary of {hf_config.vocab_size} tokens, the target {target_hf_config.vocab_size}: "
                           "a draft model must share the target's tokenizer")
    limit = getattr(hf_config, "max_position_embeddings", None) or max_model_len
    if limit < max_model_len:
        raise InvalidParam("speculative_config", f"speculative_config: the draft model's context ({limit}) is "
                           f"shorter than max_model_len ({max_model_len}); lower max_model_len")
    return ModelConfig(path=path, tokenizer_path=path, served_model_name=spec.model, hf_config=hf_config,
                       dtype=dtype, max_model_len=max_model_len, trust_remote_code=args.trust_remote_code)


def _resolve_executor_backend(args: EngineArgs, world: int, device: str) -> str:
    """The explicit choice, else vLLM's: `ray` inside a Ray cluster whose local node cannot hold every rank,
    `mp` for more than one rank, `uni` for one."""
    backend = args.distributed_executor_backend
    if backend is None:
        if args.nnodes == 1 and ray_backend_wanted(world, device):
            logger.info("inside a Ray cluster and this node cannot hold all %d ranks: using the ray executor", world)
            return "ray"
        return "uni" if world == 1 else "mp"
    if backend not in EXECUTOR_BACKENDS:
        raise InvalidParam("distributed_executor_backend", "distributed_executor_backend must be one of "
                                                           f"{', '.join(EXECUTOR_BACKENDS)}; got {backend!r}")
    if backend == "uni" and world > 1:
        raise InvalidParam("distributed_executor_backend", "distributed_executor_backend 'uni' runs one "
                           f"process: tensor_parallel_size x pipeline_parallel_size must be 1, got {world}")
    if backend == "ray":
        if not ray_installed():
            raise InvalidParam("distributed_executor_backend", "distributed_executor_backend 'ray' needs Ray, "
                                                               f"which is not installed: {RAY_INSTALL_HINT}")
        if args.nnodes > 1:
            raise InvalidParam("nnodes", "nnodes is for the 'mp' backend; with 'ray', start a Ray cluster on the "
                                         "nodes (ray start) and Ray places the ranks")
    return backend


def _check_vllm_args(args: EngineArgs) -> None:
    """The vLLM arguments tutorials pass: accepted where Pagoda honours them, refused by name otherwise."""
    for name, default in UNSUPPORTED_ARGS.items():
        if getattr(args, name) != default:
            raise InvalidParam(name, f"{name} is not supported by Pagoda yet (got {getattr(args, name)!r}); "
                                     f"leave it at its default ({default!r})")
    if args.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise InvalidParam("kv_cache_dtype", f"kv_cache_dtype {args.kv_cache_dtype!r} is not supported yet: the "
                                             "KV cache uses the model's dtype; use 'auto'")
    if args.tokenizer_mode != "auto":
        raise InvalidParam("tokenizer_mode", f"tokenizer_mode {args.tokenizer_mode!r} is not supported yet; use 'auto'")
    if args.load_format not in LOAD_FORMATS:
        raise InvalidParam("load_format", f"load_format {args.load_format!r} is not supported yet; use one of "
                                          f"{', '.join(LOAD_FORMATS)}")
    if args.swap_space is not None and not args.swap_space >= 0:
        raise InvalidParam("swap_space", f"swap_space must be >= 0 GiB; got {args.swap_space}")
    if args.preemption_mode is not None and args.preemption_mode not in PREEMPTION_MODES:
        raise InvalidParam("preemption_mode", f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}; "
                                              f"got {args.preemption_mode!r}")
    if args.preemption_mode == "swap" and args.swap_space == 0:
        raise InvalidParam("preemption_mode", "preemption_mode 'swap' needs swap_space > 0")
    if not args.stats_log_interval > 0:
        raise InvalidParam("stats_log_interval", f"stats_log_interval must be > 0 seconds; "
                                                 f"got {args.stats_log_interval}")


def _kv_block_bytes_per_stage(hf_config, dtype: str, block_size: int, tp: int, pp: int,
                              partition: list[int] | None) -> int:
    """Bytes one KV block takes on a worker of the largest pipeline stage (so a host pool of swap_space
    GiB never holds more blocks than any worker can store)."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_size = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    layers = max(partition) if partition else -(-hf_config.num_hidden_layers // pp)
    itemsize = 4 if dtype == "float32" else 2
    return 2 * block_size * max(1, kv_heads // tp) * head_size * itemsize * max(layers, 1)


def _check_positive(args: EngineArgs, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if not isinstance(value, int) or value < 1:
            raise InvalidParam(name, f"{name} must be an integer >= 1; got {value!r}")


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise InvalidParam("device", f"device must be auto, cpu or cuda; got {device!r}")
    return device


def cpu_bf16_flags() -> list[str]:
    """This CPU's native bfloat16 instructions, as /proc/cpuinfo names them."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(f.read().split())
    except OSError:
        return []
    return [flag for flag in ("avx512_bf16", "amx_bf16") if flag in flags]


def cpu_has_fast_bf16() -> bool:
    return bool(cpu_bf16_flags())


def choose_dtype(dtype: str, device: str) -> tuple[str, str]:
    """The dtype `dtype` resolves to on `device`, and why (for the start-up log and --help)."""
    if dtype != "auto":
        return dtype, f"dtype {dtype}: as asked"
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_bf16_supported():
            return "bfloat16", "dtype auto -> bfloat16: this GPU supports bfloat16"
        return "float16", "dtype auto -> float16: this GPU has no bfloat16"
    flags = cpu_bf16_flags()
    if flags:
        return "bfloat16", f"dtype auto -> bfloat16: this CPU has native bfloat16 ({'/'.join(flags)})"
    return "float32", ("dtype auto -> float32: this CPU has no native bfloat16 (no avx512_bf16/amx_bf16); "
                       "--dtype bfloat16 halves the weights' and KV cache's memory but its matmuls are "
                       "converted in software, slower")


def resolve_dtype(dtype: str, device: str, hf_config=None) -> str:
    return choose_dtype(dtype, device)[0]


def _resolve_max_model_len(requested: int | None, hf_config) -> int:
    limit = getattr(hf_config, "max_position_embeddings", None) or 2048
    window = getattr(hf_config, "sliding_window", None)
    if window and getattr(hf_config, "use_sliding_window", True) and window < limit:
        # Pagoda has no sliding-window attention: cap the context so full attention stays exact.
        logger.warning("model uses a sliding window of %d tokens; capping max_model_len to it", window)
        limit = window
    if requested is None:
        return limit
    if requested < 1:
        raise InvalidParam("max_model_len", f"max_model_len must be >= 1; got {requested}")
    if requested > limit:
        raise InvalidParam("max_model_len",
                           f"max_model_len ({requested}) is larger than the model's maximum ({limit})")
    return requested
