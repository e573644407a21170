"""DeepSeek-V2 and -V3 (and R1, a V3 checkpoint): multi-head latent attention (MLA) over a latent KV cache,
shared plus routed experts, the first ``first_k_dense_replace`` layers dense. The rest of the model (embedding,
norms, pipeline stages, LM head, the expert and gate/up loading) is the Llama family's.

MLA: each token's keys and values come from one latent, c = RMSNorm(W_DKV h) (``kv_lora_rank`` values), plus
one RoPE key shared by all heads (``qk_rope_head_dim``). The cache keeps only that [c | k_rope] row per token
and layer (``MLAAttention.kv_planes = 1``: one plane where other layers keep K and V per KV head). Attention
reads only the latent: the key up-projection is absorbed into the query (q_nope W_UK, a query in latent space)
and the value up-projection applied after (softmax(...) c) W_UV, so no step expands K or V per head; prefill
takes the same absorbed form. Tensor parallelism splits the heads (q_b, kv_b, o); the latent is replicated, so
every rank caches the whole latent. MTP layers (``num_nextn_predict_layers``) are skipped with a log line.

Routing: V2's softmax scores, greedy or group_limited_greedy (the best expert of each group ranks the groups);
V3's sigmoid scores plus ``e_score_correction_bias`` for the choice only, groups ranked by their two best,
top-k within the chosen groups, weights renormalised (``norm_topk_prob``); both times routed_scaling_factor.
"""

import logging

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.config.architectures import rope_parameters
from pagoda.distributed.parallel_state import get_parallel_state
from pagoda.layers.attention import Attention, current_forward_context
from pagoda.layers.layernorm import RMSNorm
from pagoda.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    copy_checked,
    divide,
)
from pagoda.layers.module import Module
from pagoda.layers.moe import MoEOptions, SparseMoE
from pagoda.layers.quantization.kv_scales import is_fp8
from pagoda.layers.rotary import RotaryEmbedding, yarn_mscale
from pagoda.models.family import FamilyOptions
from pagoda.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP

logger = logging.getLogger(__name__)

LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: the reference's default, not rms_norm_eps


def mla_cache_width(config) -> int:
    """Values one token's latent row holds per layer: kv_lora_rank + qk_rope_head_dim."""
    return config.kv_lora_rank + config.qk_rope_head_dim


class KVUpProjection(Module):
    """kv_b_proj's weight [heads * (nope + v), kv_lora_rank], this rank's heads: read whole by the absorbed
    attention (never packed or quantized as a matmul layer)."""

    def __init__(self, kv_lora_rank: int, total_heads: int, per_head: int):
        super().__init__()
        state = get_parallel_state()
        self.rows = divide(total_heads, state.tp_size, "number of attention heads") * per_head
        self.rank = state.tp_rank
        self.weight = nn.Parameter(torch.empty(self.rows, kv_lora_rank), requires_grad=False)
        self.weight.weight_loader = lambda param, loaded, shard_id=None: copy_checked(
            param, loaded[self.rank * self.rows : (self.rank + 1) * self.rows], "kv_b_proj.weight")


