"""The attention layer: writes this step's K/V into the paged cache, then attends through it.

The batch's metadata and the chosen backend come from the forward context that the model runner
sets around each forward pass, so model code stays free of batching details.
"""

import threading
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagoda.attention import AttentionMetadata
from pagoda.layers.module import Module
from pagoda.layers.quantization import kv_scales

UNDECIDED = object()


@dataclass
class ForwardContext:
    metadata: AttentionMetadata
    backend: object  # module with write_kv_cache / paged_attention
    triton_ops: bool = False  # RMSNorm and rotary through the Triton kernels (layers.custom_ops)
    fused_ops: object = UNDECIDED  # the pass's kernel set, chosen by custom_ops.fused_ops on its first call


# per thread: engines in one process (an AsyncLLMEngine's thread beside an LLM's) run passes concurrently
_local = threading.local()


def current_forward_context() -> ForwardContext | None:
    return getattr(_local, "context", None)


@contextmanager
def forward_context(metadata: AttentionMetadata, backend, triton_ops: bool = False):
    previous = getattr(_local, "context", None)
    _local.context = ForwardContext(metadata, backend, triton_ops)
    try:
        yield
    finally:
        _local.context = previous


class Attention(Module):
    """sliding_window: each query sees only the last ``sliding_window`` positions, itself included (Mistral,
    Gemma's local layers); logit_softcap: scores become cap * tanh(scores / cap) before the softmax (Gemma 2)."""

    def __init__(self, num_heads: int, head_size: int, num_kv_heads: int, scale: float,
                 sliding_window: int | None = None, logit_softcap: float | None = None):
        super().__init__()
        self.num_heads, self.head_size, self.num_kv_heads, self.scale = num_heads, head_size, num_kv_heads, scale
        self.sliding_window, self.logit_softcap = sliding_window, logit_softcap
        self._variant = {} if sliding_window is None and logit_softcap is None else \
            dict(sliding_window=sliding_window, logit_softcap=logit_softcap)
        # [2, num_blocks, block_size, num_kv_heads, head_size]; assigned by the runner once allocated
        self.kv_cache: torch.Tensor | None = None
        # an fp8 cache stores k / k_scale and v / v_scale (layers.quantization.kv_scales): from the checkpoint,
        # else 1.0, or calibrated on the first batch written (calculate_kv_scales)
        self.k_scale, self.v_scale = 1.0, 1.0
        self.calculate_kv_scales = False
        self.kv_group = 0  # its KV cache group (core.kv_cache_groups), whose block tables it reads; set by the runner

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None = None
                ) -> torch.Tensor:
        """q [T, Hq*D], k/v [T, Hkv*D] -> [T, Hq*D]. sinks [Hq] float32 (gpt-oss): a logit per head that joins
        each softmax's denominator and adds nothing to the output."""
        ctx = _local.context
        q = q.view(-1, self.num_heads, self.head_size)
        k = k.view(-1, self.num_kv_heads, self.head_size)
        v = v.view(-1, self.num_kv_heads, self.head_size)
        metadata = ctx.metadata if not self.kv_group else ctx.metadata.groups[self.kv_group]
        if self.kv_cache is None:  # memory-profiling pass before the cache exists (its output is not read)
            return self._attend_without_cache(q, k, v, metadata).flatten(1)
        variant = self._variant if sinks is None else {**self._variant, "sinks": sinks}
        if not kv_scales.is_fp8(self.kv_cache):
            ctx.backend.write_kv_cache(k, v, self.kv_cache, metadata.slot_mapping)
            return ctx.backend.paged_attention(q, self.kv_cache, metadata, self.scale, **variant).flatten(1)
        if self.calculate_kv_scales:
            kv_scales.calibrate(self, k, v)
        ctx.backend.write_kv_cache(k, v, self.kv_cache, metadata.slot_mapping, self.k_scale, self.v_scale)
        return ctx.backend.paged_attention(q, self.kv_cache, metadata, self.scale, self.k_scale,
                                           self.v_scale, **variant).flatten(1)

    def _attend_without_cache(self, q, k, v, metadata: AttentionMetadata) -> torch.Tensor:
        out = torch.empty_like(q)
        start = 0
        for q_len in metadata.query_lens_cpu:
            sl = slice(start, start + q_len)
            o = F.scaled_dot_product_attention(
                q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1),
                is_causal=True, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads)
            out[sl] = o.transpose(0, 1)
            start += q_len
        return out
