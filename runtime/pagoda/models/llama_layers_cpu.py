"""A forward pass through the Llama decoder layers in one C++ call (``llama_layers_cpu.cpp``).

At one sequence a decode step is ~10 ms of kernels; calling them from Python, layer by layer, added ~3 ms
(module calls, attribute lookups, ~10 dispatches per layer). The C++ loop makes the same kernel calls in the
same order, so its output is bit for bit that of ``LlamaDecoderLayer.forward``, which stays the path for
everything else: other devices, float32 and float16, int8/int4/GPTQ/AWQ or oneDNN-packed weights, tensor parallelism,
the memory-profiling pass (no KV cache yet), the pass that calibrates an fp8 cache's scales, and machines where
a kernel library is not built. A bfloat16 or an fp8 cache (with each layer's k_scale and v_scale) is read;
weights are bfloat16 (bf16_matmul_cpu) or FP8 (fp8_matmul_cpu, with their scales). LoRA adapters' deltas are
added inside the loop, after each projection, from what the LoRA hook's cpu_loop_args gathers.
"""

import functools

import torch

from pagoda.attention import cpu_kernels, torch_backend
from pagoda.layers import attention, custom_ops, fused_cpu_ops
from pagoda.layers.packed_weights import VNNI
from pagoda.layers.quantization import kv_scales
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
        # what adapters may target, for the LoRA hook's cpu_loop_args
        self.projections = [(layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                             layer.mlp.down_proj) for layer in layers]


def _loop_weight(linear) -> tuple[torch.Tensor, torch.Tensor | None, int] | None:
    """(weight, scales, block_k) as the loop's linear takes them: a bfloat16 weight packed for bf16_matmul_cpu
    (scales None), or an FP8 one packed for fp8_matmul_cpu with its scales; None for any other layer."""
    if linear.quant_method is not None:
        fp8_weights = getattr(linear.quant_method, "cpu_kernel_weights", None)
        return None if fp8_weights is None else fp8_weights(linear)
    packed = linear.packed_weight
    if packed is None or packed.layout != VNNI:
        return None
    return packed.data, None, 0


def _kv_scales(attention_layer) -> torch.Tensor | None:
    """An fp8 cache's [k_scale, v_scale] as the loop reads them (float64: the Python floats the torch path passes);
    None for a cache in the model's dtype."""
    if not kv_scales.is_fp8(attention_layer.kv_cache):
        return None
    return torch.tensor([attention_layer.k_scale, attention_layer.v_scale], dtype=torch.float64)


def _layer_tensors(layer) -> list[torch.Tensor | None] | None:
    """The layer's tensors in layer_slots() order, or None when the loop cannot run it."""
    attn, mlp = layer.self_attn, layer.mlp
    weights = [_loop_weight(x) for x in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    kv_cache = attn.attn.kv_cache
    if (None in weights or attn.o_proj.tp_size > 1 or mlp.gate_up_proj.bias is not None
            or mlp.down_proj.bias is not None or kv_cache is None
            or not (kv_cache.dtype == torch.bfloat16 or kv_scales.is_fp8(kv_cache))
            or attn.head_size > cpu_kernels.MAX_HEAD_SIZE):
        return None
    (qkv, qkv_scale, _), (out, out_scale, _), (gate_up, gate_up_scale, _), (down, down_scale, _) = weights
    block_k = None if qkv_scale is None else torch.tensor([w[2] for w in weights], dtype=torch.int64)
    if len({w[1] is None for w in weights}) > 1:
        return None  # the loop takes all four FP8 or none
    norm_weight = lambda norm: None if norm is None else norm.weight  # noqa: E731
    slots = dict(input_norm=layer.input_layernorm.weight, qkv=qkv, qkv_bias=attn.qkv_proj.bias,
                 q_norm=norm_weight(attn.q_norm), k_norm=norm_weight(attn.k_norm), out=out, out_bias=attn.o_proj.bias,
                 post_norm=layer.post_attention_layernorm.weight, gate_up=gate_up, down=down, kv_cache=kv_cache,
                 kv_scales=_kv_scales(attn.attn), qkv_scale=qkv_scale, out_scale=out_scale,
                 gate_up_scale=gate_up_scale, down_scale=down_scale, block_k=block_k)
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
    if first.self_attn.attn.calculate_kv_scales:
        return None  # the fp8 scales are calibrated on this batch, by the Python layers (all of them at once), so a
        # stack gathered after this pass holds the final scales
    stack = model.cpu_layer_stack
    if stack is None or stack.first_kv_cache is not first.self_attn.attn.kv_cache:
        layers = [model.layers[i] for i in range(model.start_layer, model.end_layer)]
        stack = model.cpu_layer_stack = LayerStack(layers)
    if stack.tensors is None:
        return None
    lora = (None, [])  # the op's LoRA arguments: no adapter rows
    if (hook := first.self_attn.qkv_proj.lora) is not None and hook.active:
        lora = hook.cpu_loop_args(stack.projections)  # lora/layers.py gathers what the loop needs
        if lora is None:
            return None  # adapters the loop cannot run: the Python layers call their hook
    m = context.metadata
    decode_rows = decode_tables = decode_lens = None
    if not m.is_pure_decode and (seqs := m.decode_seqs):  # single-row sequences among prefill chunks
        decode_rows, decode_tables, decode_lens = torch_backend.gather_sequences(m, seqs)
    return torch.ops.pagoda_cpu.llama_layers(
        hidden, residual, positions, stack.tensors, stack.cos_sin_cache, m.query_start_loc, m.seq_lens,
        m.block_tables, m.slot_mapping, m.is_pure_decode, decode_rows, decode_tables, decode_lens, keep_rows,
        *stack.sizes, stack.eps, stack.scale, *lora)
