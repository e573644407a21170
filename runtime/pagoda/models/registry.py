"""The model class of an architecture, imported only when built (the table of those Pagoda runs is
config/architectures.py's: the configuration checks it before anything loads)."""

from importlib import import_module

from pagoda.config.architectures import MODEL_REGISTRY, unsupported_architecture_message


def get_model_class(architecture: str):
    if architecture not in MODEL_REGISTRY:
        raise ValueError(unsupported_architecture_message(architecture))
    module, _, name = MODEL_REGISTRY[architecture].partition(":")
    return getattr(import_module(module), name)
