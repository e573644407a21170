"""Resolution: EngineArgs -> EngineConfig: the model's files and config.json (config/model_files.py), the
attention backend's name, a Ray cluster (config/ray_presence.py), through imports made when called, so
importing pagoda.config stays torch-free and cheap. Nothing here imports a layer above the configuration."""

import dataclasses
import logging
import os

from pagoda.config.args import EngineArgs, check_scheduled_tokens
from pagoda.config.configs import (
    DEFAULT_CPU_SWAP_SPACE_GIB,
    DEFAULT_GPU_SWAP_SPACE_GIB,
    DEFAULT_MODEL_NAME,
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    kv_block_bytes,
)
from pagoda.config.kv_cache import kv_cache_itemsize
from pagoda.config.kv_transfer import resolve_kv_transfer_config
from pagoda.config.quantization import resolve_quantization
from pagoda.errors import InvalidParam

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("auto", "torch", "triton")


def create_engine_config(args: EngineArgs) -> EngineConfig:
    """EngineArgs -> EngineConfig: every argument checked, the model's config read, each "auto" resolved."""
    import torch

    from pagoda.config.model_files import load_hf_config, resolve_model_path

    args.validate()  # every check that needs only the arguments: nothing is converted or loaded for a bad value
    speculative = None
    if args.speculative_config is not None:
        speculative = SpeculativeConfig.from_dict(args.speculative_config)
    world = engine_data_parallel_size(args) * args.tensor_parallel_size * args.pipeline_parallel_size
    device = resolve_device(args.device)
    backend = _resolve_executor_backend(args, world, device)
    attention_backend = resolve_attention_backend(args.attention_backend, torch.device(device).type)

    path = resolve_model_path(args.model, args.revision)
    hf_config = load_hf_config(path, trust_remote_code=args.trust_remote_code)
    _check_heads_split(hf_config, args.tensor_parallel_size)
    if getattr(hf_config, "kv_lora_rank", None) and args.kv_cache_dtype != "auto":
        raise InvalidParam("kv_cache_dtype", f"kv_cache_dtype {args.kv_cache_dtype!r} is not supported for "
                                             f"{hf_config.architectures[0]}'s latent (MLA) KV cache yet: use 'auto'")
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
    check_scheduled_tokens(args.max_num_scheduled_tokens, budget, max_model_len, args.enable_chunked_prefill)

    draft_model = None
    if speculative is not None and speculative.method == "draft_model":
        draft_model = _draft_model_config(speculative, hf_config, dtype, max_model_len, args)
        speculative = dataclasses.replace(speculative, model=draft_model.path)

    served = args.served_model_name or args.model or DEFAULT_MODEL_NAME
    swap_gib = args.swap_space
    if swap_gib is None:
        swap_gib = DEFAULT_GPU_SWAP_SPACE_GIB if device.startswith("cuda") else DEFAULT_CPU_SWAP_SPACE_GIB
    block_bytes = _kv_block_bytes_per_stage(hf_config, kv_cache_itemsize(args.kv_cache_dtype, dtype),
                                            args.block_size, args.tensor_parallel_size,
                                            args.pipeline_parallel_size, args.pp_layer_partition)
    num_swap_blocks = int(swap_gib * 2**30) // block_bytes
    mode = args.preemption_mode or ("swap" if num_swap_blocks > 0 else "recompute")
    return EngineConfig(
        model=ModelConfig(path=path, tokenizer_path=args.tokenizer or path, served_model_name=served,
                          hf_config=hf_config, dtype=dtype, max_model_len=max_model_len,
                          quantization=quantization, trust_remote_code=args.trust_remote_code,
                          generation_config=args.generation_config, dtype_reason=dtype_reason),
        cache=CacheConfig(block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          kv_cache_memory_gib=args.kv_cache_memory, swap_space_gib=swap_gib,
                          num_swap_blocks=num_swap_blocks if mode == "swap" else 0, preemption_mode=mode,
                          cache_dtype=args.kv_cache_dtype, calculate_kv_scales=args.calculate_kv_scales,
                          disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=budget,
                                  enable_chunked_prefill=args.enable_chunked_prefill,
                                  max_model_len=max_model_len, preemption_mode=mode,
                                  max_loras=args.max_loras if args.enable_lora else None,
                                  target_itl_ms=args.target_itl_ms, scheduling_policy=args.scheduling_policy,
                                  long_prefill_token_threshold=args.long_prefill_token_threshold,
                                  async_scheduling=_async_scheduling(args, speculative, device, backend),
                                  max_num_active_seqs=args.max_num_active_seqs,
                                  max_num_scheduled_tokens=args.max_num_scheduled_tokens,
                                  long_prefill_token_threshold_adaptive=args.long_prefill_token_threshold_adaptive,
                                  watermark=args.watermark, reserve_full_isl=args.scheduler_reserve_full_isl,
                                  prefill_schedule_interval=args.prefill_schedule_interval),
        parallel=dataclasses.replace(ParallelConfig(
            tensor_parallel_size=args.tensor_parallel_size,
            pipeline_parallel_size=args.pipeline_parallel_size,
            distributed_executor_backend=backend, pp_layer_partition=args.pp_layer_partition,
            nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
            master_port=args.master_port, distributed_timeout=args.distributed_timeout,
            pipeline_fill=args.pipeline_fill, enable_expert_parallel=args.enable_expert_parallel,
            data_parallel_size=engine_data_parallel_size(args), data_parallel_rank=args.data_parallel_rank or 0),
            **_data_parallel_nodes(args)),
        device=device,
        attention_backend=attention_backend,
        seed=args.seed,
        log_stats=not args.disable_log_stats,
        stats_log_interval=args.stats_log_interval,
        speculative=speculative,
        draft_model=draft_model,
        lora=LoRAConfig(args.max_loras, args.max_lora_rank, max(args.max_cpu_loras or 0, args.max_loras))
        if args.enable_lora else None,
        kv_events=_kv_events(args.kv_events_config),
        kv_transfer=resolve_kv_transfer_config(args.kv_transfer_config),
        cudagraph_capture_sizes=_cudagraph_capture_sizes(args, device),
    )


