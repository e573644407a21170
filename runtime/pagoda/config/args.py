"""The user's engine arguments (EngineArgs, vLLM's names) and the checks that need nothing but them."""

import os
from dataclasses import dataclass

from pagoda.config.configs import AUTO_TARGET, relative_itl_target
from pagoda.config.kv_cache import check_kv_cache_dtype
from pagoda.config.quantization import check_quantization_args
from pagoda.errors import InvalidParam

DTYPES = ("auto", "float32", "float16", "bfloat16")
PREEMPTION_MODES = ("swap", "recompute")
LOAD_FORMATS = ("auto", "safetensors")
EXECUTOR_BACKENDS = ("uni", "mp", "ray")

# vLLM engine arguments Pagoda does not implement yet: refused by name unless left at vLLM's default.
SCHEDULING_POLICIES = ("fcfs", "priority")
UNSUPPORTED_ARGS = {
    "cpu_offload_gb": 0.0,
    "num_scheduler_steps": 1,
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
    # a step's prefill share sized so running decodes keep this inter-token latency (docs/server.md); None: off
    target_itl_ms: float | str | None = None  # milliseconds, "3x" or "auto" (relative to a decode step)
    scheduling_policy: str = "fcfs"  # "fcfs" | "priority" (a request's `priority`, lower first), as vLLM's
    # with chunked prefill, a prompt computes at most this many tokens a step (0: no such cap), as vLLM's
    long_prefill_token_threshold: int = 0
    # schedule step N+1 while step N runs (vLLM's default since early 2026); None: on with a GPU, off on a CPU
    # (docs/server.md)
    async_scheduling: bool | None = None
    # vLLM 0.32's admission knobs, with its meanings (core/step_limits.py applies the first six; docs/server.md)
    max_num_active_seqs: int | None = None  # sequences admitted into running at once (default: max_num_seqs)
    max_num_scheduled_tokens: int | None = None  # tokens a step (default: max_num_batched_tokens)
    long_prefill_token_threshold_adaptive: bool = False  # the threshold floored at the budget's fair share
    watermark: float = 0.0  # the share of KV blocks an admission must leave free while others run
    scheduler_reserve_full_isl: bool = True  # admit a prompt only if all of it fits beside the running ones
    prefill_schedule_interval: int = 1  # new prompts' compute only every Nth step while decodes run
    scheduler_cls: str | None = None  # vLLM's scheduler class: only vLLM's own default names are accepted
    disable_chunked_mm_input: bool = False  # multimodal items whole: accepted, Pagoda's inputs are text
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: float | None = None  # GiB; default on CPU: DEFAULT_CPU_KV_CACHE_GIB
    attention_backend: str = "auto"
    device: str = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # None (automatic) | "uni" | "mp" | "ray"
    pp_layer_partition: list[int] | None = None
    pipeline_fill: bool = True  # keep up to pipeline_parallel_size batches in flight
    enable_expert_parallel: bool = False  # MoE: whole experts split over the DP x TP ranks (docs/distributed.md)
    # engines (each its own scheduler, block manager and KV cache), TP inside each (docs/distributed.md)
    data_parallel_size: int = 1
    # many nodes, as vLLM's flags: checked, and refused past their defaults until the node runtime lands
    data_parallel_size_local: int | None = None  # DP ranks on this node (default: all of them)
    data_parallel_address: str | None = None  # the head node's address, where the ranks meet
    data_parallel_rpc_port: int = 29550  # the head's port for the ranks' control messages (vLLM's default)
    data_parallel_start_rank: int = 0  # the first DP rank this node runs
    data_parallel_rank: int | None = None  # external load balancing: this server is DP rank R alone
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
    # CUDA graphs of decode steps (worker/cuda_graphs.py, docs/gpu.md): on with CUDA unless enforce_eager; never
    # on a CPU. compilation_config: vLLM's dict or its JSON text, {"cudagraph_capture_sizes": [1, 2, 4, ...]}
    enforce_eager: bool = False
    compilation_config: dict | str | None = None
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype) | "fp8" (= "fp8_e4m3") | "fp8_e5m2"
    calculate_kv_scales: bool = False  # fp8 cache: scales calibrated on the first batch (else checkpoint or 1.0)
    # every layer keeps full-length KV, windowed ones too, in one block table (core/kv_cache_groups.py), as vLLM's
    disable_hybrid_kv_cache_manager: bool = False
    swap_space: float | None = None  # GiB of host memory per worker for swapped-out KV blocks (None: see docs)
    preemption_mode: str | None = None  # "swap" | "recompute"; None: swap when swap_space > 0
    tokenizer_mode: str = "auto"
    load_format: str = "auto"
    # speculative decoding, as vLLM's dict: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n,
    # "prompt_lookup_min": m} or {"model": PATH, "num_speculative_tokens": k} (see docs/speculative-decoding.md)
    speculative_config: dict | None = None
    # LoRA adapters (docs/lora.md): device slots, the largest rank, host copies (default: max_loras)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # refused unless at their defaults (UNSUPPORTED_ARGS), so vLLM snippets fail by name, before loading
    cpu_offload_gb: float = 0.0
    num_scheduler_steps: int = 1
    enable_sleep_mode: bool = False
    quantization: str | None = None  # int8 | int4 | gptq / awq (found from the checkpoint) | None
    quantization_group_size: int | None = None  # int4: 32 (default) | 64 | 128
    # KV cache events as vLLM's dict (or its JSON text): {"enable_kv_cache_events": true, "publisher": "zmq",
    # "endpoint": "tcp://*:5557", "replay_endpoint": ..., "buffer_steps", "hwm", "topic"} (docs/router.md)
    kv_events_config: dict | str | None = None
    # P/D disaggregation as vLLM's dict (or its JSON text): {"kv_connector": "NixlConnector", "kv_role":
    # "kv_producer" | "kv_consumer" | "kv_both", "kv_connector_extra_config": {...}} (docs/disaggregation.md)
    kv_transfer_config: dict | str | None = None

    def validate(self) -> None:
        """The checks that need only the arguments, in the order a user meets them; InvalidParam names the field."""
        check_positive(self, "block_size", "max_num_seqs", "tensor_parallel_size", "pipeline_parallel_size",
                       "nnodes", "data_parallel_size")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise InvalidParam("block_size", f"block_size must be one of 8, 16, 32, 64, 128; got {self.block_size}")
        if self.dtype not in DTYPES:
            raise InvalidParam("dtype", f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise InvalidParam("gpu_memory_utilization",
                               f"gpu_memory_utilization must be in (0, 1]; got {self.gpu_memory_utilization}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise InvalidParam("kv_cache_memory", f"kv_cache_memory must be > 0 GiB; got {self.kv_cache_memory}")
        check_target_itl_ms(self.target_itl_ms)
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise InvalidParam("scheduling_policy", f"scheduling_policy must be one of "
                                                    f"{', '.join(SCHEDULING_POLICIES)}; got {self.scheduling_policy!r}")
        if not isinstance(self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            raise InvalidParam("long_prefill_token_threshold", "long_prefill_token_threshold must be an integer "
                               f">= 0 (0: off); got {self.long_prefill_token_threshold!r}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise InvalidParam("max_num_batched_tokens",
                               f"max_num_batched_tokens must be >= 1; got {self.max_num_batched_tokens}")
        check_step_limit_args(self)
        check_vllm_args(self)
        if not 0 <= self.node_rank < self.nnodes:
            raise InvalidParam("node_rank", f"node_rank must be in [0, nnodes={self.nnodes}); got {self.node_rank}")
        if self.nnodes > 1 and self.nnodes != self.pipeline_parallel_size:
            raise InvalidParam("nnodes", f"nnodes ({self.nnodes}) must equal pipeline_parallel_size "
                                         f"({self.pipeline_parallel_size}): each node is one pipeline stage")
        check_data_parallel_args(self)
        check_quantization_args(self.quantization, self.quantization_group_size)
        check_lora_args(self)
        check_generation_config_arg(self.generation_config)
        if self.compilation_config is not None:
            from pagoda.config.compilation import parse_compilation_config

            parse_compilation_config(self.compilation_config)
        if self.kv_events_config is not None:
            from pagoda.config.kv_events import KVEventsConfig

            KVEventsConfig.parse(self.kv_events_config)
        if self.kv_transfer_config is not None:
            from pagoda.config.kv_transfer import check_kv_transfer_args

            check_kv_transfer_args(self)
        backend = self.distributed_executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise InvalidParam("distributed_executor_backend", "distributed_executor_backend must be one of "
                                                               f"{', '.join(EXECUTOR_BACKENDS)}; got {backend!r}")


def check_vllm_args(args: EngineArgs) -> None:
    """The vLLM arguments tutorials pass: accepted where Pagoda honours them, refused by name otherwise."""
    for name, default in UNSUPPORTED_ARGS.items():
        if getattr(args, name) != default:
            raise InvalidParam(name, f"{name} is not supported by Pagoda yet (got {getattr(args, name)!r}); "
                                     f"leave it at its default ({default!r})")
    check_kv_cache_dtype(args.kv_cache_dtype, args.calculate_kv_scales)
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


# --scheduler-cls: vLLM's own schedulers, whose work Pagoda's scheduler does (a custom class cannot run here)
VLLM_SCHEDULER_CLASSES = ("vllm.v1.core.sched.scheduler.Scheduler", "vllm.v1.core.sched.async_scheduler.AsyncScheduler")


def check_step_limit_args(args: EngineArgs) -> None:
    """vLLM 0.32's admission knobs (core/step_limits.py): their ranges, as vLLM checks them."""
    if args.max_num_active_seqs is not None and not 1 <= args.max_num_active_seqs <= args.max_num_seqs:
        raise InvalidParam("max_num_active_seqs", f"max_num_active_seqs must be between 1 and max_num_seqs "
                                                  f"({args.max_num_seqs}); got {args.max_num_active_seqs}")
    if args.max_num_scheduled_tokens is not None and args.max_num_scheduled_tokens < 1:
        raise InvalidParam("max_num_scheduled_tokens",
                           f"max_num_scheduled_tokens must be >= 1; got {args.max_num_scheduled_tokens}")
    if not 0 <= args.watermark < 1:
        raise InvalidParam("watermark", f"watermark must be in [0, 1) (a share of the KV blocks); got {args.watermark}")
    if not isinstance(args.prefill_schedule_interval, int) or args.prefill_schedule_interval < 1:
        raise InvalidParam("prefill_schedule_interval", f"prefill_schedule_interval must be an integer >= 1; "
                                                        f"got {args.prefill_schedule_interval!r}")
    if args.scheduler_cls is not None and args.scheduler_cls not in VLLM_SCHEDULER_CLASSES:
        raise InvalidParam("scheduler_cls", f"scheduler_cls {args.scheduler_cls!r} cannot run in Pagoda, whose own "
                                            f"scheduler does the work of vLLM's ({', '.join(VLLM_SCHEDULER_CLASSES)}); "
                                            "leave it out")


def check_scheduled_tokens(scheduled: int | None, budget: int, max_model_len: int, chunked_prefill: bool) -> None:
    """max_num_scheduled_tokens against the step's resolved max_num_batched_tokens, as vLLM's."""
    if scheduled is None:
        return
    if scheduled > budget:
        raise InvalidParam("max_num_scheduled_tokens", f"max_num_scheduled_tokens ({scheduled}) must not exceed "
                                                       f"max_num_batched_tokens ({budget})")
    if not chunked_prefill and scheduled < max_model_len:
        raise InvalidParam("max_num_scheduled_tokens", f"max_num_scheduled_tokens ({scheduled}) is smaller than "
                                                       f"max_model_len ({max_model_len}): without chunked prefill a "
                                                       "prompt must fit in one step")


def check_data_parallel_args(args: EngineArgs) -> None:
    """data_parallel_size > 1: the combinations the data-parallel engine does not run, refused by name."""
    check_data_parallel_nodes(args)
    if args.data_parallel_size == 1 or args.data_parallel_rank is not None:  # one rank: an ordinary engine
        return
    refused = {
        "pipeline_parallel_size": (args.pipeline_parallel_size > 1, "pipeline parallelism inside a DP rank"),
        "nnodes": (args.nnodes > 1, "--nnodes (one DP group runs on one node)"),
        "distributed_executor_backend": (args.distributed_executor_backend in ("uni", "ray"),
                                         f"the {args.distributed_executor_backend} executor (DP runs on 'mp')"),
        "speculative_config": (args.speculative_config is not None, "speculative decoding"),
    }
    for name, (bad, what) in refused.items():
        if bad:
            raise InvalidParam(name, f"data_parallel_size={args.data_parallel_size} does not support {what} yet; "
                                     f"{name} must stay at its default")


def check_data_parallel_nodes(args: EngineArgs) -> None:
    """vLLM's many-node DP flags: each checked against data_parallel_size, then refused by name while one
    node runs every DP rank (docs/distributed.md)."""
    dp = args.data_parallel_size
    local = args.data_parallel_size_local
    if local is not None and not (isinstance(local, int) and 1 <= local <= dp and dp % local == 0):
        raise InvalidParam("data_parallel_size_local", f"data_parallel_size_local must divide data_parallel_size "
                                                       f"({dp}) and be >= 1; got {local!r}")
    if not (isinstance(args.data_parallel_start_rank, int) and 0 <= args.data_parallel_start_rank < dp):
        raise InvalidParam("data_parallel_start_rank", f"data_parallel_start_rank must be in [0, {dp}); "
                                                       f"got {args.data_parallel_start_rank!r}")
    if args.data_parallel_rank is not None and not (isinstance(args.data_parallel_rank, int)
                                                    and 0 <= args.data_parallel_rank < dp):
        raise InvalidParam("data_parallel_rank", f"data_parallel_rank must be in [0, {dp}); "
                                                 f"got {args.data_parallel_rank!r}")
    if not (isinstance(args.data_parallel_rpc_port, int) and 0 < args.data_parallel_rpc_port < 65536):
        raise InvalidParam("data_parallel_rpc_port", f"data_parallel_rpc_port must be a port (1-65535); "
                                                     f"got {args.data_parallel_rpc_port!r}")
    if args.data_parallel_start_rank % (local or dp):
        raise InvalidParam("data_parallel_start_rank", f"data_parallel_start_rank ({args.data_parallel_start_rank}) "
                                                       f"must be a multiple of data_parallel_size_local ({local})")
    if args.data_parallel_rank is not None:
        check_external_load_balancing(args)


def check_external_load_balancing(args: EngineArgs) -> None:
    """--data-parallel-rank R (vLLM's external load balancing): this server runs DP rank R alone, its own
    endpoint; a router in front balances over the ranks. Here the ranks are independent engines, so experts
    spread over ranks that other servers run are refused by name."""
    if args.data_parallel_size_local not in (None, 1):
        raise InvalidParam("data_parallel_size_local", f"data_parallel_size_local must be 1 (or unset) with "
                                                       f"data_parallel_rank: each server runs its one rank; "
                                                       f"got {args.data_parallel_size_local!r}")
    if args.data_parallel_start_rank != 0:
        raise InvalidParam("data_parallel_start_rank", "data_parallel_start_rank is for --headless nodes of one "
                                                       "server's DP group; with data_parallel_rank each server is "
                                                       "its own rank: leave it unset")
    if args.enable_expert_parallel and args.data_parallel_size > 1:
        raise InvalidParam("enable_expert_parallel", "enable_expert_parallel with data_parallel_rank (experts over "
                                                     "every rank, each rank its own endpoint) is not supported by "
                                                     "Pagoda yet: externally balanced ranks are independent engines; "
                                                     "serve the group from one server (-dp N, with --headless "
                                                     "nodes) for experts over every rank (docs/distributed.md)")


def check_lora_args(args: EngineArgs) -> None:
    if not args.enable_lora:
        return
    check_positive(args, "max_loras", "max_lora_rank")
    if args.max_cpu_loras is not None:
        check_positive(args, "max_cpu_loras")
        if args.max_cpu_loras < args.max_loras:
            raise InvalidParam("max_cpu_loras", f"max_cpu_loras ({args.max_cpu_loras}) must be >= max_loras "
                                                f"({args.max_loras})")


def check_positive(args: EngineArgs, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if not isinstance(value, int) or value < 1:
            raise InvalidParam(name, f"{name} must be an integer >= 1; got {value!r}")


def check_target_itl_ms(target) -> None:
    """target_itl_ms: milliseconds > 0, a relative target such as "3x", "auto" or None (off)."""
    if target is None or target == AUTO_TARGET or (isinstance(target, (int, float)) and target > 0):
        return
    try:
        if relative_itl_target(target) is not None:
            return
    except ValueError:
        pass
    raise InvalidParam("target_itl_ms", f"target_itl_ms must be > 0 milliseconds, a multiple >= 1 of the decodes' "
                                        f"step such as '3x', or {AUTO_TARGET!r}; got {target!r}")
