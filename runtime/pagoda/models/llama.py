"""The Llama family: Llama (1-3.x), Mistral, Qwen2, Qwen3, Gemma 2/3, Phi-3 and the mixtures of experts Mixtral,
Qwen2-MoE, Qwen3-MoE and OLMoE share this one implementation.

Differences are options (``models.family.FamilyOptions``, read from config.json): attention bias (Qwen2),
per-head q/k RMSNorm (Qwen3, Gemma 3), tied embeddings, GQA, explicit head_dim, rope scaling (the rotary
layer), sliding windows and rope bases per layer, Gemma's (1 + w) norms, extra norms, GeGLU, soft-capping
and scaled embeddings, Phi-3's fused checkpoint tensors, experts in place of the MLP (``layers.moe``).
"""

import dataclasses

import torch
from torch import nn

from pagoda.distributed.parallel_state import get_parallel_state, pp_layer_range, tp_all_gather_last_dim
from pagoda.layers.activation import gated_activation
from pagoda.layers.attention import Attention
from pagoda.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagoda.layers.layernorm import RMSNorm
from pagoda.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagoda.layers.module import Module
from pagoda.layers.moe import MoEOptions, SparseMoE
from pagoda.layers.rotary import RotaryEmbedding
from pagoda.models import llama_layers_cpu
from pagoda.models.family import FamilyOptions, family_options, moe_config


class LlamaAttention(Module):
    def __init__(self, config, options: FamilyOptions, layer_index: int):
        super().__init__()
        hidden = config.hidden_size
        total_heads, total_kv = config.num_attention_heads, config.num_key_value_heads
        self.head_size = getattr(config, "head_dim", None) or hidden // total_heads
        self.qkv_proj = QKVParallelLinear(hidden, self.head_size, total_heads, total_kv, bias=options.qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_size
        self.kv_size = self.num_kv_heads * self.head_size
        self.o_proj = RowParallelLinear(total_heads * self.head_size, hidden, bias=options.o_bias)
        norm = lambda size: RMSNorm(size, config.rms_norm_eps, options.norm_weight_offset)  # noqa: E731
        self.q_norm = self.k_norm = None
        if options.qk_norm:
            self.q_norm, self.k_norm = norm(self.head_size), norm(self.head_size)
        self.qk_norm_full = options.qk_norm_full
        if self.qk_norm_full:  # over every head at once: under TP each rank gathers the others' heads first
            if self.qkv_proj.kv_replicas > 1:
                raise ValueError(f"tensor_parallel_size ({self.qkv_proj.tp_size}) must not exceed the number of "
                                 f"KV heads ({total_kv}) for {config.architectures[0]}'s q/k norm")
            self.q_norm, self.k_norm = norm(total_heads * self.head_size), norm(total_kv * self.head_size)
        self.clip_qkv = options.clip_qkv
        layer = options.layers[layer_index]
        self.rotary_emb = RotaryEmbedding(self.head_size, config.max_position_embeddings, layer.rope)
        scale = options.attn_scale or self.head_size**-0.5
        self.attn = Attention(self.num_heads, self.head_size, self.num_kv_heads, scale, layer.sliding_window,
                              options.attn_logit_softcap)
        self.sinks = None
        if options.attention_sinks:  # this rank's heads' sink logits
            self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32), requires_grad=False)
            rank, n = self.qkv_proj.tp_rank, self.num_heads
            self.sinks.weight_loader = lambda param, loaded, shard_id=None: param.data.copy_(
                loaded[rank * n : (rank + 1) * n])

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, keep_rows: torch.Tensor | None = None
                ) -> torch.Tensor:
        """hidden [T, hidden] -> [T, hidden], or [K, hidden] for keep_rows [K] (every row's K and V are cached)."""
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm_full:
            q, k = self._norm_all_heads(q, self.q_norm), self._norm_all_heads(k, self.k_norm)
        elif self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_size)).view(-1, self.q_size)
            k = self.k_norm(k.reshape(-1, self.head_size)).view(-1, self.kv_size)
        if self.clip_qkv is not None:  # after the norms, as OLMoE
            q, k, v = (x.clamp(-self.clip_qkv, self.clip_qkv) for x in (q, k, v))
        q, k = self.rotary_emb(positions, q.contiguous(), k.contiguous())
        attended = self.attn(q, k, v.contiguous(), self.sinks)  # [T, q_size]
        if keep_rows is not None:
            attended = attended.index_select(0, keep_rows)
        return self.o_proj(attended)

    def _norm_all_heads(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        tp_size = self.qkv_proj.tp_size
        if tp_size == 1:
            return norm(x.contiguous())
        width = x.shape[1]
        rank = self.qkv_proj.tp_rank
        return norm(tp_all_gather_last_dim(x.contiguous()))[:, rank * width : (rank + 1) * width]


class LlamaMLP(Module):
    def __init__(self, config, activation: str = "silu", intermediate_size: int | None = None):
        super().__init__()
        intermediate_size = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [intermediate_size] * 2)
        self.down_proj = RowParallelLinear(intermediate_size, config.hidden_size)
        self.act_and_mul = gated_activation(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))  # gate_up: [T, 2 * intermediate]


