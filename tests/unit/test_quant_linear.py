"""Quantized linear layers against their dequantized weights: int8 per output channel, int4 per group
(32 / 64 / 128), GPTQ and AWQ tensors packed as AutoGPTQ and AutoAWQ pack them; torch's CPU kernels and the torch-ops path
GPU devices take."""

import pytest
import torch
import torch.nn.functional as F
from quantized_checkpoints import awq_quantize, gptq_quantize, pack_like_autoawq, pack_like_autogptq

from pagoda.config.quantization import QuantizationConfig
from pagoda.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagoda.layers.quantization import int4, int8
from pagoda.layers.quantization.awq import AWQMethod
from pagoda.layers.quantization.gptq import GPTQMethod
from pagoda.layers.quantization.methods import make_method

pytestmark = pytest.mark.unit

DTYPES = [torch.float32, torch.bfloat16]
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=0.15, rtol=2e-2)}


def float_layer(k: int, n: int, dtype: torch.dtype, bias: bool = True, cls=ColumnParallelLinear):
    torch.manual_seed(0)
    layer = cls(k, n, bias=bias).to(dtype)
    torch.nn.init.normal_(layer.weight, std=0.5)
    if bias:
        torch.nn.init.normal_(layer.bias)
    return layer


def quantize(layer, config: QuantizationConfig):
    method = make_method(config)
    layer.quant_method = method
    method.create_weights(layer)
    method.process_weights_after_loading(layer)
    return method


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 33])
def test_int8_layer_equals_its_dequantized_weight(dtype, rows):
    layer = float_layer(96, 80, dtype)
    weight = layer.weight.detach().float().clone()
    method = quantize(layer, QuantizationConfig("int8"))
    assert layer.weight is None and layer.qweight.dtype == torch.int8 and layer.qweight.shape == (80, 96)
    dequantized = method.dequantized_weight(layer)
    # round to nearest: at most half a step per weight, the step being the row's max |w| / 127
    step = weight.abs().amax(dim=1, keepdim=True) / 127
    assert ((dequantized - weight).abs() <= step / 2 * 1.01 + 1e-6).all()
    x = torch.randn(rows, 96, dtype=dtype)
    expected = F.linear(x.float(), dequantized, layer.bias.float())
    torch.testing.assert_close(layer(x).float(), expected, **TOLERANCE[dtype])
    gpu_path = int8.matmul_dequantized(x, layer.qweight, layer.scales) + layer.bias
    torch.testing.assert_close(gpu_path.float(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("cpu_kernel", [True, False], ids=["cpu-kernel", "torch-ops"])
def test_int4_layer_equals_its_dequantized_weight(dtype, group_size, cpu_kernel, monkeypatch):
    if not cpu_kernel:  # the layout GPUs (and CPU layers whose width is not a multiple of 16) use
        monkeypatch.setattr(int4, "cpu_kernel_fits", lambda device, n: False)
    layer = float_layer(256, 96, dtype)
    weight = layer.weight.detach().float().clone()
    method = quantize(layer, QuantizationConfig("int4", group_size))
    assert layer.weight is None and layer.int4_cpu_packed == cpu_kernel
    assert layer.scales_and_zeros.shape == (256 // group_size, 96, 2)
    dequantized = method.dequantized_weight(layer)
    groups = weight.reshape(96, -1, group_size)
    step = (groups.amax(-1) - groups.amin(-1)).repeat_interleave(group_size, dim=1) / 15
    slack = 0.02 if dtype == torch.bfloat16 else 1e-3  # scales and zeros stored in the model's dtype
    assert ((dequantized - weight).abs() <= step * (0.5 + slack) + 1e-6).all()
    for rows in (1, 5, 40):
        x = torch.randn(rows, 256, dtype=dtype)
        expected = F.linear(x.float(), dequantized, layer.bias.float())
        torch.testing.assert_close(layer(x).float(), expected, **TOLERANCE[dtype])


def test_int4_width_not_a_multiple_of_16_takes_the_torch_ops_path():
    layer = float_layer(64, 24, torch.float32)
    method = quantize(layer, QuantizationConfig("int4", 32))
    assert not layer.int4_cpu_packed
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), F.linear(x, method.dequantized_weight(layer), layer.bias))


@pytest.mark.parametrize("sym,fmt", [(True, "gptq"), (False, "gptq"), (False, "gptq_v2")])
@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("cls", [ColumnParallelLinear, RowParallelLinear])
def test_gptq_tensors_load_to_the_dequantized_weight(sym, fmt, group_size, cls):
    k, n = 256, 48
    torch.manual_seed(1)
    codes, scales, zeros, dequantized = gptq_quantize(torch.randn(n, k), group_size, sym)
    saved = pack_like_autogptq(codes, scales, zeros, group_size, fmt)
    assert saved["qweight"].shape == (k // 8, n) and saved["qzeros"].shape == (k // group_size, n // 8)
    layer = float_layer(k, n, torch.float32, bias=False, cls=cls)
    method = GPTQMethod(group_size, zero_offset=1 if fmt == "gptq" else 0)
    layer.quant_method = method
    method.create_weights(layer)
    params = dict(layer.named_parameters())
    for suffix, tensor in saved.items():
        converted = method.convert_checkpoint_tensor(f"model.layers.0.mlp.down_proj.{suffix}", tensor)
        if suffix == "g_idx":
            assert converted is None
            continue
        params[suffix].weight_loader(params[suffix], converted[1])
    method.process_weights_after_loading(layer)
    torch.testing.assert_close(method.dequantized_weight(layer), dequantized, atol=1e-5, rtol=1e-5)
    x = torch.randn(4, k)
    torch.testing.assert_close(layer(x), x @ dequantized.t(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("cls", [ColumnParallelLinear, RowParallelLinear])
def test_awq_tensors_load_to_the_dequantized_weight(group_size, cls):
    k, n = 256, 48
    torch.manual_seed(2)
    codes, scales, zeros, dequantized = awq_quantize(torch.randn(n, k), group_size)
    saved = pack_like_autoawq(codes, scales, zeros)
    assert saved["qweight"].shape == (k, n // 8) and saved["qzeros"].shape == (k // group_size, n // 8)
    layer = float_layer(k, n, torch.float32, bias=False, cls=cls)
    method = AWQMethod(group_size)
    layer.quant_method = method
    method.create_weights(layer)
    params = dict(layer.named_parameters())
    for suffix, tensor in saved.items():
        _, converted = method.convert_checkpoint_tensor(f"model.layers.0.self_attn.o_proj.{suffix}", tensor)
        params[suffix].weight_loader(params[suffix], converted)
    method.process_weights_after_loading(layer)
    torch.testing.assert_close(method.dequantized_weight(layer), dequantized, atol=1e-5, rtol=1e-5)
    x = torch.randn(4, k)
    torch.testing.assert_close(layer(x), x @ dequantized.t(), atol=1e-4, rtol=1e-4)


def test_gptq_act_order_is_refused():
    method = GPTQMethod(32, 1)
    g_idx = (torch.arange(64, dtype=torch.int32) // 32).flip(0)
    with pytest.raises(ValueError, match="act-order"):
        method.convert_checkpoint_tensor("model.layers.0.mlp.down_proj.g_idx", g_idx)
