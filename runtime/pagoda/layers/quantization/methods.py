"""One method object per scheme, attached to every linear layer before loading, owns the layer's weights
from then on (as vLLM's quant methods): ``create_weights`` (the tensors the checkpoint fills),
``convert_checkpoint_tensor`` (optional: a saved tensor into the layer's layout),
``process_weights_after_loading`` (quantize and pack, once) and ``apply`` (the matmul).
Embeddings and the LM head are not linear layers: they keep the model's dtype."""

import logging

import torch
from torch import nn

from pagoda.config.quantization import QuantizationConfig
from pagoda.layers.linear import LinearBase
from pagoda.layers.quantization.awq import AWQMethod
from pagoda.layers.quantization.fp8 import Fp8CheckpointMethod, Fp8OnlineMethod
from pagoda.layers.quantization.gptq import GPTQMethod
from pagoda.layers.quantization.int4 import Int4Method
from pagoda.layers.quantization.int8 import Int8Method

logger = logging.getLogger(__name__)


def make_method(config: QuantizationConfig):
    if config.method == "int8":
        return Int8Method()
    if config.method == "int4":
        return Int4Method(config.group_size)
    if config.method == "awq":
        return AWQMethod(config.group_size)
    if config.method == "fp8":
        return Fp8OnlineMethod() if config.fp8_format == "online" else Fp8CheckpointMethod(config)
    return GPTQMethod(config.group_size, config.zero_offset)


def linear_layers(model: nn.Module) -> list[LinearBase]:
    return [m for m in model.modules() if isinstance(m, LinearBase)]


def attach(model: nn.Module, config: QuantizationConfig):
    """Give every linear layer the scheme's method, before loading; returns the method."""
    method = make_method(config)
    for layer in linear_layers(model):
        layer.quant_method = method
        method.create_weights(layer)
    return method


def process_after_loading(model: nn.Module) -> None:
    layers = [layer for layer in linear_layers(model) if layer.quant_method is not None]
    unquantized = sum(map(unquantized_bytes, layers))
    for layer in layers:
        layer.quant_method.process_weights_after_loading(layer)
    if layers:
        logger.info("quantized %d linear layers (%s): their weights take %.2f MiB instead of %.2f MiB",
                    len(layers), type(layers[0].quant_method).__name__, sum(map(weight_bytes, layers)) / 2**20,
                    unquantized / 2**20)


def unquantized_bytes(layer: LinearBase) -> int:
    """What the layer's weight takes in the model dtype: loaded as such (online schemes), or the size of the
    checkpoint's unpacked codes times that of its scales (GPTQ, AWQ)."""
    weight = layer.weight
    if weight is not None and weight.element_size() > 1:
        return weight.numel() * weight.element_size()
    if weight is not None:  # an fp8 checkpoint's weight: counted at 16 bits, as the model it was made from
        return weight.numel() * 2
    return layer.qweight.numel() * layer.scales.element_size()


def weight_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters, buffers and packed weights, each tensor counted once."""
    tensors: dict[int, torch.Tensor] = {}
    for m in module.modules():
        packed = getattr(m, "packed_weight", None)
        for t in [*m.parameters(recurse=False), *m.buffers(recurse=False), *([packed.data] if packed is not None else [])]:
            tensors[id(t)] = t
    return sum(t.numel() * t.element_size() for t in tensors.values())
