"""Which weight quantization a model runs with, validated once at configuration time (torch-free).

``quantization`` names the scheme as vLLM does: ``int8`` and ``int4`` quantize a float checkpoint's linear
layers while it loads; ``gptq`` and ``awq`` are checkpoints already quantized, found from the
``quantization_config`` of their config.json (so they need no argument)."""

from dataclasses import dataclass

from pagoda.errors import InvalidParam

ONLINE_METHODS = ("int8", "int4")
CHECKPOINT_METHODS = ("gptq", "awq")
METHODS = ONLINE_METHODS + CHECKPOINT_METHODS
GROUP_SIZES = (32, 64, 128)  # int4 group sizes (input columns per scale and zero)
# Round-to-nearest without calibration loses least with small groups: 32, as GGUF's Q4 formats use.
# 128 saves 0.09 bytes a weight (a bfloat16 scale and zero per group) for more error.
DEFAULT_GROUP_SIZE = 32


@dataclass(frozen=True)
class QuantizationConfig:
    method: str  # int8 | int4 | gptq | awq
    group_size: int | None = None  # input columns per scale, for int4, gptq and awq (int8 scales whole rows)
    zero_offset: int = 0  # gptq: added to the stored zero points (1 for the original "gptq" format)


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
    raise ValueError(f"quantized checkpoints with quant_method={method or 'unknown'!r} are not supported: "
                     "Pagoda loads GPTQ and AWQ int4 checkpoints, or quantizes float16/bfloat16/float32 "
                     "weights itself with quantization='int8' or 'int4'")


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
    elif quantization in CHECKPOINT_METHODS:
        raise InvalidParam("quantization", f"quantization={quantization!r} needs a checkpoint quantized with {quantization}, but "
                         "config.json has no quantization_config; to quantize float weights use 'int8' or 'int4'")
    elif quantization is None:
        if group_size is not None:
            raise InvalidParam("quantization_group_size", "quantization_group_size is set but quantization is not: pass quantization='int4'")
        return None
    elif quantization == "int8":
        return QuantizationConfig("int8")
    else:
        config = QuantizationConfig("int4", group_size or DEFAULT_GROUP_SIZE)
    for what, n in linear_input_sizes(hf_config, tp_size).items():
        if n % config.group_size:
            name = "quantization_group_size" if config.method == "int4" else "the checkpoint's group_size"
            raise ValueError(f"{name} ({config.group_size}) does not divide the input size of {what}: {n} "
                             f"with tensor_parallel_size={tp_size}")
    return config
