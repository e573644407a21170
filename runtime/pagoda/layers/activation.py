"""Gated activations: act(gate) * up over a [T, 2 * I] gate|up tensor -> [T, I]."""

import torch
import torch.nn.functional as F

from pagoda.layers import custom_ops


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    ops = custom_ops.fused_ops(gate_up)
    if ops is not None:
        return ops.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU with the tanh approximation (Gemma's gelu_pytorch_tanh)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def clamped_swiglu(alpha: float, limit: float):
    """gpt-oss's experts (transformers' GptOssExperts): gate clamped above at limit, up to [-limit, limit],
    then (up + 1) * gate * sigmoid(alpha * gate). Our gate|up halves are its interleaved columns, split at load."""
    def act_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    return act_and_mul


GATED_ACTIVATIONS = {"silu": silu_and_mul, "gelu_tanh": gelu_tanh_and_mul}


def gated_activation(name: str, swiglu: tuple[float, float] | None = None):
    """swiglu: (alpha, limit) of gpt-oss's clamped SwiGLU, in place of the named activation."""
    if swiglu is not None:
        return clamped_swiglu(*swiglu)
    if name not in GATED_ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}: Pagoda supports {', '.join(GATED_ACTIVATIONS)}")
    return GATED_ACTIVATIONS[name]