def make_mlp(config, options: FamilyOptions, layer_index: int) -> Module:
    """The layer's MLP: dense, or experts where the model has them on this layer."""
    moe = options.moe
    if moe is None or not moe.sparse_layers[layer_index]:
        return LlamaMLP(config, options.activation)
    shared = None
    if moe.shared_expert_intermediate_size:
        shared = LlamaMLP(config, options.activation, moe.shared_expert_intermediate_size)
    return SparseMoE(config.hidden_size, MoEOptions(
        moe.num_experts, moe.top_k, moe.intermediate_size, moe.norm_topk_prob, moe.scoring,
        moe.shared_expert_intermediate_size, options.expert_parallel, moe.biases, moe.swiglu), options.activation,
        shared)


class LlamaDecoderLayer(Module):
    """Pre-norm attention and MLP, the residual stream carried beside the hidden state (fused add + norm).
    With sandwich_norms (Gemma 2/3) the attention and MLP outputs are normed too, before they join the stream:
    post_attention_layernorm is then that output norm and pre_feedforward_layernorm the MLP's input norm."""

    attention_class = LlamaAttention  # DeepSeek's layers take their latent attention here

    def __init__(self, config, options: FamilyOptions, layer_index: int, mlp: Module | None = None):
        super().__init__()
        self.self_attn = self.attention_class(config, options, layer_index)
        self.mlp = mlp or make_mlp(config, options, layer_index)
        norm = lambda: RMSNorm(config.hidden_size, config.rms_norm_eps, options.norm_weight_offset)  # noqa: E731
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.sandwich_norms = options.sandwich_norms
        if self.sandwich_norms:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()

    def forward(self, positions, hidden, residual, keep_rows=None):
        """keep_rows [K]: only these rows leave the layer (its attention still caches every row's K and V)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, keep_rows)
        if keep_rows is not None:
            residual = residual.index_select(0, keep_rows)
        if not self.sandwich_norms:
            hidden, residual = self.post_attention_layernorm(hidden, residual)
            return self.mlp(hidden), residual
        hidden, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(hidden), residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


# Rows the LM head multiplies per row a decoder layer multiplies: the head runs on one row per sequence
# a step, the layers on every scheduled token, prompt tokens included. With prompts about twice as long
# as outputs (bench throughput's mix: prompts 32-512, outputs 32-256) that is about a third. Measured on
# SmolLM2-135M's shape at PP=2 (docs/distributed.md): 19/11 layers (the head at its full per-row
# cost, ~8 layers) gave 1.45x one batch at a time; 14/16 to 16/14 gave 1.59-1.61x.
LM_HEAD_ROWS_PER_LAYER_ROW = 1 / 3


def lm_head_cost_in_layers(config) -> float:
    """The LM head's matmul work per step, in decoder layers: its weights against a layer's, times the
    share of a step's rows it multiplies."""
    hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_size = getattr(config, "head_dim", None) or hidden // heads
    moe = moe_config(config)
    mlp = config.intermediate_size if moe is None else \
        moe.top_k * moe.intermediate_size + moe.shared_expert_intermediate_size  # the experts a row runs
    layer = hidden * head_size * (2 * heads + 2 * kv_heads) + 3 * hidden * mlp
    return config.vocab_size * hidden / layer * LM_HEAD_ROWS_PER_LAYER_ROW


class MissingLayer(Module):
    """Stands in for a layer another pipeline stage owns."""