def _cudagraph_capture_sizes(args: EngineArgs, device: str) -> tuple[int, ...]:
    """Graphs on with CUDA unless enforce_eager; on a CPU none (nothing to save there), unless the stand-in
    capture rehearses them (PAGODA_CUDA_GRAPH_STAND_IN=1: tests and gpu-check's dry run)."""
    from pagoda.config.compilation import capture_sizes, cuda_graph_stand_in

    if args.enforce_eager:
        return ()
    if not device.startswith("cuda") and not cuda_graph_stand_in():
        if args.compilation_config is not None:
            logger.info("compilation_config: no CUDA graphs on %s; every step runs eagerly", device)
        return ()
    return capture_sizes(args.compilation_config, args.max_num_seqs)


def engine_data_parallel_size(args: EngineArgs) -> int:
    """The DP ranks this engine runs: all of them, or with --data-parallel-rank (external load balancing) its
    one rank, an independent engine."""
    return 1 if args.data_parallel_rank is not None else args.data_parallel_size


def _data_parallel_nodes(args: EngineArgs) -> dict:
    """DP over many nodes: this node's ranks, and the head's --data-parallel-address/--data-parallel-rpc-port,
    where every node's ranks meet (the group's rendezvous store, in place of --master-addr/--master-port)."""
    local = args.data_parallel_size_local or args.data_parallel_size
    if args.data_parallel_rank is not None or (local == args.data_parallel_size and args.data_parallel_address is None):
        return {}
    return dict(data_parallel_size_local=local, data_parallel_start_rank=args.data_parallel_start_rank,
                master_addr=args.data_parallel_address or "127.0.0.1", master_port=args.data_parallel_rpc_port)


def _kv_events(raw):
    if raw is None:
        return None
    from pagoda.config.kv_events import KVEventsConfig

    config = KVEventsConfig.parse(raw)
    return config if config.enabled else None


def _draft_model_config(spec: SpeculativeConfig, target_hf_config, dtype: str, max_model_len: int,
                        args: "EngineArgs") -> ModelConfig:
    """The draft checkpoint, checked against the target: it must share the tokenizer (the same vocabulary)."""
    from pagoda.config.model_files import load_hf_config, resolve_model_path

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


def _resolve_executor_backend(args: "EngineArgs", world: int, device: str) -> str:
    """The explicit choice, else vLLM's: `ray` inside a Ray cluster whose local node cannot hold every rank,
    `mp` for more than one rank, `uni` for one."""
    from pagoda.config.ray_presence import RAY_INSTALL_HINT, ray_backend_wanted, ray_installed

    backend = args.distributed_executor_backend
    if backend is None:
        if engine_data_parallel_size(args) > 1:  # the data-parallel engine drives its ranks from this process
            return "mp"
        if args.nnodes == 1 and ray_backend_wanted(world, device):
            logger.info("inside a Ray cluster and this node cannot hold all %d ranks: using the ray executor", world)
            return "ray"
        return "uni" if world == 1 else "mp"
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


