"""Rotary position embedding (neox style: rotate the two halves), with linear, Llama-3, LongRoPE and YaRN scaling.

Scaling only changes the inverse frequencies (and LongRoPE's magnitude), so it lives entirely in the cos/sin
cache.
"""

import math

import torch

from pagoda.layers import custom_ops
from pagoda.layers.module import Module


def inverse_frequencies(head_size: int, params: dict) -> torch.Tensor:
    base = float(params.get("rope_theta", 10000.0))
    inv_freq = 1.0 / (base ** (torch.arange(0, head_size, 2, dtype=torch.float64) / head_size))
    rope_type = params.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif rope_type == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(mid, smoothed, scaled)
    elif rope_type == "yarn":
        return yarn_inverse_frequencies(head_size, params)
    return inv_freq.float()


def _yarn_factor(params: dict) -> float:
    factor = params.get("factor")
    if factor is None:  # DeepSeek-V3 may leave it to the ratio of the lengths
        factor = float(params["max_position_embeddings"]) / float(params["original_max_position_embeddings"])
    return float(factor)


def yarn_inverse_frequencies(head_size: int, params: dict) -> torch.Tensor:
    """YaRN's blend of interpolated and original frequencies (transformers' _compute_yarn_parameters)."""
    base, factor = float(params.get("rope_theta", 10000.0)), _yarn_factor(params)
    original = float(params["original_max_position_embeddings"])
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations):
        return head_size * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_size - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, head_size, 2, dtype=torch.float32) / head_size)
    extrapolation = 1 - torch.clamp((torch.arange(head_size // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_magnitude(params: dict) -> float:
    """YaRN's attention factor on cos and sin."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor, mscale, mscale_all_dim = _yarn_factor(params), params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def longrope_inverse_frequencies(head_size: int, params: dict, factors: str) -> torch.Tensor:
    base = float(params.get("rope_theta", 10000.0))
    ext = torch.tensor(params[factors], dtype=torch.float32)
    return 1.0 / (ext * base ** (torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size))


def longrope_magnitude(params: dict) -> float:
    """LongRoPE's attention factor on cos and sin (transformers' default from the context extension)."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    original = float(params["original_max_position_embeddings"])
    factor = params.get("factor") or float(params["max_position_embeddings"]) / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def cos_sin_cache(head_size: int, max_position: int, params: dict) -> torch.Tensor:
    """[max_position, head_size]: cos in the first half, sin in the second. LongRoPE: positions below
    original_max_position_embeddings use the short factors, later ones the long factors (as vLLM; transformers
    switches a whole sequence once it grows past that length)."""
    positions = torch.arange(max_position, dtype=torch.float32)
    if params.get("rope_type") == "longrope":
        original = int(params["original_max_position_embeddings"])
        short = torch.outer(positions[:original], longrope_inverse_frequencies(head_size, params, "short_factor"))
        long = torch.outer(positions[original:], longrope_inverse_frequencies(head_size, params, "long_factor"))
        freqs = torch.cat([short, long])
        magnitude = longrope_magnitude(params)
        return torch.cat([freqs.cos() * magnitude, freqs.sin() * magnitude], dim=-1)
    freqs = torch.outer(positions, inverse_frequencies(head_size, params))  # [max_pos, D/2]
    magnitude = yarn_magnitude(params) if params.get("rope_type") == "yarn" else 1.0
    return torch.cat([freqs.cos() * magnitude, freqs.sin() * magnitude], dim=-1)


class RotaryEmbedding(Module):
    def __init__(self, head_size: int, max_position: int, params: dict):
        super().__init__()
        self.head_size = head_size
        self.register_buffer("cos_sin_cache", cos_sin_cache(head_size, max_position, params), persistent=False)

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor):
        """positions [T]; query [T, Hq*D]; key [T, Hkv*D] -> rotated (query, key)."""
        ops = custom_ops.fused_ops(query)
        if ops is not None:
            ops.apply_rotary_(positions, query, key, self.cos_sin_cache, self.head_size)
            return query, key
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)  # [T, D/2] each
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        x = x.view(shape[0], -1, self.head_size).float()  # [T, H, D]
        x1, x2 = x.chunk(2, dim=-1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(dtype).view(shape)
