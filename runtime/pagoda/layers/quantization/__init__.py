"""Weight-only quantization of the linear layers: int8 and int4 online, GPTQ int4 checkpoints.

``config`` (torch-free) decides the scheme at configuration time; ``methods`` attaches it to the layers."""

from pagoda.config.quantization import QuantizationConfig, resolve_quantization

__all__ = ["QuantizationConfig", "resolve_quantization"]
