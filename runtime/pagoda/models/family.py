"""What sets one Llama-family architecture apart, read once from its config.json: plain data the shared layers
(``models.llama``) take as options, so a new dense architecture is an entry here, not a copied model file.

Torch-free: the configuration checks a model with it before anything loads.
"""

import math
from dataclasses import dataclass, field

from pagoda.config.architectures import ACTIVATIONS, MOE_ARCHITECTURES, rope_parameters


@dataclass(frozen=True)
class LayerAttention:
    """One decoder layer's attention: its sliding window (None: the whole context) and rope parameters."""
    sliding_window: int | None
    rope: dict = field(hash=False)


@dataclass(frozen=True)
class MoEConfig:
    """What config.json says of a mixture-of-experts MLP (``layers.moe.MoEOptions`` adds the parallel split)."""
    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    scoring: str = "softmax"
    shared_expert_intermediate_size: int = 0
    sparse_layers: tuple[bool, ...] = ()  # per layer: experts (True) or a dense MLP (Qwen's mlp_only_layers)
    biases: bool = False  # gpt-oss: the router and every expert matrix have a bias
    swiglu: tuple[float, float] | None = None  # gpt-oss: (alpha, limit) of its clamped SwiGLU


def moe_config(config) -> MoEConfig | None:
    """None for a dense model (and for a config naming no architecture, as a bare shape does)."""
    arch = (getattr(config, "architectures", None) or [None])[0]
    if arch not in MOE_ARCHITECTURES:
        return None
    n = config.num_hidden_layers
    if arch == "MixtralForCausalLM":  # always renormalises the top-k weights
        return MoEConfig(config.num_local_experts, config.num_experts_per_tok, config.intermediate_size, True,
                         sparse_layers=(True,) * n)
    if arch == "GptOssForCausalLM":  # softmax over the top-k logits: the renormalised top-k of the softmax
        return MoEConfig(config.num_local_experts, config.num_experts_per_tok, config.intermediate_size, True,
                         sparse_layers=(True,) * n, biases=True,
                         swiglu=(config.swiglu_alpha, config.swiglu_limit))
    step = getattr(config, "decoder_sparse_step", None) or 1
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    sparse = tuple(i not in dense and config.num_experts > 0 and (i + 1) % step == 0 for i in range(n))
    return MoEConfig(
        config.num_experts, config.num_experts_per_tok,
        getattr(config, "moe_intermediate_size", None) or config.intermediate_size,
        bool(getattr(config, "norm_topk_prob", False)), getattr(config, "scoring_func", None) or "softmax",
        getattr(config, "shared_expert_intermediate_size", 0) or 0, sparse)


@dataclass(frozen=True)
class FamilyOptions:
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm of q and k (Qwen3, Gemma 3)
    qk_norm_full: bool = False  # OLMoE: RMSNorm over all of q's heads together, and all of k's
    clip_qkv: float | None = None  # OLMoE: q, k and v clamped to [-clip, clip]
    norm_weight_offset: float = 0.0  # Gemma's RMSNorm multiplies by (1 + w): the offset is added once at load
    sandwich_norms: bool = False  # Gemma 2/3: norms after attention and the MLP too (pre/post feedforward)
    activation: str = "silu"  # of gate in act(gate) * up
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    attn_scale: float | None = None  # None: head_size ** -0.5; Gemma: query_pre_attn_scalar ** -0.5
    attn_logit_softcap: float | None = None  # Gemma 2: scores = cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # Gemma 2: the same on the LM head's logits
    fused_checkpoint: bool = False  # Phi-3 stores qkv_proj and gate_up_proj already fused
    attention_sinks: bool = False  # gpt-oss: a learned logit per head joins each softmax's denominator
    layers: tuple[LayerAttention, ...] = ()
    moe: MoEConfig | None = None
    expert_parallel: bool = False  # an engine setting, not the checkpoint's: set by the model's constructor

    @property
    def plain_llama_layers(self) -> bool:
        """Whether every layer is the Llama layer the C++ layer loop (``models.llama_layers_cpu``) implements: no
        window, no soft-capping, SiLU, two norms, one rope for all layers. The one predicate that sends other
        models to the Python layers (whose attention still runs the C++ kernels on CPU: they take windows and
        soft-caps)."""
        ropes = {_rope_key(layer.rope) for layer in self.layers}
        return (self.activation == "silu" and not self.sandwich_norms and self.attn_logit_softcap is None
                and self.moe is None and not self.qk_norm_full and self.clip_qkv is None
                and all(layer.sliding_window is None for layer in self.layers) and len(ropes) <= 1)


def _rope_key(rope: dict) -> tuple:
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in rope.items()))


def layer_windows(config) -> list[int | None]:
    """Each layer's sliding window as transformers applies it: by ``layer_types`` where the config has them
    (Gemma 2/3, Qwen2 with use_sliding_window from max_window_layers on), else ``sliding_window`` on every
    layer (Mistral v0.1, Phi-3, Mixtral)."""
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    types = getattr(config, "layer_types", None)
    n = config.num_hidden_layers
    if types:
        return [window if t == "sliding_attention" else None for t in types[:n]]
    return [window or None] * n


def family_options(config) -> FamilyOptions:
    arch = config.architectures[0]
    windows = layer_windows(config)
    types = getattr(config, "layer_types", None) or ["full_attention"] * len(windows)
    layers = tuple(LayerAttention(w, rope_parameters(config, t)) for w, t in zip(windows, types))
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    common = dict(activation=ACTIVATIONS.get(act, act), layers=layers, moe=moe_config(config))
    if arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        return FamilyOptions(
            qkv_bias=getattr(config, "attention_bias", False), o_bias=getattr(config, "attention_bias", False),
            qk_norm=arch == "Gemma3ForCausalLM", norm_weight_offset=1.0, sandwich_norms=True,
            embed_scale=math.sqrt(config.hidden_size), attn_scale=config.query_pre_attn_scalar ** -0.5,
            attn_logit_softcap=getattr(config, "attn_logit_softcapping", None),
            final_logit_softcap=getattr(config, "final_logit_softcapping", None), **common)
    attention_bias = getattr(config, "attention_bias", False)
    return FamilyOptions(
        qkv_bias=arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM") or attention_bias,
        o_bias=attention_bias and arch not in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"),
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"), qk_norm_full=arch == "OlmoeForCausalLM",
        clip_qkv=getattr(config, "clip_qkv", None),
        fused_checkpoint=arch == "Phi3ForCausalLM", attention_sinks=arch == "GptOssForCausalLM", **common)
