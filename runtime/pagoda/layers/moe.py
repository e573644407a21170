"""Mixture-of-experts MLP: a router picks each token's top-k experts, the experts' gated MLPs run over the
rows routed to them, grouped by expert, and their outputs are summed with the routing weights.

Each expert is a pair of the project's linear layers (so packing, the CPU bf16 matmul and online int8/int4
quantization cover experts as they cover any linear layer). Two paths:
- grouped (CPU, and quantized experts anywhere): tokens sorted by expert, one matmul per expert over all
  its rows, never one per token;
- fused (the Triton backend): the experts' weights stacked once and ``kernels.fused_moe`` runs every expert
  in one grouped-GEMM launch per matrix.

Parallelism: without expert parallelism every expert's matrices are split over the TP group as a dense MLP's
are; with it (``enable_expert_parallel``) each rank holds num_experts / tp_size whole experts. Attention is
TP either way, so every rank already holds every token: dispatch costs nothing, and the combine is the one
all-reduce a TP MLP costs anyway (docs/distributed.md). With data parallelism and expert parallelism the
experts split over every DP x TP rank and each layer exchanges tokens between the DP ranks
(``forward_across_dp``).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.distributed.parallel_state import (
    dp_all_gather_rows,
    dp_reduce_scatter_rows,
    get_parallel_state,
    tp_all_reduce,
)
from pagoda.layers import attention
from pagoda.layers.activation import gated_activation
from pagoda.layers.linear import UNSPLIT, MergedColumnParallelLinear, RowParallelLinear, copy_checked, divide
from pagoda.layers.module import Module


@dataclass(frozen=True)
class MoEOptions:
    num_experts: int
    top_k: int
    intermediate_size: int  # of each expert
    norm_topk_prob: bool  # renormalise the chosen experts' weights to sum to 1
    scoring: str = "softmax"  # of the router logits: "softmax" or "sigmoid"
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a dense expert every token takes, gated by a sigmoid
    expert_parallel: bool = False
    biases: bool = False  # gpt-oss: a bias on the router and on each expert's matrices
    swiglu: tuple[float, float] | None = None  # gpt-oss: (alpha, limit) of the clamped SwiGLU


def route(router_logits: torch.Tensor, options: MoEOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> (weights [T, top_k] float32, expert ids [T, top_k]), as transformers routes."""
    scores = router_logits.float()
    scores = scores.softmax(-1) if options.scoring == "softmax" else scores.sigmoid()
    weights, ids = torch.topk(scores, options.top_k, dim=-1)
    if options.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


class Router(Module):
    """The gate: [T, hidden] -> [T, num_experts] logits. Replicated and never quantized (as vLLM)."""

    def __init__(self, hidden_size: int, num_experts: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.weight.weight_loader = lambda param, loaded, shard_id=None: copy_checked(param, loaded[:])
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(num_experts), requires_grad=False)
            self.bias.weight_loader = self.weight.weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ExpertMLP(Module):
    """One expert: act(gate) * up, then down; ``matmul`` only (the MoE layer all-reduces once for all experts)."""

    def __init__(self, hidden_size: int, intermediate_size: int, split, bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias, split=split)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, split=split)
        # the down bias joins the partial sums once: on the rank holding the first split of each expert
        self.adds_down_bias = bias and self.down_proj.tp_rank == 0


