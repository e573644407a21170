"""One attention interface, two implementations: torch (CPU, reference) and Triton (GPU).

A backend provides ``write_kv_cache(key, value, kv_cache, slot_mapping)`` and
``paged_attention(query, kv_cache, metadata, scale) -> out``; see ``torch_backend`` for shapes.
"""

import os
from types import ModuleType

from pagoda.attention.metadata import AttentionMetadata

BACKENDS = ("auto", "torch", "triton")


def resolve_backend_name(name: str, device_type: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}; got {name!r}")
    if name == "auto":
        return "triton" if device_type == "cuda" else "torch"
    if name == "triton" and device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"attention_backend 'triton' needs a CUDA device, not {device_type} (or TRITON_INTERPRET=1 "
                         "to run the kernels in Triton's interpreter, for tests); use 'torch' or 'auto'")
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
