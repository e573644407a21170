"""What Pagoda runs, as config.json names it: the architectures (each with its implementation as
"module:class", imported only when the model is built), the MLP activations, which architectures are
mixtures of experts, and the rope parameters. Torch-free and importing nothing above the configuration: it
checks a model (config/model_files.py) before anything loads; models/ builds on the same tables."""

MODEL_REGISTRY = {
    "LlamaForCausalLM": "pagoda.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "pagoda.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "pagoda.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "pagoda.models.llama:LlamaForCausalLM",
    "Gemma2ForCausalLM": "pagoda.models.llama:LlamaForCausalLM",
    "Gemma3ForCausalLM": "pagoda.models.llama:LlamaForCausalLM",
    "Phi3ForCausalLM": "pagoda.models.llama:LlamaForCausalLM",
    "MixtralForCausalLM": "pagoda.models.llama:LlamaForCausalLM",
    "Qwen2MoeForCausalLM": "pagoda.models.llama:LlamaForCausalLM",
    "Qwen3MoeForCausalLM": "pagoda.models.llama:LlamaForCausalLM",
    "OlmoeForCausalLM": "pagoda.models.llama:LlamaForCausalLM",
    "GptOssForCausalLM": "pagoda.models.gpt_oss:GptOssForCausalLM",
    "DeepseekV2ForCausalLM": "pagoda.models.deepseek:DeepseekForCausalLM",
    "DeepseekV3ForCausalLM": "pagoda.models.deepseek:DeepseekForCausalLM",
}
SUPPORTED_ARCHITECTURES = tuple(MODEL_REGISTRY)
SUPPORT_TABLE = "docs/models.md#supported-architectures"


def unsupported_architecture_message(architectures) -> str:
    return (f"unsupported architecture {architectures}: Pagoda runs {', '.join(MODEL_REGISTRY)} "
            f"(what each supports: {SUPPORT_TABLE})")


# The activations of gate/up MLPs we run, by their transformers names.
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}

MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM",
                     "GptOssForCausalLM")


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """rope_theta and the scaling dict, from either the transformers 5 or the older layout (and Gemma 3's
    rope parameters per layer type)."""
    params = getattr(config, "rope_parameters", None)
    if params and layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    elif params and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]
    if params:
        params = dict(params)
    else:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    if params["rope_type"] == "su":  # Phi-3's first name for LongRoPE
        params["rope_type"] = "longrope"
    if params["rope_type"] in ("longrope", "yarn"):
        params.setdefault("original_max_position_embeddings",
                          getattr(config, "original_max_position_embeddings", None) or config.max_position_embeddings)
        params.setdefault("max_position_embeddings", config.max_position_embeddings)
    return params
