"""gpt-oss (OpenAI's 20b / 120b): the Llama layers with options (``models.family``): attention sinks, sliding
and full layers alternating, YaRN, q/k/v/o biases, and experts with a biased router and a clamped SwiGLU.

What is its own is the checkpoint's expert layout, rewritten here into the per-expert tensors the shared MoE
layer loads: one [E, H, 2I] gate_up tensor (gate and up interleaved by column) and one [E, I, H] down tensor
per layer, or the same as MXFP4 ``*_blocks`` + ``*_scales`` (the released checkpoints), dequantized to the
model's dtype while loading, an expert at a time. Kept dequantized on GPU too: no 4-bit expert kernel here yet.
"""

import re
from collections.abc import Iterator

import torch

from pagoda.models.llama import LlamaForCausalLM

# FP4 (e2m1) values by their 4-bit code, as the MXFP4 format defines them
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

_EXPERTS = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)"
                      r"(?P<part>_bias|_blocks|_scales)?$")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 -> dtype. blocks [..., G, 16] uint8 (two FP4 codes a byte, low nibble first), scales [..., G] uint8
    (a power of two per 32 values, biased by 127) -> [..., G * 32]: the [out, in] weight."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    blocks = blocks.to(torch.uint8)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)  # [..., G, 16, 2]
    values = values.flatten(-2) * torch.exp2(scales.to(torch.float32) - 127).unsqueeze(-1)
    return values.flatten(-2).to(dtype)


class GptOssForCausalLM(LlamaForCausalLM):
    def checkpoint_to_param(self, name: str):
        return super().checkpoint_to_param(name.replace(".mlp.router.", ".mlp.gate."))

    def checkpoint_tensors(self, tensors: Iterator[tuple[str, object]]) -> Iterator[tuple[str, object]]:
        """The checkpoint's stacked experts as per-expert gate/up/down tensors (and their biases), MXFP4 pairs
        dequantized; other tensors pass through."""
        dtype = self.model.norm.weight.dtype if self.model.norm is not None else torch.get_default_dtype()
        halves: dict[str, tuple[str, object]] = {}  # an MXFP4 tensor waiting for its other half
        for name, tensor in tensors:
            match = _EXPERTS.match(name)
            if match is None:
                yield name, tensor
                continue
            prefix, proj, part = match["prefix"], match["proj"], match["part"] or ""
            if part in ("_blocks", "_scales"):
                key = f"{prefix}.{proj}"
                if key not in halves:
                    halves[key] = (part, tensor)
                    continue
                other_part, other = halves.pop(key)
                blocks, scales = (tensor, other) if part == "_blocks" else (other, tensor)
                for e in range(_rows(blocks)):  # [out, in] per expert already
                    yield from self._expert_tensors(prefix, e, proj, "weight",
                                                    dequantize_mxfp4(_row(blocks, e), _row(scales, e), dtype))
            elif part == "_bias":
                for e in range(_rows(tensor)):
                    yield from self._expert_tensors(prefix, e, proj, "bias", _row(tensor, e))
            else:  # transformers' layout: [E, in, out]
                for e in range(_rows(tensor)):
                    yield from self._expert_tensors(prefix, e, proj, "weight", _row(tensor, e).t())
        if halves:
            raise ValueError(f"checkpoint has MXFP4 tensors without their blocks or scales: {sorted(halves)}")

    def _expert_tensors(self, prefix: str, expert: int, proj: str, kind: str, tensor: torch.Tensor):
        if self.checkpoint_to_param(f"{prefix}.{expert}.down_proj.weight") is None:
            return  # another rank's expert, or another stage's layer
        if proj == "down_proj":
            yield f"{prefix}.{expert}.down_proj.{kind}", tensor.contiguous()
        else:  # gate and up interleaved by output row
            yield f"{prefix}.{expert}.gate_proj.{kind}", tensor[0::2].contiguous()
            yield f"{prefix}.{expert}.up_proj.{kind}", tensor[1::2].contiguous()


def _rows(tensor) -> int:
    return tensor.get_shape()[0] if hasattr(tensor, "get_shape") else tensor.shape[0]


def _row(tensor, index: int) -> torch.Tensor:
    """One expert's tensor out of a stacked one (a lazy safetensors slice reads only that expert)."""
    return tensor[index : index + 1][0]
