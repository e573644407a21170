"""Per-tensor scales of an fp8 KV cache: a cached key is stored as fp8(k / k_scale) and read back as
stored * k_scale (values alike with v_scale), one k_scale and one v_scale per attention layer.

Where they come from, as in vLLM: the checkpoint's ``k_scale`` / ``v_scale`` (or the older ``kv_scale``, or
``k_proj.output_scale`` / ``v_proj.output_scale``) where it has them; else 1.0; or, with
``calculate_kv_scales``, calibrated on the first batch each layer caches: the largest |k| maps to
K_SCALE_TARGET, the largest |v| to V_SCALE_TARGET (vLLM's VLLM_K_SCALE_CONSTANT / VLLM_V_SCALE_CONSTANT),
leaving headroom below e4m3's 448 for later batches with larger activations."""

import logging
import re

import torch

from pagoda.layers.quantization.fp8_cast import upcast

logger = logging.getLogger(__name__)

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
K_SCALE_TARGET = 200.0
V_SCALE_TARGET = 100.0

# <...>.self_attn[.attn | .k_proj | .v_proj].{k,v,kv,q,prob}_scale, and <...>.self_attn.{k,v}_proj.output_scale
_SCALE_NAME = re.compile(r"^(?P<prefix>.*\.self_attn)\.(?:attn\.|[kv]_proj\.)?(?P<which>k|v|kv|q|prob)_scale$")
_OUTPUT_SCALE_NAME = re.compile(r"^(?P<prefix>.*\.self_attn)\.(?P<which>k|v)_proj\.output_scale$")


def is_fp8(tensor: torch.Tensor) -> bool:
    return tensor.dtype in FP8_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x / scale in ``dtype``, saturated at its largest finite value (fp8 e4m3 has no infinity). Multiplies
    by the reciprocal in float32, as the Triton write kernel does, so both round the same products."""
    limit = fp8_max(dtype)
    return (x.float() * (1.0 / scale)).clamp_(-limit, limit).to(dtype)


def dequantize(stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    out = upcast(stored, dtype)
    return out if scale == 1.0 else out.mul_(scale)


def checkpoint_kv_scale(name: str) -> tuple[str, str] | None:
    """(the attention module's name, "k" | "v" | "kv" | "q" | "prob") for a checkpoint's KV-cache scale
    tensor, or None for any other tensor. q and prob scales (fp8 attention math) are read and not used."""
    match = _SCALE_NAME.match(name) or _OUTPUT_SCALE_NAME.match(name)
    if match is None:
        return None
    return match["prefix"] + ".attn", match["which"]


def assign_checkpoint_scales(model: torch.nn.Module, found: dict[str, dict[str, float]]) -> int:
    """Give each attention layer its scales from ``found`` ({module name: {"k": s, "v": s}}); layers of
    other pipeline stages are skipped. Returns the number of layers that got scales."""
    modules = dict(model.named_modules())
    assigned = 0
    for name, scales in found.items():
        layer = modules.get(name)
        if layer is None or not hasattr(layer, "k_scale"):
            continue
        kv = scales.get("kv")
        layer.k_scale = scales.get("k", kv if kv is not None else layer.k_scale)
        layer.v_scale = scales.get("v", kv if kv is not None else layer.v_scale)
        assigned += 1
    return assigned


def scale_value(loaded) -> float:
    """A checkpoint scale (a scalar, [1], or one per TP shard as some writers save it) as one float: the
    largest, so no shard's values overflow."""
    return float(loaded[...].float().max())  # [...]: safetensors slices of 0-dim tensors refuse [:]


def calibrate(layer, key: torch.Tensor, value: torch.Tensor) -> None:
    """Set the layer's k_scale and v_scale from this batch (its first), once."""
    layer.calculate_kv_scales = False
    k_max, v_max = float(key.abs().max()), float(value.abs().max())
    if k_max > 0:
        layer.k_scale = k_max / K_SCALE_TARGET
    if v_max > 0:
        layer.v_scale = v_max / V_SCALE_TARGET
