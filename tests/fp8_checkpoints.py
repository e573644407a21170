"""Tiny FP8 checkpoints for tests, in the conventions of the tools that write them, plus the same model with
the dequantized weights in float32 (the reference transformers loads).

- vLLM's ``fp8`` format (AutoFP8, and DeepSeek-V3 / Qwen3-FP8 for blocks): ``weight`` float8_e4m3fn and a
  scalar ``weight_scale`` (per tensor), or with ``weight_block_size: [bn, bk]`` a ``weight_scale_inv``
  [ceil(N / bn), ceil(K / bk)]; ``input_scale`` scalars with ``activation_scheme: static``.
- ``compressed-tensors`` (llm-compressor's FP8 / FP8_DYNAMIC / FP8_BLOCK schemes): ``weight`` float8_e4m3fn,
  ``weight_scale`` [1] (tensor), [N, 1] (channel) or [ceil(N / bn), ceil(K / bk)] (block); ``input_scale`` [1]
  for static activations; KV-cache scales as ``self_attn.k_scale`` / ``v_scale``.

Scales map each group's largest |w| to 448 (e4m3's largest value), as those tools do; the dequantized twin is
qweight * scale in float32."""

import json
import math
import shutil
from pathlib import Path

import torch
from quantized_checkpoints import LINEAR_NAMES

FP8 = torch.float8_e4m3fn


def fp8_quantize(weight: torch.Tensor, strategy: str, block: tuple[int, int] | None = None):
    """weight [N, K] -> (qweight fp8 [N, K], scale in the strategy's shape, dequantized float32 [N, K])."""
    w = weight.float()
    n, k = w.shape
    if strategy == "tensor":
        scale = w.abs().max() / 448
        expanded = scale.expand(n, k)
    elif strategy == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / 448  # [N, 1]
        expanded = scale.expand(n, k)
    else:
        bn, bk = block
        scale = torch.zeros(math.ceil(n / bn), math.ceil(k / bk))
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                scale[i, j] = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].abs().max() / 448
        expanded = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    q = (w / expanded).clamp(-448, 448).to(FP8)
    return q, scale, q.float() * expanded


def write_fp8_model(float_dir: Path, out_dir: Path, dequantized_dir: Path, fmt: str = "fp8",
                    strategy: str = "tensor", block: tuple[int, int] | None = None, static_inputs: bool = False,
                    kv_scales: dict[int, tuple[float, float]] | None = None) -> None:
    """fmt "fp8" (vLLM) or "compressed-tensors"; kv_scales {layer: (k_scale, v_scale)} adds KV-cache scales."""
    from safetensors.torch import load_file, save_file

    float_dir, out_dir, dequantized_dir = Path(float_dir), Path(out_dir), Path(dequantized_dir)
    shutil.copytree(float_dir, out_dir)
    shutil.copytree(float_dir, dequantized_dir)
    (file,) = float_dir.glob("*.safetensors")
    tensors = load_file(file)
    quantized, dequantized = {}, {}
    for name, tensor in tensors.items():
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in LINEAR_NAMES:
            q, scale, deq = fp8_quantize(tensor, strategy, block)
            quantized[name] = q
            if fmt == "fp8":
                quantized[f"{module}.weight_scale_inv" if block else f"{module}.weight_scale"] = scale
            else:
                quantized[f"{module}.weight_scale"] = scale.reshape(1) if strategy == "tensor" else scale
            if static_inputs:
                quantized[f"{module}.input_scale"] = torch.tensor(0.02).reshape(() if fmt == "fp8" else (1,))
            dequantized[name] = deq
        else:
            quantized[name] = tensor
            dequantized[name] = tensor
    for layer, (k_scale, v_scale) in (kv_scales or {}).items():
        quantized[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k_scale)
        quantized[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(v_scale)
    for out in (out_dir, dequantized_dir):
        for old in out.glob("*.safetensors"):
            old.unlink()
    save_file(quantized, out_dir / "model.safetensors", metadata={"format": "pt"})
    save_file(dequantized, dequantized_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out_dir / "config.json").read_text())
    if fmt == "fp8":
        qc = {"quant_method": "fp8", "activation_scheme": "static" if static_inputs else "dynamic", "fmt": "e4m3"}
        if block:
            qc["weight_block_size"] = list(block)
    else:
        activations = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": not static_inputs,
                       "strategy": "tensor" if static_inputs else "token"}
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy,
                   "block_structure": list(block) if block else None}
        qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                            "input_activations": activations}},
              "ignore": ["lm_head"],
              "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                  "symmetric": True} if kv_scales else None}
    config["quantization_config"] = qc
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
