"""A forward pass through the Llama decoder layers in one C++ call (``llama_layers_cpu.cpp``).

At one sequence a decode step is ~10 ms of kernels; calling them from Python, layer by layer, added ~3 ms
(module calls, attribute lookups, ~10 dispatches per layer). The C++ loop makes the same kernel calls in the
same order, so its output is bit for bit that of ``LlamaDecoderLayer.forward``, which stays the path for
everything else: other devices, float32 and float16, quantized or oneDNN-packed weights, tensor parallelism,
the memory-profiling pass (no KV cache yet), and machines where a kernel library is not built.
"""

import functools

import torch

from pagoda.attention import cpu_kernels, torch_backend
from pagoda.layers import attention, custom_ops, fused_cpu_ops
from pagoda.layers.packed_weights import VNNI
from pagoda.ops import cpu_library


@functools.cache
def layer_slots() -> tuple[str, ...]:
    """The names of a layer's tensors in the C++ loop's list, in its order (its enum Slot; the library must be
    loaded)."""
    return tuple(torch.ops.pagoda_cpu.llama_layer_slots())


def available() -> bool:
    """The loop is loaded, and with it every kernel it calls (one library)."""
    return cpu_library.available()


class LayerStack:
    """What the loop needs of a stage's layers, gathered once: one flat tensor list (None when the loop cannot
    run these layers) and the sizes every layer shares."""

    def __init__(self, layers: list):
        attn, mlp = layers[0].self_attn, layers[0].mlp
        self.first_kv_cache = attn.attn.kv_cache  # the runner assigns every layer's cache at once
        slots = [_layer_tensors(layer) for layer in layers]
        self.tensors = None if None in slots else [t for layer_slots in slots for t in layer_slots]
        self.cos_sin_cache = attn.rotary_emb.cos_sin_cache  # every layer's rotary is built alike
        self.sizes = (attn.num_heads, attn.num_kv_heads, attn.head_size, mlp.gate_up_proj.output_size_per_rank // 2)
        self.eps = layers[0].input_layernorm.eps
        self.scale = attn.attn.scale


def _vnni_weight(linear) -> torch.Tensor | None:
    packed = linear.packed_weight
    if linear.quant_method is not None or packed is None or packed.layout != VNNI:
        return None
    return packed.data


def _layer_tensors(layer) -> list[torch.Tensor | None] | None:
    """The layer's tensors in layer_slots() order, or None when the loop cannot run it."""
    attn, mlp = layer.self_attn, layer.mlp
    weights = [_vnni_weight(x) for x in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    kv_cache = attn.attn.kv_cache
    if (None in weights or attn.o_proj.tp_size > 1 or mlp.gate_up_proj.bias is not None
            or mlp.down_proj.bias is not None or kv_cache is None
            or kv_cache.dtype != torch.bfloat16 or attn.head_size > cpu_kernels.MAX_HEAD_SIZE):
        return None
    qkv, out, gate_up, down = weights
    norm_weight = lambda norm: None if norm is None else norm.weight  # noqa: E731
    slots = dict(input_norm=layer.input_layernorm.weight, qkv=qkv, qkv_bias=attn.qkv_proj.bias,
                 q_norm=norm_weight(attn.q_norm), k_norm=norm_weight(attn.k_norm), out=out, out_bias=attn.o_proj.bias,
                 post_norm=layer.post_attention_layernorm.weight, gate_up=gate_up, down=down, kv_cache=kv_cache)
    return [slots[name] for name in layer_slots()]


def run_layers(model, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
               keep_rows: torch.Tensor | None = None):
    """model's layers start_layer..end_layer in one call -> (hidden, residual), each [T, hidden], or [K, hidden]
    for keep_rows [K] (the last layer's output rows); None when this pass is not one the loop runs (the caller
    runs the layers itself)."""
    context = attention.current_forward_context()
    if (context is None or context.backend is not torch_backend or hidden.dtype != torch.bfloat16
            or custom_ops.fused_ops(hidden) is not fused_cpu_ops or model.start_layer == model.end_layer
            or not available()):
        return None
    first = model.layers[model.start_layer]
    if first.self_attn.qkv_proj.lora is not None and first.self_attn.qkv_proj.lora.active:
        return None  # LoRA deltas: the Python layers call the adapters' hook
    stack = model.cpu_layer_stack
    if stack is None or stack.first_kv_cache is not first.self_attn.attn.kv_cache:
        layers = [model.layers[i] for i in range(model.start_layer, model.end_layer)]
        stack = model.cpu_layer_stack = LayerStack(layers)
    if stack.tensors is None:
        return None
    m = context.metadata
    decode_rows = decode_tables = decode_lens = None
    if not m.is_pure_decode and (seqs := m.decode_seqs):  # single-row sequences among prefill chunks
        decode_rows, decode_tables, decode_lens = torch_backend.gather_sequences(m, seqs)
    return torch.ops.pagoda_cpu.llama_layers(
        hidden, residual, positions, stack.tensors, stack.cos_sin_cache, m.query_start_loc, m.seq_lens,
        m.block_tables, m.slot_mapping, m.is_pure_decode, decode_rows, decode_tables, decode_lens, keep_rows,
        *stack.sizes, stack.eps, stack.scale)
