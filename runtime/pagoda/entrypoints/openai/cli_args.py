"""`pagoda serve` flags: DESIGN.md's set plus a few operational ones, each also read from `PAGODA_<FLAG>`.

Defaults come from `EngineArgs`, so the engine stays the single source of truth. Flags win over the
environment; a bad value from either ends in an argparse error naming the flag (and the variable).
"""

import argparse
import dataclasses
import functools
import json
import os
import re
from dataclasses import dataclass

from pagoda.config import (
    AUTO_TARGET,
    DTYPES,
    EXECUTOR_BACKENDS,
    KV_CACHE_DTYPES,
    PREEMPTION_MODES,
    EngineArgs,
    choose_dtype,
    relative_itl_target,
)
from pagoda.config.args import SCHEDULING_POLICIES
from pagoda.config.default_model import DEFAULT_MODEL_NAME
from pagoda.config.quantization import GROUP_SIZES, METHODS
from pagoda.core.itl_tail import DEFAULT_SHARE
from pagoda.core.scheduler import AUTO_TARGET_FACTOR, MAX_QUEUE_STEPS
from pagoda.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from pagoda.entrypoints.openai.tool_parsers import TOOL_PARSERS

ENV_PREFIX = "PAGODA_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_ENGINE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


@dataclass
class ServerArgs:
    """What the HTTP layer needs that the engine does not."""

    host: str = "0.0.0.0"
    port: int = 8000
    api_key: str | None = None
    max_queued_requests: int | None = None
    # vLLM's admission limits (None: none), answered with 503: sequences in flight, prompt tokens before their
    # first output token
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    stream_interval: int = 1  # tokens per streamed chunk after the first (vLLM's); the rest when a choice ends
    shutdown_timeout: float = 30.0
    log_level: str = "info"
    trust_request_chat_template: bool = False  # let requests bring their own chat_template (runs on the server)
    enable_auto_tool_choice: bool = False  # tool_choice "auto": parse the model's text for tool calls
    tool_call_parser: str | None = None  # which format (tool_parsers.TOOL_PARSERS)
    reasoning_parser: str | None = None  # split thinking models' <think> text out (reasoning_parsers)
    enable_reasoning: bool = False  # older vLLM's switch for the above: accepted, implied by the parser
    max_stored_responses: int = 1024  # /v1/responses kept for GET and previous_response_id (LRU beyond)
    chat_template: str | None = None  # a Jinja file or the template itself, instead of the model's
    # CORS, as vLLM's flags and defaults (any origin, method and header; no credentials)
    allowed_origins: list[str] = dataclasses.field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = dataclasses.field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = dataclasses.field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    metrics_vllm_names: bool = False  # also publish every metric under vLLM's `vllm:` names
    headless: bool = False  # vLLM's: a node that runs DP ranks (from --data-parallel-start-rank) and no API server
    lora_modules: list["LoRAModulePath"] | None = None  # adapters served by name (--enable-lora)
    allow_runtime_lora_updating: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.enable_reasoning and self.reasoning_parser is None:
            raise ValueError("--enable-reasoning needs --reasoning-parser")


@dataclass(frozen=True)
class LoRAModulePath:
    name: str
    path: str
    base_model_name: str | None = None


