"""The Llama family: Llama (1-3.x), Mistral, Qwen2 and Qwen3 share this one implementation.

Differences are options: attention bias (Qwen2), per-head q/k RMSNorm (Qwen3), tied embeddings,
GQA, explicit head_dim, and rope scaling (handled by the rotary layer).
"""

import torch
from torch import nn

from pagoda.distributed.parallel_state import get_parallel_state, pp_layer_range
from pagoda.layers import custom_ops
from pagoda.layers.attention import Attention
from pagoda.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagoda.layers.layernorm import RMSNorm
from pagoda.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagoda.layers.module import Module
from pagoda.layers.rotary import RotaryEmbedding, rope_parameters
from pagoda.models import llama_layers_cpu


class LlamaAttention(Module):
    def __init__(self, config, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        hidden = config.hidden_size
        total_heads, total_kv = config.num_attention_heads, config.num_key_value_heads
        self.head_size = getattr(config, "head_dim", None) or hidden // total_heads
        self.qkv_proj = QKVParallelLinear(hidden, self.head_size, total_heads, total_kv, bias=qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_size
        self.kv_size = self.num_kv_heads * self.head_size
        o_bias = getattr(config, "attention_bias", False) and config.architectures[0] != "Qwen2ForCausalLM"
        self.o_proj = RowParallelLinear(total_heads * self.head_size, hidden, bias=o_bias)
        self.q_norm = RMSNorm(self.head_size, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_size, config.rms_norm_eps) if qk_norm else None
        self.rotary_emb = RotaryEmbedding(self.head_size, config.max_position_embeddings, rope_parameters(config))
        self.attn = Attention(self.num_heads, self.head_size, self.num_kv_heads, self.head_size**-0.5)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, keep_rows: torch.Tensor | None = None
                ) -> torch.Tensor:
        """hidden [T, hidden] -> [T, hidden], or [K, hidden] for keep_rows [K] (every row's K and V are cached)."""
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_size)).view(-1, self.q_size)
            k = self.k_norm(k.reshape(-1, self.head_size)).view(-1, self.kv_size)
        q, k = self.rotary_emb(positions, q.contiguous(), k.contiguous())
        attended = self.attn(q, k, v.contiguous())  # [T, q_size]
        if keep_rows is not None:
            attended = attended.index_select(0, keep_rows)
        return self.o_proj(attended)


class LlamaMLP(Module):
    def __init__(self, config):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate]
        ops = custom_ops.fused_ops(gate_up)
        if ops is not None:
            return self.down_proj(ops.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class LlamaDecoderLayer(Module):
    def __init__(self, config, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.self_attn = LlamaAttention(config, qkv_bias, qk_norm)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

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
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


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
    layer = hidden * head_size * (2 * heads + 2 * kv_heads) + 3 * hidden * config.intermediate_size
    return config.vocab_size * hidden / layer * LM_HEAD_ROWS_PER_LAYER_ROW


class MissingLayer(Module):
    """Stands in for a layer another pipeline stage owns."""


class LlamaModel(Module):
    def __init__(self, config, qkv_bias: bool, qk_norm: bool, pp_partition: list[int] | None = None):
        super().__init__()
        state = get_parallel_state()
        self.is_first, self.is_last = state.is_first_stage, state.is_last_stage
        self.start_layer, self.end_layer = pp_layer_range(config.num_hidden_layers, pp_partition,
                                                          lm_head_cost_in_layers(config))
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size)
                             if self.is_first or (self.is_last and config.tie_word_embeddings) else None)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, qkv_bias, qk_norm) if self.start_layer <= i < self.end_layer
            else MissingLayer()
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if self.is_last else None
        self.cpu_layer_stack: llama_layers_cpu.LayerStack | None = None  # built on the loop's first pass

    def forward(self, input_ids, positions, hidden=None, residual=None, keep_rows=None):
        """First stage: input_ids [T]. Later stages: hidden/residual [T, hidden] from the previous one.
        Returns (hidden, residual) for the next stage, or the final normed hidden on the last: [T, hidden],
        or [K, hidden] for keep_rows [K] (the rows the caller reads; the last layer computes only those
        past its attention)."""
        if self.is_first:
            hidden, residual = self.embed_tokens(input_ids), None
        keep_rows = keep_rows if self.is_last else None
        in_one_call = llama_layers_cpu.run_layers(self, positions, hidden, residual, keep_rows)
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

    def __init__(self, config, pp_partition: list[int] | None = None):
        super().__init__()
        arch = config.architectures[0]
        qkv_bias = arch == "Qwen2ForCausalLM" or getattr(config, "attention_bias", False)
        qk_norm = arch == "Qwen3ForCausalLM"
        self.config = config
        self.model = LlamaModel(config, qkv_bias, qk_norm, pp_partition)
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
        return self.lm_head(hidden).float()

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
        for source, (target, shard) in self.packed_modules.items():
            if f".{source}." in name:
                return name.replace(f".{source}.", f".{target}."), shard
        return name, None
