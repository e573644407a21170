"""RMSNorm, optionally fused with the residual add (Triton or C++ kernels when ``custom_ops`` picks them)."""

import torch
from torch import nn

from pagoda.layers import custom_ops
from pagoda.layers.linear import copy_checked
from pagoda.layers.module import Module


class RMSNorm(Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = lambda param, loaded, shard_id=None: copy_checked(param, loaded[:])

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