class MLAAttention(Attention):
    """The latent cache of one layer and attention over it. Its cache is [1, num_blocks, block_size, 1, width]:
    one plane (kv_planes), one "head" the width of the latent row."""

    kv_planes = 1

    def __init__(self, num_heads: int, kv_lora_rank: int, rope_dim: int, nope_dim: int, v_dim: int, scale: float,
                 up: KVUpProjection):
        super().__init__(num_heads, kv_lora_rank + rope_dim, 1, scale)
        self.kv_lora_rank, self.rope_dim, self.nope_dim, self.v_dim = kv_lora_rank, rope_dim, nope_dim, v_dim
        self._up = [up]  # kv_b_proj's weights (a list: not a submodule of this layer, its parameters are the attention's)

    def attend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
        """q_nope [T, H, nope], q_pe [T, H, rope] (rotated), latent [T, C + rope] (this step's rows) -> [T, H * v]."""
        ctx = current_forward_context()
        metadata = ctx.metadata
        w = self._up[0].weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = w[:, : self.nope_dim], w[:, self.nope_dim :]  # [H, nope, C], [H, v, C]
        q_latent = torch.einsum("thn,hnc->thc", q_nope.float(), w_uk.float())  # the key up-projection absorbed
        query = torch.cat([q_latent, q_pe.float()], dim=-1)  # [T, H, C + rope]: against [c | k_rope] rows
        if self.kv_cache is not None:
            if is_fp8(self.kv_cache):
                raise ValueError("kv_cache_dtype fp8 is not supported for MLA (DeepSeek) models yet")
            self._write(latent, metadata.slot_mapping)
        out = torch.empty(query.shape[0], self.num_heads, self.kv_lora_rank, dtype=torch.float32,
                          device=query.device)
        start = 0
        for i, (q_len, s_len) in enumerate(zip(metadata.query_lens_cpu, metadata.seq_lens_cpu)):
            rows = latent[start : start + q_len] if self.kv_cache is None else \
                self._context(metadata.block_tables[i], s_len)
            first = s_len - q_len if self.kv_cache is not None else 0
            scores = torch.einsum("qhc,kc->hqk", query[start : start + q_len], rows.float()) * self.scale
            q_pos = torch.arange(first, first + q_len, device=query.device)[:, None]
            k_pos = torch.arange(rows.shape[0], device=query.device)[None, :]
            scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
            out[start : start + q_len] = torch.einsum("hqk,kc->qhc", scores.softmax(-1),
                                                      rows[:, : self.kv_lora_rank].float())
            start += q_len
        # the value up-projection after the weighted sum of latents
        return torch.einsum("thc,hvc->thv", out, w_uv.float()).to(q_nope.dtype).flatten(1)

    def _write(self, latent: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        cache = self.kv_cache[0, :, :, 0]  # [num_blocks, block_size, width]
        valid = slot_mapping >= 0
        if not bool(valid.all()):
            latent, slot_mapping = latent[valid], slot_mapping[valid]
        block_size = cache.shape[1]
        cache.index_put_((slot_mapping // block_size, slot_mapping % block_size), latent.to(cache.dtype))

    def _context(self, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
        """A sequence's latent rows [seq_len, width]."""
        cache = self.kv_cache[0, :, :, 0]
        block_size = cache.shape[1]
        blocks = cache.index_select(0, block_table[: -(-seq_len // block_size)].long())
        return blocks.flatten(0, 1)[:seq_len]


class DeepseekAttention(Module):
    def __init__(self, config, options: FamilyOptions, layer_index: int):
        super().__init__()
        hidden, total_heads = config.hidden_size, config.num_attention_heads
        self.nope, self.rope, self.v = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        qk_head = self.nope + self.rope
        bias = bool(getattr(config, "attention_bias", False))
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, total_heads * qk_head)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, total_heads * qk_head)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.kv_lora_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = KVUpProjection(self.kv_lora_rank, total_heads, self.nope + self.v)
        self.o_proj = RowParallelLinear(total_heads * self.v, hidden, bias=bias)
        self.num_heads = divide(total_heads, get_parallel_state().tp_size, "number of attention heads")
        params = options.layers[layer_index].rope
        self.rotary_emb = RotaryEmbedding(self.rope, config.max_position_embeddings, params)
        # V2 rotates interleaved pairs (x0, x1), (x2, x3), ...; V3 too unless rope_interleave is false
        self.interleaved = config.architectures[0] == "DeepseekV2ForCausalLM" or getattr(config, "rope_interleave", True)
        scale = qk_head ** -0.5
        if params["rope_type"] != "default" and params.get("mscale_all_dim"):
            scale *= yarn_mscale(params["factor"], params["mscale_all_dim"]) ** 2
        self.attn = MLAAttention(self.num_heads, self.kv_lora_rank, self.rope, self.nope, self.v, scale,
                                 self.kv_b_proj)

    def _pairs_to_halves(self, x: torch.Tensor) -> torch.Tensor:
        """[..., rope] interleaved pairs -> evens then odds: the rotate-half layout of the same rotation."""
        return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1) if self.interleaved else x

    def forward(self, positions, hidden, keep_rows=None):
        q = self.q_proj(hidden) if self.q_lora_rank is None else \
            self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(-1, self.num_heads, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.rope], dim=-1)
        c = self.kv_a_layernorm(c.contiguous())
        q_pe, k_pe = self.rotary_emb(positions, self._pairs_to_halves(q_pe).reshape(q.shape[0], -1).contiguous(),
                                     self._pairs_to_halves(k_pe).contiguous())
        attended = self.attn.attend(q_nope, q_pe.view(-1, self.num_heads, self.rope), torch.cat([c, k_pe], dim=-1))
        if keep_rows is not None:
            attended = attended.index_select(0, keep_rows)
        return self.o_proj(attended)


def _route_v2(logits: torch.Tensor, config) -> tuple[torch.Tensor, torch.Tensor]:
    scores = logits.softmax(-1)
    if config.topk_method == "group_limited_greedy":
        groups = config.n_group
        best = scores.view(-1, groups, scores.shape[1] // groups).max(-1).values
        chosen = torch.zeros_like(best).scatter_(1, best.topk(config.topk_group, dim=-1)[1], 1)
        scores = scores.masked_fill(~chosen.bool().repeat_interleave(scores.shape[1] // groups, 1), 0.0)
    elif config.topk_method != "greedy":
        raise ValueError(f"unsupported topk_method {config.topk_method!r} for DeepSeek-V2: greedy or "
                         "group_limited_greedy")
    weights, ids = scores.topk(config.num_experts_per_tok, dim=-1)
    if getattr(config, "norm_topk_prob", False) and config.num_experts_per_tok > 1:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * config.routed_scaling_factor, ids


def _route_v3(logits: torch.Tensor, bias: torch.Tensor, config) -> tuple[torch.Tensor, torch.Tensor]:
    scores = logits.sigmoid()
    choice = scores + bias
    groups = config.n_group
    ranked = choice.view(-1, groups, choice.shape[1] // groups).topk(2, dim=-1)[0].sum(-1)
    chosen = torch.zeros_like(ranked).scatter_(1, ranked.topk(config.topk_group, dim=-1)[1], 1)
    choice = choice.masked_fill(~chosen.bool().repeat_interleave(choice.shape[1] // groups, 1), float("-inf"))
    ids = choice.topk(config.num_experts_per_tok, dim=-1)[1]
    weights = scores.gather(1, ids)
    if config.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * config.routed_scaling_factor, ids


class DeepseekMoE(SparseMoE):
    """The shared experts (ungated) plus the routed ones, routed as the model's version does."""

    def __init__(self, config, expert_parallel: bool):
        super().__init__(config.hidden_size, MoEOptions(config.n_routed_experts, config.num_experts_per_tok,
                                                        config.moe_intermediate_size, False,
                                                        expert_parallel=expert_parallel), "silu")
        self.config = config
        self.v3 = config.architectures[0] == "DeepseekV3ForCausalLM"
        if self.v3:
            self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(config.n_routed_experts,
                                                                         dtype=torch.float32), requires_grad=False)
            self.gate.e_score_correction_bias.weight_loader = self.gate.weight.weight_loader
        # the checkpoint's shared_experts (DeepseekForCausalLM.checkpoint_to_param maps the name)
        self.shared_expert = LlamaMLP(config, "silu", config.moe_intermediate_size * config.n_shared_experts) \
            if config.n_shared_experts else None

    def choose_experts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.gate.weight.float())
        return _route_v3(logits, self.gate.e_score_correction_bias, self.config) if self.v3 else \
            _route_v2(logits, self.config)

    def shared_output(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared_expert(x)  # ungated


class DeepseekDecoderLayer(LlamaDecoderLayer):
    attention_class = DeepseekAttention

    def __init__(self, config, options: FamilyOptions, layer_index: int):
        dense = layer_index < config.first_k_dense_replace or not config.n_routed_experts
        mlp = LlamaMLP(config) if dense else DeepseekMoE(config, options.expert_parallel)
        super().__init__(config, options, layer_index, mlp)


class DeepseekForCausalLM(LlamaForCausalLM):
    packed_modules = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config, pp_partition: list[int] | None = None, expert_parallel: bool = False):
        if getattr(config, "num_nextn_predict_layers", 0):
            logger.info("%s: %d MTP layer(s) in the checkpoint are skipped (speculative decoding with them is not "
                        "supported yet)", config.architectures[0], config.num_nextn_predict_layers)
        if rope_parameters(config)["rope_type"] not in ("default", "yarn"):
            raise ValueError(f"unsupported rope scaling {rope_parameters(config)['rope_type']!r} for "
                             f"{config.architectures[0]}: default or yarn")
        super().__init__(config, pp_partition, DeepseekDecoderLayer, expert_parallel)

    def checkpoint_to_param(self, name: str):
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= self.config.num_hidden_layers:
            return None  # an MTP layer
        return super().checkpoint_to_param(name.replace(".mlp.shared_experts.", ".mlp.shared_expert."))
