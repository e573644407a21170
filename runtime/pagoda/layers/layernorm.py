"""RMSNorm, optionally fused with the residual add (Triton or C++ kernels when ``custom_ops`` picks them)."""

import torch
from torch import nn

from pagoda.layers import custom_ops
from pagoda.layers.linear import copy_checked
from pagoda.layers.module import Module


class RMSNorm(Module):
    """weight_offset: added to the checkpoint's weight once, at load (Gemma's norms multiply by 1 + w), so the
    kernels see a plain weight."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, weight_offset: float = 0.0):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = self._load_weight
        self.weight_offset = weight_offset

    def _load_weight(self, param, loaded, shard_id=None):
        copy_checked(param, loaded[:])
        if self.weight_offset:
            param.data += self.weight_offset

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        ops = custom_ops.fused_ops(x)
        if residual is None:
            return self._norm(x) if ops is None else ops.rms_norm(x, self.weight, self.eps)
        if ops is not None:
            return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        residual = x + residual
        return self._norm(residual), residual
