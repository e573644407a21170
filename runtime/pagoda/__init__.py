"""Pagoda: a paged-attention LLM engine with a vLLM-compatible API."""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "pagoda.entrypoints.llm",
    "SamplingParams": "pagoda.sampling_params",
    "StructuredOutputsParams": "pagoda.sampling_params",
    "PoolingParams": "pagoda.pooling_params",
    "EngineArgs": "pagoda.config",
    "AsyncEngineArgs": "pagoda.config",
    "LLMEngine": "pagoda.engine.llm_engine",
    "AsyncLLMEngine": "pagoda.engine.async_llm_engine",
    "RequestOutput": "pagoda.engine.outputs",
    "CompletionOutput": "pagoda.engine.outputs",
    "EmbeddingRequestOutput": "pagoda.engine.outputs",
    "LoRARequest": "pagoda.lora.request",
}


def __getattr__(name: str):
    # lazy, so `import pagoda` stays cheap (the operator image and the CLI's --help don't load torch)
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagoda' has no attribute {name!r}")
    value = getattr(import_module(module), "EngineArgs" if name == "AsyncEngineArgs" else name)
    globals()[name] = value
    return value


__all__ = list(_EXPORTS)