class LlamaModel(Module):
    def __init__(self, config, options: FamilyOptions, pp_partition: list[int] | None = None, make_layer=None):
        super().__init__()
        state = get_parallel_state()
        self.is_first, self.is_last = state.is_first_stage, state.is_last_stage
        self.start_layer, self.end_layer = pp_layer_range(config.num_hidden_layers, pp_partition,
                                                          lm_head_cost_in_layers(config))
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size)
                             if self.is_first or (self.is_last and config.tie_word_embeddings) else None)
        if self.embed_tokens is not None:
            self.embed_tokens.scale = options.embed_scale
        make_layer = make_layer or LlamaDecoderLayer
        self.layers = nn.ModuleList(
            make_layer(config, options, i) if self.start_layer <= i < self.end_layer else MissingLayer()
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, options.norm_weight_offset) \
            if self.is_last else None
        # the C++ layer loop runs only plain Llama layers (FamilyOptions.plain_llama_layers says which)
        self.cpp_layer_loop = options.plain_llama_layers and make_layer is LlamaDecoderLayer
        self.cpu_layer_stack: llama_layers_cpu.LayerStack | None = None  # built on the loop's first pass

    def forward(self, input_ids, positions, hidden=None, residual=None, keep_rows=None):
        """First stage: input_ids [T]. Later stages: hidden/residual [T, hidden] from the previous one.
        Returns (hidden, residual) for the next stage, or the final normed hidden on the last: [T, hidden],
        or [K, hidden] for keep_rows [K] (the rows the caller reads; the last layer computes only those
        past its attention)."""
        if self.is_first:
            hidden, residual = self.embed_tokens(input_ids), None
        keep_rows = keep_rows if self.is_last else None
        in_one_call = llama_layers_cpu.run_layers(self, positions, hidden, residual, keep_rows) \
            if self.cpp_layer_loop else None
        if in_one_call is not None:
            hidden, residual = in_one_call
        elif self.start_layer == self.end_layer:  # a last stage without layers
            if keep_rows is not None:
                hidden, residual = hidden.index_select(0, keep_rows), residual.index_select(0, keep_rows)
        else:
            for i in range(self.start_layer, self.end_layer):  # (slicing a ModuleList builds a new one per call)
                last = i == self.end_layer - 1
                hidden, residual = self.layers[i](positions, hidden, residual, keep_rows if last else None)
        if not self.is_last:
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(Module):
    # checkpoint name -> (our parameter name, shard id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config, pp_partition: list[int] | None = None, make_layer=None, expert_parallel: bool = False):
        super().__init__()
        self.config = config
        self.options = dataclasses.replace(family_options(config), expert_parallel=expert_parallel)
        self.model = LlamaModel(config, self.options, pp_partition, make_layer)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None
        if self.model.is_last:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
            if self.tied:
                self.lm_head.weight = self.model.embed_tokens.weight
                self.lm_head.shares_weight = True

    def forward(self, input_ids, positions, hidden=None, residual=None, keep_rows=None):
        return self.model(input_ids, positions, hidden, residual, keep_rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] float32
        logits = self.lm_head(hidden).float()
        cap = self.options.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def attention_layers(self) -> list[Attention]:
        return [m for m in self.modules() if isinstance(m, Attention)]

    def checkpoint_to_param(self, name: str) -> tuple[str, object] | None:
        """Our parameter name and shard id for a checkpoint tensor, or None if another stage owns it."""
        if "rotary_emb.inv_freq" in name:
            return None
        if name.startswith("model.layers."):
            index = int(name.split(".")[2])
            if not self.model.start_layer <= index < self.model.end_layer:
                return None
        if name == "lm_head.weight" and (self.tied or self.lm_head is None):
            return None
        if name == "model.embed_tokens.weight" and self.model.embed_tokens is None:
            return None
        if name == "model.norm.weight" and self.model.norm is None:
            return None
        if ".experts." in name or ".block_sparse_moe." in name:
            name = self._expert_name(name)
            if name is None:
                return None
        for source, (target, shard) in self.packed_modules.items():
            if f".{source}." in name:
                return name.replace(f".{source}.", f".{target}."), shard
        if self.options.fused_checkpoint and (".qkv_proj." in name or ".gate_up_proj." in name):
            return name, FUSED_SHARDS["qkv_proj" if ".qkv_proj." in name else "gate_up_proj"]
        return name, None


    def _expert_name(self, name: str) -> str | None:
        """Mixtral's names as the others' (block_sparse_moe -> mlp, w1/w3/w2 -> gate/up/down_proj), and a global
        expert index as this rank's (None: another rank holds that expert)."""
        name = name.replace(".block_sparse_moe.", ".mlp.")
        for old, new in MIXTRAL_EXPERT_NAMES.items():
            name = name.replace(old, new)
        before, marker, after = name.partition(".mlp.experts.")
        if not marker:
            return name
        index, _, rest = after.partition(".")
        moe = self.model.layers[int(before.split(".")[2])].mlp
        local = moe.local_expert(int(index))
        return None if local is None else f"{before}{marker}{local}.{rest}"


MIXTRAL_EXPERT_NAMES = {".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}

# A checkpoint tensor that holds several shards at once (Phi-3): the shard ids it holds, in order
FUSED_SHARDS = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": (0, 1)}
