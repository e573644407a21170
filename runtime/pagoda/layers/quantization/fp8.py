"""FP8 (e4m3) linear weights: online (``quantization="fp8"``, one scale per output channel) or from a
checkpoint (vLLM's ``fp8`` format, per tensor or per [bn, bk] block; ``compressed-tensors`` FP8, per tensor,
channel or block).

Every layout lands in one: ``qweight`` float8_e4m3fn [N, K] and ``weight_scale`` float32 [N, G], where
w[n, k] = qweight[n, k] * weight_scale[n, k // block_k] (G = 1 and block_k = K for a scale per channel). A
per-tensor scale (one per q/k/v or gate/up shard in a fused layer) is spread to its rows as it loads, and a
block scale to the rows of its block, so the layers' loaders shard scales by output rows exactly as they
shard weights.

The matmul: on GPUs with FP8 tensor cores (compute capability 8.9+) and per-channel scales,
``torch._scaled_mm`` with the activations quantized per token on the fly; on CPU in bfloat16, where the C++
kernel is built, ``fp8_matmul_cpu`` (the weight packed once into its layout and widened in registers); everywhere
else weight-only, the weight upcast to the activations' dtype a chunk of output rows at a time (never the whole
matrix at once).
Checkpoints' static ``input_scale`` are read and not used: activations are always scaled per token."""

import math

import torch
import torch.nn.functional as F

from pagoda.config.quantization import QuantizationConfig
from pagoda.layers import fp8_matmul_cpu
from pagoda.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    copy_checked,
)
from pagoda.layers.quantization.fp8_cast import upcast
from pagoda.layers.quantization.int8 import row_absmax

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
UPCAST_CHUNK_ELEMENTS = 1 << 21  # weight elements upcast at once on the weight-only path (4 MiB in bfloat16)


def quantize_rows(weight: torch.Tensor, absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K], absmax [N] -> qweight [N, K] fp8 e4m3, scales [N, 1] float32 (absmax maps to 448)."""
    scales = (absmax.float() / FP8_MAX).clamp(min=1e-12)[:, None]
    q = (weight.float() / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scales


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, block_k: int | None = None) -> torch.Tensor:
    """[N, K] fp8, [N, G] with a scale per block_k input columns (the last block may be partial) -> [N, K]
    float32. block_k None: K / G."""
    block_k = block_k or qweight.shape[1] // scales.shape[1]
    return upcast(qweight, torch.float32) * scales.repeat_interleave(block_k, dim=1)[:, : qweight.shape[1]]


def weight_only_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                       block_k: int | None = None) -> torch.Tensor:
    """x [..., K] @ (qweight * scales).T in x's dtype, upcasting UPCAST_CHUNK_ELEMENTS of the weight at a time."""
    n, k = qweight.shape
    x2 = x.reshape(-1, k)
    rows = max(1, UPCAST_CHUNK_ELEMENTS // k)
    per_channel = scales.shape[1] == 1
    chunks = []
    for start in range(0, n, rows):
        q, s = qweight[start : start + rows], scales[start : start + rows]
        if per_channel:  # scale the (smaller) output instead of the weight
            chunks.append(F.linear(x2, upcast(q, x.dtype)) * s[:, 0].to(x.dtype))
        else:
            chunks.append(F.linear(x2, dequantize(q, s, block_k).to(x.dtype)))
    y = chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=1)
    return y.view(*x.shape[:-1], n)


