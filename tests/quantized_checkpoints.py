"""Tiny GPTQ and AWQ int4 checkpoints for tests, packed as AutoGPTQ / GPTQModel (``QuantLinear.pack``) and
AutoAWQ (``WQLinear_GEMM.from_linear``) pack them, plus the same model with the dequantized weights in
float32, which transformers loads as the reference.

Quantization is round-to-nearest on each format's grid (GPTQ's ``Quantizer``: sym zero point 8, asym
round(-min / scale); AWQ's ``pseudo_quantize_tensor``); the calibration of the real tools changes which
codes are chosen, not how they are stored."""

import json
import shutil
from pathlib import Path

import numpy as np
import torch

LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def gptq_quantize(weight: torch.Tensor, group_size: int, sym: bool):
    """weight [N, K] -> codes [N, K] int, scales [N, G] float16, zeros [N, G] int, dequantized [N, K] float32."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // group_size, group_size)
    xmin = groups.amin(-1).clamp(max=0)
    xmax = groups.amax(-1).clamp(min=0)
    if sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        scales = (2 * xmax / 15).clamp(min=1e-5)
        zeros = torch.full_like(scales, 8)
    else:
        scales = ((xmax - xmin) / 15).clamp(min=1e-5)
        zeros = torch.round(-xmin / scales)
    scales = scales.half()  # stored in float16: dequantize with what is stored
    codes = torch.clamp(torch.round(groups / scales.float()[..., None]) + zeros[..., None], 0, 15)
    dequantized = scales.float()[..., None] * (codes - zeros[..., None])
    return codes.reshape(n, k).int(), scales, zeros.int(), dequantized.reshape(n, k)


def awq_quantize(weight: torch.Tensor, group_size: int):
    """weight [N, K] -> codes [N, K] int, scales [N, G] float16, zeros [N, G] int, dequantized [N, K] float32."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // group_size, group_size)
    high, low = groups.amax(-1), groups.amin(-1)
    scales = ((high - low).clamp(min=1e-5) / 15).half()
    zeros = (-torch.round(low / scales.float())).clamp(0, 15)
    codes = torch.clamp(torch.round(groups / scales.float()[..., None]) + zeros[..., None], 0, 15)
    dequantized = (codes - zeros[..., None]) * scales.float()[..., None]
    return codes.reshape(n, k).int(), scales, zeros.int(), dequantized.reshape(n, k)


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_like_autoawq(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> dict[str, torch.Tensor]:
    """AutoAWQ's GEMM packing: qweight [K, N/8] and qzeros [G, N/8] with eight values of neighbouring output
    columns per int32, column 8 * col + AWQ_ORDER[i] in bits 4i..4i+3; scales [G, N] float16."""
    def pack(values: torch.Tensor) -> torch.Tensor:  # [R, C] -> [R, C / 8]
        packed = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int32)
        for col in range(values.shape[1] // 8):
            for i in range(8):
                packed[:, col] |= values[:, col * 8 + AWQ_ORDER[i]].to(torch.int32) << (i * 4)
        return packed

    return {"qweight": pack(codes.t().contiguous()), "qzeros": pack(zeros.t().contiguous()),
            "scales": scales.t().contiguous()}


def pack_like_autogptq(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                       fmt: str = "gptq") -> dict[str, torch.Tensor]:
    """AutoGPTQ's pack loops: qweight [K/8, N] (eight codes of consecutive input rows per int32, lowest bits
    first), qzeros [G, N/8] (zero points of consecutive output columns; the "gptq" format stores zero - 1),
    scales [G, N] float16, g_idx [K]."""
    intweight = codes.t().contiguous().numpy().astype(np.uint32)  # [K, N]
    qweight = np.zeros((intweight.shape[0] // 8, intweight.shape[1]), dtype=np.uint32)
    i = row = 0
    while row < qweight.shape[0]:
        for j in range(i, i + 8):
            qweight[row] |= intweight[j] << (4 * (j - i))
        i += 8
        row += 1
    stored_zeros = zeros.t().contiguous() - (1 if fmt == "gptq" else 0)  # [G, N]
    stored_zeros = stored_zeros.numpy().astype(np.uint32)
    qzeros = np.zeros((stored_zeros.shape[0], stored_zeros.shape[1] // 8), dtype=np.uint32)
    i = col = 0
    while col < qzeros.shape[1]:
        for j in range(i, i + 8):
            qzeros[:, col] |= stored_zeros[:, j] << (4 * (j - i))
        i += 8
        col += 1
    k = codes.shape[1]
    return {"qweight": torch.from_numpy(qweight.astype(np.int32)),
            "qzeros": torch.from_numpy(qzeros.astype(np.int32)),
            "scales": scales.t().contiguous(),
            "g_idx": torch.arange(k, dtype=torch.int32) // group_size}


def write_quantized_model(float_dir: Path, out_dir: Path, dequantized_dir: Path, method: str = "gptq",
                          group_size: int = 32, sym: bool = True, fmt: str = "gptq", **config_overrides) -> None:
    """From a float checkpoint: a GPTQ or AWQ checkpoint and its dequantized twin (same config, float32)."""
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
            if method == "gptq":
                codes, scales, zeros, deq = gptq_quantize(tensor, group_size, sym)
                assert (zeros > 0).all(), "the gptq format cannot store a zero point of 0"
                packed = pack_like_autogptq(codes, scales, zeros, group_size, fmt)
                if f"{module}.bias" not in tensors:  # AutoGPTQ saves a bias for every layer, zero if none
                    packed["bias"] = torch.zeros(tensor.shape[0], dtype=torch.float16)
            else:
                codes, scales, zeros, deq = awq_quantize(tensor, group_size)
                packed = pack_like_autoawq(codes, scales, zeros)
            for suffix, value in packed.items():
                quantized[f"{module}.{suffix}"] = value
            dequantized[name] = deq
        else:
            quantized[name] = tensor
            dequantized[name] = tensor
    for out in (out_dir, dequantized_dir):
        for old in out.glob("*.safetensors"):
            old.unlink()
    save_file(quantized, out_dir / "model.safetensors", metadata={"format": "pt"})
    save_file(dequantized, dequantized_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out_dir / "config.json").read_text())
    if method == "gptq":
        config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group_size,
                                         "desc_act": False, "sym": sym, "checkpoint_format": fmt}
    else:
        config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group_size,
                                         "zero_point": True, "version": "gemm", "modules_to_not_convert": None}
    config["quantization_config"].update(config_overrides)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))


def write_gptq_model(float_dir, gptq_dir, dequantized_dir, group_size=32, sym=True, fmt="gptq", **overrides):
    write_quantized_model(float_dir, gptq_dir, dequantized_dir, "gptq", group_size, sym, fmt, **overrides)
