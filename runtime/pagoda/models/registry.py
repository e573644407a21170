"""Which architectures Pagoda runs, by their config.json name (torch-free: the configuration checks it
before anything loads). Each maps to its implementation as "module:class", imported only when built."""

from importlib import import_module

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


def get_model_class(architecture: str):
    if architecture not in MODEL_REGISTRY:
        raise ValueError(unsupported_architecture_message(architecture))
    module, _, name = MODEL_REGISTRY[architecture].partition(":")
    return getattr(import_module(module), name)