def scaled_mm_supported(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> bool:
    """FP8 tensor cores (sm_89+), per-channel scales, bfloat16 activations and the 16-multiples cuBLASLt needs."""
    return (x.device.type == "cuda" and x.dtype == torch.bfloat16 and scales.shape[1] == 1
            and qweight.shape[0] % 16 == 0 and qweight.shape[1] % 16 == 0
            and torch.cuda.get_device_capability(x.device) >= (8, 9))


def scaled_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """W8A8: x quantized per token (its largest |value| maps to 448), one FP8 GEMM with row-wise scales."""
    k = qweight.shape[1]
    x2 = x.reshape(-1, k)
    x_scale = (x2.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)  # [M, 1]
    xq = (x2.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    y = torch._scaled_mm(xq, qweight.t(), scale_a=x_scale, scale_b=scales.t().contiguous(), out_dtype=x.dtype)
    return y.view(*x.shape[:-1], qweight.shape[0])


def matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, block_k: int | None = None
           ) -> torch.Tensor:
    if scaled_mm_supported(x, qweight, scales):
        return scaled_mm(x, qweight, scales)
    return weight_only_matmul(x, qweight, scales, block_k)


class Fp8Weights:
    """What every FP8 layer runs once loaded: qweight [N, K] fp8 and weight_scale [N, G], one scale per
    block_k input columns (None: per row)."""

    block_k: int | None = None

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if _cpu_packed(layer) and x.dtype == torch.bfloat16:
            n, k = layer.weight_scale.shape[0], x.shape[-1]
            return fp8_matmul_cpu.linear(x, layer.qweight, layer.weight_scale, self.block_k or k, n, bias)
        y = matmul(x, plain_qweight(layer), layer.weight_scale, self.block_k)
        return y + bias if bias is not None else y

    def dequantized_weight(self, layer) -> torch.Tensor:
        return dequantize(plain_qweight(layer), layer.weight_scale, self.block_k)

    def cpu_kernel_weights(self, layer) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """(packed weight, scales, block_k) of a layer packed for fp8_matmul_cpu (the C++ layer loop calls the
        kernel with them, as apply does); None when it is not."""
        if not _cpu_packed(layer):
            return None
        return layer.qweight, layer.weight_scale, self.block_k or 2 * layer.qweight.shape[1]

    def pack_for_cpu(self, layer) -> None:
        """For bfloat16 inference on CPU (packed_weights.pack_weights calls it): qweight into fp8_matmul_cpu's
        layout, where its kernel is built and takes this weight; else it stays [N, K]."""
        if fp8_matmul_cpu.can_pack(layer.qweight, self.block_k) and fp8_matmul_cpu.available():
            layer.qweight = fp8_matmul_cpu.pack(layer.qweight)


def _cpu_packed(layer) -> bool:
    return layer.qweight.dim() == 4


def plain_qweight(layer) -> torch.Tensor:
    """The layer's [N, K] fp8 weight, whichever layout it holds."""
    if _cpu_packed(layer):
        return fp8_matmul_cpu.unpack(layer.qweight, layer.weight_scale.shape[0])
    return layer.qweight


class Fp8OnlineMethod(Fp8Weights):
    """quantization="fp8": the float weight loads as usual, then is quantized per output channel (the ranks of
    a row-parallel layer agree on each row's maximum, as for int8)."""
    block_k = None  # one scale per row

    def create_weights(self, layer) -> None:
        pass

    def process_weights_after_loading(self, layer) -> None:
        weight = layer.weight.detach()
        qweight, scales = quantize_rows(weight, row_absmax(layer, weight))
        layer.weight = None
        layer.register_buffer("qweight", qweight, persistent=False)
        layer.register_buffer("weight_scale", scales, persistent=False)



def _full_rows(layer, shard_id) -> int:
    """Output rows of the whole (unsharded) checkpoint tensor that loads into ``shard_id`` of ``layer``."""
    if isinstance(layer, QKVParallelLinear):
        heads = layer.num_heads * layer.tp_size if shard_id == "q" else layer.total_num_kv_heads
        return heads * layer.head_size
    if isinstance(layer, MergedColumnParallelLinear):
        return layer.output_sizes[shard_id]
    if isinstance(layer, ColumnParallelLinear):
        return layer.output_size_per_rank * layer.tp_size
    return layer.weight.shape[0]


class Fp8CheckpointMethod(Fp8Weights):
    """A checkpoint's FP8 weights (``config.fp8_format`` "fp8" or "compressed-tensors")."""

    def __init__(self, config: QuantizationConfig):
        self.strategy = config.fp8_strategy  # tensor | channel | block
        self.block = config.fp8_block  # (bn, bk) for block
        self.block_k = None if self.block is None else self.block[1]
        self.scale_name = config.fp8_scale_name  # weight_scale | weight_scale_inv

    def create_weights(self, layer) -> None:
        n, k = layer.weight.shape
        device = layer.weight.device
        groups = 1 if self.block is None else math.ceil(k / self.block[1])
        layer.weight = None
        with torch.device(device):
            layer.add_param("weight", (n, k), dtype=FP8)
            layer.add_param(self.scale_name, (n, groups), dtype=torch.float32,
                            loader=lambda param, loaded, shard_id=None: self._load_scale(layer, param, loaded, shard_id))

    def _load_scale(self, layer, param, loaded, shard_id) -> None:
        """A per-tensor, per-channel or per-block scale, spread to one row per output row, then sharded."""
        scale = loaded[...].float()  # [...]: safetensors slices of 0-dim tensors refuse [:]
        rows = _full_rows(layer, shard_id)
        if scale.numel() == 1:  # per tensor ([], [1] or [1, 1])
            scale = scale.reshape(1, 1).expand(rows, 1)
        elif scale.dim() == 1:  # per channel, saved flat
            scale = scale[:, None]
        if self.block is not None:
            scale = scale.repeat_interleave(self.block[0], dim=0)[:rows]
        if scale.shape[0] != rows:
            raise ValueError(f"{self.scale_name} has {loaded[...].shape[0]} rows for {rows} output rows ({self.strategy} "
                             f"scales{'' if self.block is None else f' of blocks {self.block}'})")
        if layer.input_is_sharded:  # row-parallel: every rank keeps all rows, its own blocks of input columns
            groups = param.shape[1]
            if scale.shape[1] != 1:
                scale = scale[:, layer.tp_rank * groups : (layer.tp_rank + 1) * groups]
            copy_checked(param, scale.contiguous(), self.scale_name)
        else:
            layer.weight_loader(param, scale.contiguous(), shard_id)

    def convert_checkpoint_tensor(self, name: str, loaded):
        if name.endswith(".input_scale"):  # static activation scales: activations are scaled per token instead
            return None
        return name, loaded

    def process_weights_after_loading(self, layer) -> None:
        qweight, scales = layer.weight.data, getattr(layer, self.scale_name).data
        layer.weight = None
        delattr(layer, self.scale_name)
        layer.register_buffer("qweight", qweight, persistent=False)
        layer.register_buffer("weight_scale", scales, persistent=False)