def lora_module(text: str) -> LoRAModulePath:
    """`--lora-modules NAME=PATH` or vLLM's JSON form `{"name": ..., "path": ..., "base_model_name": ...}`."""
    text = text.strip()
    if text.startswith("{"):
        value = json.loads(text)
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not isinstance(
                value.get("path"), str) or set(value) - {"name", "path", "base_model_name"}:
            raise ValueError(text)
        return LoRAModulePath(value["name"], value["path"], value.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(text)
    return LoRAModulePath(name, path)


def env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


def token_count(text: str) -> int:
    """A non-negative integer, or vLLM's human-readable form: 32k = 32,000 (k m g t), 32K = 32,768 (K M G T)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT])", text.strip())
    if match is None:
        return non_negative_int(text)
    number, suffix = match.groups()
    if suffix.islower():
        return int(float(number) * 1000 ** ("kmgt".index(suffix) + 1))
    return int(number) * 1024 ** ("KMGT".index(suffix) + 1)  # ValueError for a decimal: 1.5K is not a count


token_count.__name__ = "token count (a non-negative integer, or such as 32k or 32K)"


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(text)
    return value


def itl_target(text: str) -> float | str | None:
    """--target-itl-ms: milliseconds > 0, a multiple >= 1 of the decodes' step ('3x'), 'auto' or 'off' (None)."""
    if text in (AUTO_TARGET, "off"):
        return None if text == "off" else text
    try:
        if text.endswith("x"):
            relative_itl_target(text)  # ValueError unless a multiple >= 1
            return text
        return positive_float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a target: milliseconds > 0, a multiple >= 1 of the decodes' step such as '3x', "
            f"'{AUTO_TARGET}' or 'off'") from None


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise ValueError(text)
    return value


