"""The KV cache's share of a GPU: gpu_memory_utilization of the device minus the peak of one forward pass
at the full token budget (vLLM's profiling run)."""

import logging

import torch

from pagoda.attention import AttentionMetadata
from pagoda.layers.attention import forward_context
from pagoda.layers.moe import take_expert_tokens

logger = logging.getLogger(__name__)


def profile_free_gpu_memory(runner) -> int:
    """Bytes left for the KV cache on `runner`'s device (a ModelRunner whose model is loaded)."""
    device, model = runner.device, runner.model
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    sched = runner.config.scheduler
    num_tokens = min(sched.max_num_batched_tokens, sched.max_model_len * sched.max_num_seqs)
    seq_len = min(num_tokens, sched.max_model_len)
    lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
    input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    metadata = AttentionMetadata.build(lens, lens, [[]] * len(lens), torch.full((num_tokens,), -1), device)
    hidden_in = residual_in = None
    if not model.model.is_first:  # a later pipeline stage starts from hidden states
        hidden_in = torch.zeros(num_tokens, model.config.hidden_size, dtype=runner.dtype, device=device)
        residual_in = torch.zeros_like(hidden_in)
    with torch.inference_mode(), forward_context(metadata, runner.attn_backend, runner.triton_ops):
        hidden = model(input_ids, positions, hidden_in, residual_in)
        if runner.is_last_stage:
            model.compute_logits(hidden[-sched.max_num_seqs :])
    take_expert_tokens(model)  # not a request's routing
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    total = torch.cuda.get_device_properties(device).total_memory
    budget = int(total * runner.config.cache.gpu_memory_utilization) - peak
    logger.info("GPU memory: %.2f GiB total, %.2f GiB peak in the profiling pass, %.2f GiB for the KV cache",
                total / 2**30, peak / 2**30, budget / 2**30)
    torch.cuda.empty_cache()
    return max(budget, 0)
