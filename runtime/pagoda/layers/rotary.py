"""Rotary position embedding (neox style: rotate the two halves), with linear and Llama-3 scaling.

Scaling only changes the inverse frequencies, so it lives entirely in the cos/sin cache.
"""

import math

import torch

from pagoda.layers import custom_ops
from pagoda.layers.module import Module


def rope_parameters(config) -> dict:
    """rope_theta and the scaling dict, from either the transformers 5 or the older layout."""
    params = getattr(config, "rope_parameters", None)
    if params:
        params = dict(params)
    else:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


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
    return inv_freq.float()


class RotaryEmbedding(Module):
    def __init__(self, head_size: int, max_position: int, params: dict):
        super().__init__()
        self.head_size = head_size
        inv_freq = inverse_frequencies(head_size, params)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)  # [max_pos, D/2]
        # [max_pos, D]: cos in the first half, sin in the second
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

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
