"""Which weight quantization a model runs with, validated once at configuration time (torch-free).

``quantization`` names the scheme as vLLM does: ``int8``, ``int4`` and ``fp8`` quantize a float checkpoint's
linear layers while it loads; ``gptq``, ``awq`` and fp8 checkpoints (vLLM's ``fp8`` format, and
``compressed-tensors`` FP8) are already quantized, found from the ``quantization_config`` of their config.json
(so they need no argument)."""

from dataclasses import dataclass

from pagoda.errors import InvalidParam

ONLINE_METHODS = ("int8", "int4", "fp8")
CHECKPOINT_METHODS = ("gptq", "awq")  # fp8 is both: online, or found from an fp8 checkpoint
METHODS = ONLINE_METHODS + CHECKPOINT_METHODS
GROUP_SIZES = (32, 64, 128)  # int4 group sizes (input columns per scale and zero)
# Round-to-nearest without calibration loses least with small groups: 32, as GGUF's Q4 formats use.
# 128 saves 0.09 bytes a weight (a bfloat16 scale and zero per group) for more error.
DEFAULT_GROUP_SIZE = 32


@dataclass(frozen=True)
class QuantizationConfig:
    method: str  # int8 | int4 | gptq | awq | fp8
    group_size: int | None = None  # input columns per scale, for int4, gptq and awq (int8 scales whole rows)
    zero_offset: int = 0  # gptq: added to the stored zero points (1 for the original "gptq" format)
    # fp8: where the weights come from ("online": quantized while loading, per output channel; "fp8": vLLM's
    # checkpoint format; "compressed-tensors"), the checkpoint's weight-scale granularity ("tensor" |
    # "channel" | "block"), its [output, input] block for "block", and the scale tensor's name
    fp8_format: str | None = None
    fp8_strategy: str | None = None
    fp8_block: tuple[int, int] | None = None
    fp8_scale_name: str = "weight_scale"


def check_quantization_args(quantization: str | None, group_size: int | None) -> None:
    """Checks that need no model: run before anything is read or converted."""
    if quantization is not None and quantization not in METHODS:
        raise InvalidParam("quantization", f"quantization must be one of {', '.join(METHODS)} (or unset); got {quantization!r}")
    if group_size is None:
        return
    if quantization not in ("int4", None):
        raise InvalidParam("quantization_group_size", f"quantization_group_size applies to quantization='int4' only; got it with "
                         f"quantization={quantization!r}")
    if group_size not in GROUP_SIZES:
        raise InvalidParam("quantization_group_size", f"quantization_group_size must be one of {', '.join(map(str, sorted(GROUP_SIZES)))}; "
                         f"got {group_size!r}")


def checkpoint_quantization(hf_config) -> QuantizationConfig | None:
    """The quantization a checkpoint was saved with (config.json's ``quantization_config``), or None.
    Formats Pagoda cannot run raise, naming what it does run."""
    qc = getattr(hf_config, "quantization_config", None)
    if not qc:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = str(qc.get("quant_method", "")).lower()
    if method == "gptq":
        return _gptq(qc)
    if method == "awq":
        return _awq(qc)
    if method == "fp8":
        return _vllm_fp8(qc)
    if method == "compressed-tensors":
        return _compressed_tensors_fp8(qc)
    if method == "mxfp4" and (getattr(hf_config, "architectures", None) or [None])[0] == "GptOssForCausalLM":
        return None  # gpt-oss's experts: dequantized to the model's dtype as they load (models.gpt_oss)
    raise ValueError(f"quantized checkpoints with quant_method={method or 'unknown'!r} are not supported: "
                     "Pagoda loads GPTQ and AWQ int4 checkpoints and FP8 checkpoints (quant_method fp8 or "
                     "compressed-tensors), or quantizes float16/bfloat16/float32 weights itself with "
                     "quantization='int8', 'int4' or 'fp8'")


def _only_lm_head_ignored(names, key: str, fmt: str) -> list[str]:
    """Pagoda quantizes every linear layer of the decoder (the LM head never): a checkpoint that leaves
    others in float cannot load."""
    others = [n for n in names or [] if not str(n).removeprefix("re:").lstrip(".*").endswith("lm_head")]
    return [f"{key}={others} (Pagoda runs {fmt} checkpoints whose every decoder linear layer is FP8)"] if others \
        else []