def _check_heads_split(hf_config, tp: int) -> None:
    """Tensor parallelism splits the attention heads: refused here, by the flag's name, where the split cannot
    be even (rather than in every rank as it builds its layers, a crash loop in a pod)."""
    heads = getattr(hf_config, "num_attention_heads", None)
    if tp == 1 or not heads:
        return
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    fits = [n for n in range(1, heads + 1) if heads % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0)]
    if tp not in fits:
        raise InvalidParam(
            "tensor_parallel_size",
            f"tensor_parallel_size {tp} does not split the model's {heads} attention heads ({kv_heads} KV heads) "
            f"evenly: use one of {', '.join(map(str, fits))}")


def _kv_block_bytes_per_stage(hf_config, itemsize: int, block_size: int, tp: int, pp: int,
                              partition: list[int] | None) -> int:
    """Bytes one KV block takes on a worker of the largest pipeline stage (so a host pool of swap_space
    GiB never holds more blocks than any worker can store)."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_size = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    layers = max(partition) if partition else -(-hf_config.num_hidden_layers // pp)
    if getattr(hf_config, "kv_lora_rank", None):  # MLA (DeepSeek): one latent row per token, on every rank
        return kv_block_bytes(block_size, 1, hf_config.kv_lora_rank + hf_config.qk_rope_head_dim, itemsize,
                              max(layers, 1), planes=1)
    return kv_block_bytes(block_size, max(1, kv_heads // tp), head_size, itemsize, max(layers, 1))


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise InvalidParam("device", f"device must be auto, cpu or cuda; got {device!r}")
    return device


def choose_dtype(dtype: str, device: str) -> tuple[str, str]:
    """The dtype `dtype` resolves to on `device`, and why (the start-up log and --help say it): "auto" is
    what pagoda.platform finds fastest there. PAGODA_CPU_ISA is checked here, at start-up, whatever the dtype."""
    from pagoda.platform import choose_dtype as fastest_dtype
    from pagoda.platform import cpu_isa

    if device == "cpu":
        cpu_isa()
    if dtype != "auto":
        return dtype, f"dtype {dtype}: as asked"
    chosen, why = fastest_dtype(device)
    return chosen, f"dtype auto -> {chosen}: {why}"


def resolve_dtype(dtype: str, device: str, hf_config=None) -> str:
    return choose_dtype(dtype, device)[0]


def _resolve_max_model_len(requested: int | None, hf_config) -> int:
    limit = getattr(hf_config, "max_position_embeddings", None) or 2048
    if requested is None:
        return limit
    if requested < 1:
        raise InvalidParam("max_model_len", f"max_model_len must be >= 1; got {requested}")
    if requested > limit:
        raise InvalidParam("max_model_len",
                           f"max_model_len ({requested}) is larger than the model's maximum ({limit})")
    return requested


def _async_scheduling(args: "EngineArgs", speculative, device: str, backend: str) -> bool:
    """--async-scheduling where it applies: one process, the `uni` executor (the runner beside the scheduler,
    on a thread of its own), no speculative decoding (a step's tokens are not one per sequence); else off,
    logged when it was asked for. Unset: on with a GPU (the forward pass on the device, the host's cores free to
    schedule beside it), off on a CPU (there the scheduling would run on the cores the forward pass uses)."""
    wanted = args.async_scheduling if args.async_scheduling is not None else device != "cpu"
    if not wanted:
        return False
    why = ("tensor or pipeline parallelism" if args.tensor_parallel_size * args.pipeline_parallel_size > 1
           else "data parallelism" if engine_data_parallel_size(args) > 1
           else f"the {backend} executor" if backend != "uni"
           else "speculative decoding" if speculative is not None else None)
    if why is not None:
        if args.async_scheduling:
            logger.warning("--async-scheduling is off with %s: each step is scheduled after the previous one",
                           why)
        return False
    return True


def resolve_attention_backend(name: str, device_type: str) -> str:
    """attention_backend "auto" -> triton on CUDA, torch elsewhere; a name that cannot run here: ValueError."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}; got {name!r}")
    if name == "auto":
        return "triton" if device_type == "cuda" else "torch"
    if name == "triton" and device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"attention_backend 'triton' needs a CUDA device, not {device_type} (or TRITON_INTERPRET=1 "
                         "to run the kernels in Triton's interpreter, for tests); use 'torch' or 'auto'")
    return name
