"""One attention interface, two implementations: torch (CPU, reference) and Triton (GPU).

A backend provides ``write_kv_cache(key, value, kv_cache, slot_mapping)`` and
``paged_attention(query, kv_cache, metadata, scale) -> out``; see ``torch_backend`` for shapes.
"""

from types import ModuleType

from pagoda.attention.metadata import AttentionMetadata

BACKENDS = ("auto", "torch", "triton")


def resolve_backend_name(name: str, device_type: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}; got {name!r}")
    if name == "auto":
        return "triton" if device_type == "cuda" else "torch"
    return name


def get_backend(name: str) -> ModuleType:
    """The module implementing ``write_kv_cache`` and ``paged_attention`` for a resolved name."""
    if name == "torch":
        from pagoda.attention import torch_backend

        return torch_backend
    if name == "triton":
        from pagoda.attention import triton_backend

        return triton_backend
    raise ValueError(f"unknown attention backend {name!r}")


__all__ = ["AttentionMetadata", "BACKENDS", "get_backend", "resolve_backend_name"]
