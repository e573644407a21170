"""One attention interface, two implementations: torch (CPU, reference) and Triton (GPU); which one an
engine uses is resolved with its configuration (config/resolve.py: resolve_attention_backend).

A backend provides ``write_kv_cache(key, value, kv_cache, slot_mapping)`` and
``paged_attention(query, kv_cache, metadata, scale) -> out``; see ``torch_backend`` for shapes.
"""

from types import ModuleType

from pagoda.attention.metadata import AttentionMetadata


def get_backend(name: str) -> ModuleType:
    """The module implementing ``write_kv_cache`` and ``paged_attention`` for a resolved name."""
    if name == "torch":
        from pagoda.attention import torch_backend

        return torch_backend
    if name == "triton":
        from pagoda.attention import triton_backend

        return triton_backend
    raise ValueError(f"unknown attention backend {name!r}")


__all__ = ["AttentionMetadata", "get_backend"]