def _block(size, problems: list[str], key: str) -> tuple[int, int] | None:
    if size is None:
        return None
    if not (isinstance(size, (list, tuple)) and len(size) == 2 and all(isinstance(v, int) and v > 0 for v in size)):
        problems.append(f"{key}={size!r} (two positive integers: [output, input])")
        return None
    return int(size[0]), int(size[1])


def _vllm_fp8(qc: dict) -> QuantizationConfig:
    """vLLM's fp8 format: ``weight`` float8_e4m3fn with ``weight_scale`` (one per tensor), or with
    ``weight_block_size`` [bn, bk] a ``weight_scale_inv`` per block; ``input_scale`` for static activations."""
    problems = _only_lm_head_ignored(qc.get("ignored_layers"), "ignored_layers", "fp8")
    fmt = str(qc.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        problems.append(f"fmt={fmt!r} (Pagoda reads e4m3 weights)")
    block = _block(qc.get("weight_block_size"), problems, "weight_block_size")
    if problems:
        raise ValueError("unsupported fp8 checkpoint: " + "; ".join(problems))
    if block is not None:
        return QuantizationConfig("fp8", fp8_format="fp8", fp8_strategy="block", fp8_block=block,
                                  fp8_scale_name="weight_scale_inv")
    return QuantizationConfig("fp8", fp8_format="fp8", fp8_strategy="tensor")


def _compressed_tensors_fp8(qc: dict) -> QuantizationConfig:
    """compressed-tensors (llm-compressor's exports) with FP8 weights: ``weight`` float8_e4m3fn and
    ``weight_scale`` [1] (tensor), [N, 1] (channel) or [N / bn, K / bk] (block)."""
    problems = _only_lm_head_ignored(qc.get("ignore"), "ignore", "compressed-tensors")
    fmt = qc.get("format", "float-quantized")
    if fmt not in ("float-quantized", "naive-quantized"):
        problems.append(f"format={fmt!r} (Pagoda reads float-quantized FP8)")
    groups = list((qc.get("config_groups") or {}).values())
    schemes = {str(g.get("weights")) for g in groups}
    if len(schemes) != 1:
        problems.append(f"{len(groups)} config_groups with {len(schemes)} weight schemes (Pagoda reads one)")
        raise ValueError("unsupported compressed-tensors checkpoint: " + "; ".join(problems))
    weights = groups[0].get("weights") or {}
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        problems.append(f"weights type={weights.get('type')!r} num_bits={weights.get('num_bits')!r} (Pagoda reads "
                        "float 8-bit weights)")
    if weights.get("symmetric") is False:
        problems.append("asymmetric weights (FP8 weights are symmetric)")
    if weights.get("dynamic"):
        problems.append("dynamic weight scales")
    strategy = weights.get("strategy", "tensor")
    block = None
    if strategy == "block":
        block = _block(weights.get("block_structure"), problems, "block_structure")
        if block is None and "block_structure" not in weights:
            problems.append("strategy=block without block_structure")
    elif strategy not in ("tensor", "channel"):
        problems.append(f"weights strategy={strategy!r} (Pagoda reads tensor, channel and block)")
    activations = groups[0].get("input_activations")
    if activations and (activations.get("type") != "float" or activations.get("num_bits") != 8):
        problems.append(f"input_activations {activations} (Pagoda reads FP8 or unquantized activations)")
    if problems:
        raise ValueError("unsupported compressed-tensors checkpoint: " + "; ".join(problems))
    return QuantizationConfig("fp8", fp8_format="compressed-tensors", fp8_strategy=strategy, fp8_block=block)


def _gptq(qc: dict) -> QuantizationConfig:
    problems = []
    if qc.get("bits") != 4:
        problems.append(f"bits={qc.get('bits')} (Pagoda runs bits=4)")
    if qc.get("group_size") not in GROUP_SIZES:
        problems.append(f"group_size={qc.get('group_size')} (Pagoda runs 32, 64 or 128)")
    if qc.get("desc_act"):
        problems.append("desc_act=true (act-order; Pagoda runs desc_act=false)")
    if qc.get("lm_head"):
        problems.append("lm_head=true (a quantized LM head)")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        problems.append(f"checkpoint_format={fmt!r} (Pagoda reads gptq and gptq_v2)")
    if problems:
        raise ValueError("unsupported GPTQ checkpoint: " + "; ".join(problems))
    # the original format stores zero points minus one; gptq_v2 stores them as they are
    return QuantizationConfig("gptq", qc["group_size"], zero_offset=1 if fmt == "gptq" else 0)


def _awq(qc: dict) -> QuantizationConfig:
    bits, group_size = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size"))
    problems = []
    if bits != 4:
        problems.append(f"bits={bits} (Pagoda runs bits=4)")
    if group_size not in GROUP_SIZES:
        problems.append(f"group_size={group_size} (Pagoda runs 32, 64 or 128)")
    if not qc.get("zero_point", True):
        problems.append("zero_point=false (Pagoda runs zero_point=true)")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        problems.append(f"version={version!r} (Pagoda reads AutoAWQ's gemm layout)")
    if qc.get("modules_to_not_convert"):
        problems.append(f"modules_to_not_convert={qc['modules_to_not_convert']} (every linear layer must be "
                        "quantized)")
    if problems:
        raise ValueError("unsupported AWQ checkpoint: " + "; ".join(problems))
    return QuantizationConfig("awq", group_size)


def linear_input_sizes(hf_config, tp_size: int) -> dict[str, int]:
    """Input columns each rank's share of every linear layer has (row-parallel layers split them)."""
    hidden = hf_config.hidden_size
    head_dim = getattr(hf_config, "head_dim", None) or hidden // hf_config.num_attention_heads
    return {"qkv_proj / gate_up_proj (hidden_size)": hidden,
            "o_proj (attention heads x head_dim / tensor_parallel_size)":
                hf_config.num_attention_heads * head_dim // tp_size,
            "down_proj (intermediate_size / tensor_parallel_size)": hf_config.intermediate_size // tp_size}


def _check_fp8_blocks(config: QuantizationConfig, hf_config, tp_size: int) -> None:
    """Block-wise scales split with the weights: each rank's input columns must be whole blocks (output rows
    need not be: scales are spread to rows before the layers shard them)."""
    if config.fp8_strategy != "block" or tp_size == 1:
        return
    block_k = config.fp8_block[1]
    for what, n in linear_input_sizes(hf_config, tp_size).items():
        if n % block_k:
            raise ValueError(f"the checkpoint's fp8 weight block ({block_k} input columns) does not divide the "
                             f"input size of {what}: {n} with tensor_parallel_size={tp_size}")


def resolve_quantization(quantization: str | None, group_size: int | None, hf_config,
                         tp_size: int = 1) -> QuantizationConfig | None:
    """The scheme to run: the checkpoint's own if it has one, else the requested online one."""
    check_quantization_args(quantization, group_size)
    saved = checkpoint_quantization(hf_config)
    if saved is not None:
        if quantization not in (None, saved.method):
            raise InvalidParam("quantization", f"quantization={quantization!r} cannot apply: the checkpoint is already quantized "
                             f"with {saved.method} (leave quantization unset or pass {saved.method!r})")
        config = saved
        if config.method == "fp8":
            _check_fp8_blocks(config, hf_config, tp_size)
            return config
    elif quantization in CHECKPOINT_METHODS:
        raise InvalidParam("quantization", f"quantization={quantization!r} needs a checkpoint quantized with {quantization}, but "
                         "config.json has no quantization_config; to quantize float weights use 'int8' or 'int4'")
    elif quantization is None:
        if group_size is not None:
            raise InvalidParam("quantization_group_size", "quantization_group_size is set but quantization is not: pass quantization='int4'")
        return None
    elif quantization == "int8":
        return QuantizationConfig("int8")
    elif quantization == "fp8":
        return QuantizationConfig("fp8", fp8_format="online", fp8_strategy="channel")
    else:
        config = QuantizationConfig("int4", group_size or DEFAULT_GROUP_SIZE)
    for what, n in linear_input_sizes(hf_config, tp_size).items():
        if n % config.group_size:
            name = "quantization_group_size" if config.method == "int4" else "the checkpoint's group_size"
            raise ValueError(f"{name} ({config.group_size}) does not divide the input size of {what}: {n} "
                             f"with tensor_parallel_size={tp_size}")
    return config