class ExpertLoad:
    """Rows routed to each expert of one layer, summed on the device over the passes since the last ``take``
    (any rank's count is every rank's: the router is replicated)."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.counts: torch.Tensor | None = None

    def add(self, expert_ids: torch.Tensor) -> None:
        step = torch.bincount(expert_ids.flatten(), minlength=self.num_experts)
        self.counts = step if self.counts is None else self.counts + step

    def take(self) -> list[int]:
        counts, self.counts = self.counts, None
        return [0] * self.num_experts if counts is None else counts.tolist()


class SparseMoE(Module):
    def __init__(self, hidden_size: int, options: MoEOptions, activation: str, shared_expert: Module | None = None):
        super().__init__()
        state = get_parallel_state()
        self.options = options
        self.num_experts = options.num_experts
        if options.expert_parallel:  # over the TP group, or with data parallelism over every DP x TP rank
            self.num_local = divide(options.num_experts, state.ep_size, "number of experts")
            self.first_expert = state.ep_rank * self.num_local
            split = UNSPLIT
        else:
            self.num_local, self.first_expert, split = options.num_experts, 0, None
        self.tp_size = state.tp_size
        self.across_dp = options.expert_parallel and state.experts_across_dp
        self.gate = Router(hidden_size, options.num_experts, options.biases)
        self.experts = nn.ModuleList(ExpertMLP(hidden_size, options.intermediate_size, split, options.biases)
                                     for _ in range(self.num_local))
        self.act_and_mul = gated_activation(activation, options.swiglu)
        self.shared_expert = shared_expert
        self.shared_expert_gate = Router(hidden_size, 1) if shared_expert is not None else None
        self.load = ExpertLoad(options.num_experts)
        self._stacked: tuple[torch.Tensor, torch.Tensor] | None = None

    def local_expert(self, expert: int) -> int | None:
        """This rank's index of a global expert id, or None when another rank holds it."""
        local = expert - self.first_expert
        return local if 0 <= local < self.num_local else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        if self.across_dp:
            return self.forward_across_dp(x)
        weights, ids = self.choose_experts(x)
        self.load.add(ids)
        out = self.routed_experts(x, weights, ids)
        if self.tp_size > 1:  # TP: partial sums over each expert's split; EP: over this rank's experts
            out = tp_all_reduce(out)
        if self.shared_expert is not None:  # its down projection all-reduces on its own
            out = out + self.shared_output(x)
        return out

    def choose_experts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [T, hidden] -> (weights [T, top_k] float32, expert ids [T, top_k]); DeepSeek's routing overrides."""
        return route(self.gate(x), self.options)

    def shared_output(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert's share of the output: Qwen2-MoE's, gated by a sigmoid; DeepSeek's ungated."""
        return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    def forward_across_dp(self, x: torch.Tensor) -> torch.Tensor:
        """Experts over every DP x TP rank: all-gather every DP rank's tokens, run this rank's experts over
        all of them, reduce-scatter each DP rank's rows back to it, then sum over the TP shards. A rank with no
        work passes 0 rows (its dummy batch), so the collectives match (docs/distributed.md)."""
        everyone, counts = dp_all_gather_rows(x)
        weights, ids = self.choose_experts(everyone)
        mine = sum(counts[: get_parallel_state().dp_rank])
        self.load.add(ids[mine : mine + x.shape[0]])  # this DP rank's tokens: each rank counts its own
        out = dp_reduce_scatter_rows(self.routed_experts(everyone, weights, ids), counts)
        if self.tp_size > 1 and x.shape[0]:
            out = tp_all_reduce(out)
        if self.shared_expert is not None and x.shape[0]:  # (TP peers run the same batch: they skip alike)
            out = out + self.shared_output(x)
        return out

    def routed_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's experts' weighted sum over x's rows (rows routed elsewhere get nothing here)."""
        local_ids = ids - self.first_expert  # ids outside [0, num_local): another rank's experts
        context = attention.current_forward_context()
        if context is not None and context.triton_ops and self.fusable():
            from pagoda.kernels.fused_moe import fused_experts

            w13, w2 = self.stacked_weights()
            return fused_experts(x, w13, w2, local_ids, weights, self.act_and_mul)
        return self.grouped_experts(x, local_ids, weights)

    def grouped_experts(self, x: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Pairs (token, choice) sorted by expert; each expert multiplies all its rows at once."""
        top_k = local_ids.shape[1]
        flat = local_ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat.clamp(-1, self.num_local) + 1, minlength=self.num_local + 2).tolist()
        out = torch.zeros_like(x)
        start = counts[0]  # pairs of experts below this rank's sort first: skipped
        for expert, n in enumerate(counts[1 : self.num_local + 1]):
            if n:
                pairs = order[start : start + n]
                tokens = pairs // top_k
                layer = self.experts[expert]
                gate_up = layer.gate_up_proj.matmul(x.index_select(0, tokens), layer.gate_up_proj.bias)
                hidden = layer.down_proj.matmul(self.act_and_mul(gate_up),
                                                layer.down_proj.bias if layer.adds_down_bias else None)
                scale = weights.flatten().index_select(0, pairs).unsqueeze(1)
                # an expert's tokens are distinct; index_add_ would open an OpenMP region per call (tens of ms
                # each when a thread is descheduled, docs/benchmarks.md), index_put_ adds the same way without
                out.index_put_((tokens,), (hidden.float() * scale).to(x.dtype), accumulate=True)
            start += n
        return out

    def fusable(self) -> bool:
        """Plain float weights without biases (quantized or packed experts, and gpt-oss's, take the grouped
        path)."""
        first = self.experts[0] if self.num_local else None
        return first is not None and not self.options.biases and self.options.swiglu is None and all(
            getattr(m, "quant_method", None) is None and getattr(m, "packed_weight", None) is None
            for m in (first.gate_up_proj, first.down_proj))

    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[E, 2I, H] and [E, H, I], built once; each expert's weight becomes a view into them (no copy kept)."""
        if self._stacked is None:
            stacked = []
            for name in ("gate_up_proj", "down_proj"):
                layers = [getattr(expert, name) for expert in self.experts]
                whole = torch.stack([layer.weight.data for layer in layers])
                for i, layer in enumerate(layers):
                    layer.weight.data = whole[i]
                stacked.append(whole)
            self._stacked = (stacked[0], stacked[1])
        return self._stacked


def take_expert_tokens(model: nn.Module) -> dict[int, list[int]]:
    """Rows routed to each expert of each MoE layer since the last call, by layer index; counters reset."""
    return {index: layer.load.take() for index, layer in moe_layers(model)}


def moe_layers(model: nn.Module) -> list[tuple[int, SparseMoE]]:
    """(layer index, MoE layer) in forward order; found once."""
    layers = getattr(model, "_moe_layers", None)
    if layers is None:  # found once: a dense model answers [] at no cost from then on
        layers = [(int(name.split(".")[-2]), m) for name, m in model.named_modules() if isinstance(m, SparseMoE)]
        model._moe_layers = layers
    return layers


def needs_dummy_batches(model: nn.Module) -> bool:
    """MoE experts split over every DP x TP rank: a rank that computes nothing while the others step (no
    work, or a step with only finished sequences or swaps) must still run a dummy batch."""
    return get_parallel_state().experts_across_dp and bool(moe_layers(model))


@torch.inference_mode()
def run_dummy_batch(model: nn.Module, dtype: torch.dtype, device) -> None:
    """A DP rank with no work while others step: every MoE layer over 0 tokens, in forward order, so that
    its share of each layer's token exchange matches theirs (vLLM's dummy batch; no attention, no KV)."""
    for _, layer in moe_layers(model):
        layer(torch.empty((0, layer.gate.weight.shape[1]), dtype=dtype, device=device))