def port_number(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError(text)
    return value


def int_list(text: str) -> list[int]:
    """`--pp-layer-partition 12,12,8`: layers per pipeline stage."""
    values = [positive_int(part) for part in re.split(r"[,\s]+", text.strip()) if part]
    if not values:
        raise ValueError(text)
    return values


def chat_template_arg(text: str) -> str:
    """A path to a Jinja file is read; otherwise the text must be a template itself (it has Jinja tags)."""
    if os.path.isfile(text):
        with open(text, encoding="utf-8") as f:
            return f.read()
    if "{{" in text or "{%" in text:
        return text
    raise ValueError(text)


def json_string_list(text: str) -> list[str]:
    """`--allowed-origins '["https://a.example"]'`: a JSON list of strings, as vLLM's CORS flags."""
    value = json.loads(text)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(text)
    return value


def json_object(text: str) -> dict:
    """`--speculative-config '{"method": "ngram", ...}'`: a JSON object (its keys are checked by the engine)."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(text)
    return value


# argparse names the type function in its error message: make those readable
for _fn, _name in [(positive_int, "positive integer"), (non_negative_int, "non-negative integer"),
                   (positive_float, "positive number"), (non_negative_float, "non-negative number"),
                   (port_number, "port number"), (int_list, "comma-separated list of positive integers"),
                   (chat_template_arg, "chat template (no such file, and not a Jinja template)"),
                   (json_string_list, "JSON list of strings"), (json_object, "JSON object"),
                   (lora_module, "LoRA module (NAME=PATH or a JSON object with name and path)")]:
    _fn.__name__ = _name


class InvalidEnvValue:
    """The default of a flag whose PAGODA_<FLAG> variable holds no valid value: an error unless the flag is given
    (a Kubernetes Service named pagoda, say, gives every pod PAGODA_PORT=tcp://...)."""

    def __init__(self, message: str):
        self.message = message

    def __repr__(self) -> str:
        return f"InvalidEnvValue({self.message!r})"


class _EnvParser:
    """Adds flags whose defaults come from the environment, converting and checking them like argv."""

    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser

    def add(self, flag: str, *aliases: str, default=None, type=str, choices=None, boolean: bool = False,
            help: str = "", secret: bool = False):
        env = env_name(flag)
        raw = os.environ.get(env)
        if raw is not None and raw != "":
            try:
                default = self._convert_env(flag, env, raw, type, choices, boolean)
            except ValueError as e:  # an error only if the flag is not given: flags win
                default = InvalidEnvValue(str(e))
        # the variable, with its value when set (which is then the default); else the default once: the
        # help's own words for it, or the value
        tag = f"[env {env}={'(set)' if secret else raw}]".replace("%", "%%") if raw else f"[env {env}]"
        help = f"{help} {tag}" if help else tag
        if boolean:
            self.parser.add_argument(flag, *aliases, action=argparse.BooleanOptionalAction, default=default,
                                     help=help)
        else:
            if not raw and not secret and "(default:" not in help:
                help = f"{help} (default: {str(default).replace('%', '%%')})"
            self.parser.add_argument(flag, *aliases, type=type, choices=choices, default=default, help=help)

    def _convert_env(self, flag, env, raw, type, choices, boolean):
        if boolean:
            if raw.lower() in _TRUE:
                return True
            if raw.lower() in _FALSE:
                return False
            raise ValueError(f"argument {flag}: invalid boolean {raw!r} in {env} (use true or false)")
        try:
            value = type(raw)
        except argparse.ArgumentTypeError as e:  # a type that says what it wants
            raise ValueError(f"argument {flag}: {e} (in {env})") from None
        except (TypeError, ValueError):
            raise ValueError(f"argument {flag}: invalid {getattr(type, '__name__', 'value')} {raw!r} in {env}") \
                from None
        if choices is not None and value not in choices:
            raise ValueError(f"argument {flag}: invalid choice {raw!r} in {env} "
                             f"(choose from {', '.join(map(str, choices))})")
        return value


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    d = _ENGINE_DEFAULTS
    parser.add_argument("model", nargs="?", default=os.environ.get(env_name("model")) or None,
                        help="a Hugging Face model directory, .gguf file or Hub id ORG/NAME "
                             f"(default: {DEFAULT_MODEL_NAME}) [env PAGODA_MODEL]")
    p = _EnvParser(parser)
    p.add("--revision", help="branch, tag or commit of a Hub model id (default: main)")
    p.add("--served-model-name", help="the name clients pass as `model`")
    p.add("--host", default=ServerArgs.host)
    p.add("--port", default=ServerArgs.port, type=port_number)
    p.add("--api-key", help="require `Authorization: Bearer KEY` on /v1/*", secret=True)  # never in --help
    p.add("--tensor-parallel-size", default=d["tensor_parallel_size"], type=positive_int)
    p.add("--pipeline-parallel-size", default=d["pipeline_parallel_size"], type=positive_int)
    p.add("--pp-layer-partition", type=int_list, help="layers per pipeline stage, e.g. 12,12,8")
    p.add("--enable-expert-parallel", default=d["enable_expert_parallel"], boolean=True,
          help="mixture-of-experts models: split whole experts over the tensor-parallel ranks (with "
               "--data-parallel-size, over every DP x TP rank) instead of splitting every expert's matrices")
    p.add("--data-parallel-size", "-dp", default=d["data_parallel_size"], type=positive_int,
          help="engines behind this server, each with its own scheduler and KV cache and TP inside it; requests "
               "go to the least loaded (docs/distributed.md)")
    p.add("--data-parallel-size-local", type=positive_int,
          help="DP ranks on this node (default: all); fewer: DP over many nodes, the others --headless")
    p.add("--data-parallel-address", help="the head node's address, where every node's DP ranks meet")
    p.add("--data-parallel-rpc-port", default=d["data_parallel_rpc_port"], type=port_number,
          help="the head's port where every node's DP ranks meet")
    p.add("--data-parallel-start-rank", default=d["data_parallel_start_rank"], type=non_negative_int,
          help="the first DP rank this node runs (a --headless node)")
    p.add("--data-parallel-rank", type=non_negative_int,
          help="external load balancing: this server is DP rank R alone (not supported yet)")
    p.add("--headless", default=ServerArgs.headless, boolean=True,
          help="run this node's DP ranks (--data-parallel-start-rank) and no API server: only /health and "
               "/metrics on --port")
    p.add("--nnodes", default=d["nnodes"], type=positive_int)
    p.add("--node-rank", default=d["node_rank"], type=non_negative_int)
    p.add("--master-addr", default=d["master_addr"])
    p.add("--master-port", default=d["master_port"], type=port_number)
    p.add("--distributed-timeout", default=d["distributed_timeout"], type=positive_float,
          help="seconds to wait for every rank to join (and, with Ray, for the cluster to place them)")
    p.add("--distributed-executor-backend", choices=EXECUTOR_BACKENDS,
          help="uni: one process; mp: local processes (and --nnodes); ray: Ray actors over a Ray cluster "
               "(default: ray inside a Ray cluster whose local node cannot hold every rank, else mp or uni)")
    p.add("--dtype", default=d["dtype"], choices=DTYPES,
          help="auto: bfloat16 on a GPU that supports it, else float16; on CPU bfloat16 where the CPU has native "
               "bfloat16 (avx512_bf16/amx_bf16), else float32. Here on CPU: " + choose_dtype("auto", "cpu")[1])
    p.add("--max-model-len", type=positive_int)
    p.add("--block-size", default=d["block_size"], type=positive_int)
    p.add("--max-num-seqs", default=d["max_num_seqs"], type=positive_int)
    p.add("--max-num-batched-tokens", type=positive_int)
    p.add("--target-itl-ms", default=AUTO_TARGET, type=itl_target,
          help="inter-token latency to keep for running requests, in ms: while decodes run, each step's prompt "
               "tokens are what the target leaves beyond the decodes' own step at the measured price per prompt "
               "token, long prompts cut into as many chunks as that needs (with no decode running prompts take "
               f"the whole --max-num-batched-tokens); a number is a bound (an SLO), whatever waits. 'auto': the "
               "oldest prompt is computed whole, and newer prompts join a step while it takes up to "
               f"{AUTO_TARGET_FACTOR:g}x a step of the running decodes alone, or more when prompts wait beside "
               "answers about to end (their backlog spread over the decodes' steps left) or queue (the share of "
               "the time their tokens are of --max-num-batched-tokens) or arrive faster than the engine serves them "
               "(the share their pace needs while the requests outgrow the engine), up to "
               f"{MAX_QUEUE_STEPS:g} decode steps a step, and a burst beyond that "
               "whole while the token gaps its whole queue would delay stay within "
               f"{DEFAULT_SHARE:.1%}% of the load's; a multiple such as "
               "'3x': a bound of that many times a step of the decodes alone, on this machine, whatever waits; "
               "'off': no cap (docs/server.md)")
    p.add("--long-prefill-token-threshold", default=d["long_prefill_token_threshold"], type=non_negative_int,
          help="with chunked prefill, a prompt computes at most this many tokens a step, so one long prompt "
               "leaves room in the step for others (not while it is the only request; 0: no cap), as vLLM's")
    p.add("--scheduling-policy", default=d["scheduling_policy"], choices=SCHEDULING_POLICIES,
          help="fcfs: first come, first served; priority: by each request's `priority` (lower first), then "
               "arrival")
    p.add("--async-scheduling", default=d["async_scheduling"], boolean=True,
          help="schedule each step while the one before runs, decodes on the token it samples (default: on "
               "with a GPU, off on a CPU; not with TP, PP or speculative decoding; docs/server.md)")
    # vLLM 0.32's admission knobs, with its meanings (core/step_limits.py)
    p.add("--max-num-active-seqs", type=positive_int,
          help="sequences admitted into running at once, at most --max-num-seqs (default: --max-num-seqs)")
    p.add("--max-num-scheduled-tokens", type=positive_int,
          help="tokens a step computes, at most --max-num-batched-tokens (default: --max-num-batched-tokens)")
    p.add("--long-prefill-token-threshold-adaptive", default=d["long_prefill_token_threshold_adaptive"],
          boolean=True, help="floor --long-prefill-token-threshold at the step's fair share: its tokens over the "
                             "requests waiting or running")
    p.add("--watermark", default=d["watermark"], type=float,
          help="share of the KV cache's blocks, in [0, 1), that a waiting or preempted request must leave free "
               "to be admitted while others run (0: none)")
    p.add("--scheduler-reserve-full-isl", default=d["scheduler_reserve_full_isl"], boolean=True,
          help="admit a prompt only if all of it fits in the KV cache beside the running requests, not just its "
               "first chunk (default: on)")
    p.add("--prefill-schedule-interval", default=d["prefill_schedule_interval"], type=positive_int,
          help="while decodes run, prompts compute only every Nth step (data-parallel ranks then carry prompts "
               "in the same steps)")
    p.add("--scheduler-cls", help="vLLM's scheduler class: accepted only as vLLM's own default, whose work "
                                  "Pagoda's scheduler does")
    p.add("--disable-chunked-mm-input", default=d["disable_chunked_mm_input"], boolean=True,
          help="accepted for vLLM command lines: Pagoda's inputs are text, with no multimodal item to keep whole")
    p.add("--enable-prefix-caching", default=d["enable_prefix_caching"], boolean=True)
    p.add("--enable-chunked-prefill", default=d["enable_chunked_prefill"], boolean=True)
    p.add("--gpu-memory-utilization", default=d["gpu_memory_utilization"], type=positive_float)
    p.add("--kv-cache-memory", type=positive_float, help="GiB of KV cache (overrides the GPU fraction)")
    p.add("--attention-backend", default=d["attention_backend"])
    p.add("--quantization", choices=METHODS,
          help="int8 / int4 / fp8 quantize float weights while loading (weight-only, except fp8 on GPUs with "
               "FP8 tensor cores); gptq / awq / fp8 checkpoints (quant_method fp8 or compressed-tensors) are "
               "found from config.json without this flag")
    p.add("--quantization-group-size", type=int, choices=GROUP_SIZES,
          help="input columns per int4 scale and zero: 32, 64 or 128 (less memory, more error); unset: 32")
    p.add("--swap-space", type=non_negative_float,
          help="GiB of host memory per worker for swapped-out KV blocks (default: 4 on a GPU, 0.5 on a CPU)")
    p.add("--preemption-mode", choices=PREEMPTION_MODES,
          help="when KV blocks run out: swap the preempted sequence out, or drop and recompute it "
               "(default: swap when --swap-space > 0)")
    p.add("--enable-lora", default=d["enable_lora"], boolean=True,
          help="serve LoRA adapters (--lora-modules) beside the base model; see docs/lora.md")
    p.add("--max-loras", default=d["max_loras"], type=positive_int,
          help="adapters one step may run at once (device slots)")
    p.add("--max-lora-rank", default=d["max_lora_rank"], type=positive_int, help="the largest adapter rank")
    p.add("--max-cpu-loras", type=positive_int, help="adapters kept in host memory (default: --max-loras)")
    env_modules = os.environ.get(env_name("--lora-modules"))
    try:
        default_modules = [lora_module(m) for m in env_modules.split()] if env_modules else None
    except ValueError:
        parser.error(f"argument --lora-modules: invalid value {env_modules!r} in {env_name('--lora-modules')}")
    parser.add_argument("--lora-modules", nargs="+", type=lora_module, default=default_modules,
                        help="adapters clients choose by `model`: NAME=PATH (a PEFT directory or Hub id) or "
                             '\'{"name": ..., "path": ..., "base_model_name": ...}\' (needs --enable-lora) '
                             f"[env {env_name('--lora-modules')}, space-separated]")
    p.add("--allow-runtime-lora-updating", default=ServerArgs.allow_runtime_lora_updating, boolean=True,
          help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter ({\"lora_name\", \"lora_path\"}); "
               "off by default: it lets a client make the server read a path")
    p.add("--speculative-config", type=json_object,
          help='speculative decoding, as vLLM: \'{"method": "ngram", "num_speculative_tokens": 4, '
               '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' drafts by prompt lookup (over the prompt and '
               'the output so far; any device, with TP and PP); \'{"model": PATH, "num_speculative_tokens": 4}\' '
               'drafts with a smaller model sharing the tokenizer (its own KV cache, taken from the same memory '
               'budget; with TP and PP it runs unsharded on rank 0). Outputs keep the target\'s distribution '
               '(greedy: identical). Costs: each step computes 1 + k tokens per speculating sequence, wasted where '
               'drafts are rejected, and KV slots for the drafts; requests with logprobs, penalties or structured '
               'outputs do not speculate. See docs/speculative-decoding.md')
    p.add("--kv-events-config", type=json_object,
          help='publish the prefix cache\'s changes as vLLM does: \'{"enable_kv_cache_events": true, "publisher": '
               '"zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv"}\' (BlockStored, '
               'BlockRemoved, AllBlocksCleared over ZMQ PUB; `pagoda router --policy precise` reads them). '
               'See docs/router.md')
    p.add("--kv-transfer-config", type=json_object,
          help='prefill/decode disaggregation as vLLM\'s: \'{"kv_connector": "NixlConnector", "kv_role": '
               '"kv_producer" | "kv_consumer" | "kv_both"}\' (KV blocks pulled over NIXL; the side channel on '
               'VLLM_NIXL_SIDE_CHANNEL_HOST / _PORT). See docs/disaggregation.md')
    p.add("--kv-cache-dtype", default=d["kv_cache_dtype"], choices=KV_CACHE_DTYPES,
          help="auto: the model's dtype; fp8 (= fp8_e4m3) or fp8_e5m2: keys and values in 8 bits with per-layer "
               "scales, twice the blocks in the same memory")
    p.add("--calculate-kv-scales", default=d["calculate_kv_scales"], boolean=True,
          help="fp8 KV cache: calibrate the key/value scales on the first batch (else the checkpoint's, or 1.0)")
    p.add("--disable-hybrid-kv-cache-manager", default=d["disable_hybrid_kv_cache_manager"], boolean=True,
          help="a model mixing full and sliding-window layers (Gemma 2/3, gpt-oss) keeps full-length KV for its "
               "windowed layers too (by default they keep only their window's blocks; see docs/models.md)")
    p.add("--enforce-eager", default=d["enforce_eager"], boolean=True,
          help="no CUDA graphs: every step runs eagerly (by default, with CUDA, decode steps replay graphs "
               "captured at start-up; see docs/gpu.md)")
    p.add("--compilation-config", type=json_object,
          help='CUDA graphs, as vLLM: \'{"cudagraph_capture_sizes": [1, 2, 4, 8]}\' sets the decode batch sizes '
               "captured (default 1, 2, 4, then every multiple of 8 up to --max-num-seqs); other keys are refused. "
               "Also -O JSON")
    p.parser.add_argument("-O", dest="compilation_config", type=json_object, default=argparse.SUPPRESS,
                          help="--compilation-config's short form")
    p.add("--trust-remote-code", default=d["trust_remote_code"], boolean=True,
          help="let transformers run the model repository's own configuration/tokenizer code")
    p.add("--disable-log-stats", default=d["disable_log_stats"], boolean=True,
          help="no periodic stats log line (throughput, requests, KV-cache use)")
    p.add("--stats-log-interval", default=d["stats_log_interval"], type=positive_float,
          help="seconds between stats log lines")
    p.add("--seed", default=d["seed"], type=int)
    p.add("--max-queued-requests", type=non_negative_int,
          help="requests allowed to wait beyond --max-num-seqs; more get 429 (default: 4 x max-num-seqs)")
    p.add("--max-num-queued-reqs", type=non_negative_int,
          help="vLLM's: the most requests in flight (waiting or running; a request with n choices counts n) in "
               "this API server; more get 503, so that a client or router retries another instance (default: "
               "no limit)")
    p.add("--max-num-queued-tokens", type=token_count,
          help="vLLM's: the most prompt tokens of requests still in their prefill (a prompt counts whole until "
               "its first output token); while the backlog is at it, new requests get 503. 32k = 32000, 32K = "
               "32768 (default: no limit)")
    p.add("--stream-interval", default=ServerArgs.stream_interval, type=positive_int,
          help="vLLM's: streamed responses send a choice's first token at once, then its tokens in chunks of N, "
               "the rest when it ends (1: every token as it comes); non-streamed answers are unaffected")
    p.add("--shutdown-timeout", default=ServerArgs.shutdown_timeout, type=non_negative_float,
          help="seconds running requests get to finish after SIGTERM")
    p.add("--log-level", default=ServerArgs.log_level, choices=LOG_LEVELS)
    p.add("--trust-request-chat-template", default=ServerArgs.trust_request_chat_template, boolean=True,
          help="accept a chat_template in requests (a client's Jinja template then runs on the server)")
    p.add("--enable-auto-tool-choice", default=ServerArgs.enable_auto_tool_choice, boolean=True,
          help='answer tool_choice "auto" by parsing the model\'s output for tool calls (needs --tool-call-parser)')
    p.add("--tool-call-parser", choices=sorted(TOOL_PARSERS), help="the model's tool-call format")
    p.add("--reasoning-parser", choices=REASONING_PARSERS,
          help="thinking models (DeepSeek-R1 and its distills, Qwen3): move the <think> text out of `content` "
               "into `reasoning`; tool calls and structured outputs apply to the text after it")
    p.add("--max-stored-responses", default=ServerArgs.max_stored_responses, type=non_negative_int,
          help="Responses API: responses kept in memory for GET /v1/responses/{id} and previous_response_id; "
               "beyond it the least recently used is dropped (0: none kept)")
    p.add("--enable-reasoning", default=ServerArgs.enable_reasoning, boolean=True,
          help="accepted for older vLLM command lines: --reasoning-parser alone turns reasoning on")
    p.add("--chat-template", type=chat_template_arg,
          help="the chat template to use instead of the model's (for models without one): a Jinja file, or "
               "the template itself")
    p.add("--generation-config", default=d["generation_config"],
          help="default sampling parameters: auto = the model's generation_config.json, vllm = none, or a "
               "directory holding a generation_config.json; a request's own values win")
    p.add("--allowed-origins", default=["*"], type=json_string_list,
          help='CORS: origins browsers may call from, a JSON list (e.g. \'["https://app.example"]\')')
    p.add("--allowed-methods", default=["*"], type=json_string_list, help="CORS: allowed methods, a JSON list")
    p.add("--allowed-headers", default=["*"], type=json_string_list, help="CORS: allowed headers, a JSON list")
    p.add("--allow-credentials", default=ServerArgs.allow_credentials, boolean=True,
          help="CORS: allow cookies and Authorization on cross-origin requests")
    p.add("--metrics-vllm-names", default=ServerArgs.metrics_vllm_names, boolean=True,
          help="also publish every metric under vLLM's name (vllm:..., same labels), for dashboards, "
               "autoscalers and the Gateway API Inference Extension written for vLLM")


_ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineArgs))
_SERVER_FIELDS = frozenset(f.name for f in dataclasses.fields(ServerArgs))


def split_args(ns: argparse.Namespace) -> tuple[EngineArgs, ServerArgs]:
    """The parsed flags, each to the arguments that own it (a flag's name is its field's name)."""
    values = vars(ns)
    invalid = [value.message for value in values.values() if isinstance(value, InvalidEnvValue)]
    if invalid:
        raise ValueError(invalid[0])
    engine = EngineArgs(**{name: value for name, value in values.items() if name in _ENGINE_FIELDS})
    server = ServerArgs(**{name: value for name, value in values.items() if name in _SERVER_FIELDS})
    if server.headless and engine.data_parallel_start_rank == 0:
        raise ValueError("--headless runs DP ranks without an API server: give it --data-parallel-start-rank > 0 "
                         "(the node with rank 0 serves the API)")
    if server.lora_modules and not engine.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    if server.lora_modules and len({m.name for m in server.lora_modules}) < len(server.lora_modules):
        raise ValueError("--lora-modules: each adapter needs its own name")
    if server.max_queued_requests is None:
        server = dataclasses.replace(server, max_queued_requests=4 * engine.max_num_seqs)
    return engine, server


def flagify(message: str) -> str:
    """Engine validation errors name fields (`block_size must ...`); the CLI user knows flags."""
    for name in sorted(_serve_flag_fields(), key=len, reverse=True):
        message = re.sub(rf"(?<![\w-]){name}(?!\w)", "--" + name.replace("_", "-"), message)
    return message


@functools.cache
def _serve_flag_fields() -> frozenset[str]:
    """The engine fields that `pagoda serve` has a flag for (read from the parser, not listed again)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_serve_arguments(parser)
    return frozenset(a.dest for a in parser._actions if a.option_strings and a.dest in _ENGINE_FIELDS)
