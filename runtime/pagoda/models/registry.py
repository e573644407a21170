"""Which architectures Pagoda runs, by their config.json name (torch-free: the configuration checks it
before anything loads). Each maps to its implementation as "module:class", imported only when built."""

from importlib import import_module

MODEL_REGISTRY = {
    "LlamaForCausalLM": "pagoda.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "pagoda.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "pagoda.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "pagoda.models.llama:LlamaForCausalLM",
}
SUPPORTED_ARCHITECTURES = tuple(MODEL_REGISTRY)


def get_model_class(architecture: str):
    if architecture not in MODEL_REGISTRY:
        raise ValueError(f"unsupported architecture {architecture!r}: Pagoda runs {', '.join(MODEL_REGISTRY)}")
    module, _, name = MODEL_REGISTRY[architecture].partition(":")
    return getattr(import_module(module), name)
