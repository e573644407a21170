"""`quantization=` / `--quantization`: values checked before anything loads, the GPTQ format found from
config.json, and every refusal naming the argument (or flag) it concerns."""

import json
import shutil
from types import SimpleNamespace

import pytest

from pagoda.config import EngineArgs, create_engine_config
from pagoda.config.quantization import QuantizationConfig, resolve_quantization
from pagoda.entrypoints.cli import main

pytestmark = pytest.mark.unit


def hf_config(hidden=576, heads=9, intermediate=1536, **quantization_config):
    return SimpleNamespace(hidden_size=hidden, num_attention_heads=heads, intermediate_size=intermediate,
                           quantization_config=quantization_config or None)


GPTQ = dict(quant_method="gptq", bits=4, group_size=128, desc_act=False, sym=True)
AWQ = dict(quant_method="awq", bits=4, group_size=128, zero_point=True, version="gemm")
VLLM_FP8 = dict(quant_method="fp8", activation_scheme="dynamic", fmt="e4m3")


def ct_fp8(**weights):
    """compressed-tensors' FP8_DYNAMIC scheme (llm-compressor), weights overridden."""
    w = {**dict(num_bits=8, type="float", symmetric=True, dynamic=False, strategy="channel"), **weights}
    return dict(quant_method="compressed-tensors", format="float-quantized", ignore=["lm_head"],
                config_groups={"group_0": {"targets": ["Linear"], "weights": w, "input_activations": dict(
                    num_bits=8, type="float", symmetric=True, dynamic=True, strategy="token")}})


def test_fp8_online_and_from_checkpoints():
    assert resolve_quantization("fp8", None, hf_config()) == \
        QuantizationConfig("fp8", fp8_format="online", fp8_strategy="channel")
    assert resolve_quantization(None, None, hf_config(**VLLM_FP8)) == \
        QuantizationConfig("fp8", fp8_format="fp8", fp8_strategy="tensor")
    deepseek = dict(VLLM_FP8, weight_block_size=[128, 128])
    assert resolve_quantization("fp8", None, hf_config(hidden=4096, heads=32, intermediate=11008, **deepseek),
                                tp_size=2) == QuantizationConfig("fp8", fp8_format="fp8", fp8_strategy="block",
                                                                 fp8_block=(128, 128), fp8_scale_name="weight_scale_inv")
    with pytest.raises(ValueError, match=r"fp8 weight block \(128 input columns\) does not divide .* 576"):
        resolve_quantization(None, None, hf_config(**deepseek), tp_size=2)
    assert resolve_quantization(None, None, hf_config(**deepseek), tp_size=1).fp8_block == (128, 128)
    for strategy in ("tensor", "channel"):
        assert resolve_quantization(None, None, hf_config(**ct_fp8(strategy=strategy))) == \
            QuantizationConfig("fp8", fp8_format="compressed-tensors", fp8_strategy=strategy)
    block = resolve_quantization(None, None, hf_config(**ct_fp8(strategy="block", block_structure=[128, 128])))
    assert (block.fp8_strategy, block.fp8_block, block.fp8_scale_name) == ("block", (128, 128), "weight_scale")


def test_int4_group_is_32_unless_asked():
    llama_7b = hf_config(hidden=4096, heads=32, intermediate=11008)
    assert resolve_quantization("int4", None, llama_7b) == QuantizationConfig("int4", 32)
    assert resolve_quantization("int4", 128, llama_7b, tp_size=2) == QuantizationConfig("int4", 128)
    assert resolve_quantization("int4", 64, hf_config()) == QuantizationConfig("int4", 64)  # 576 = 9 x 64
    assert resolve_quantization("int8", None, hf_config()) == QuantizationConfig("int8")
    assert resolve_quantization(None, None, hf_config()) is None


def test_awq_is_found_from_the_checkpoint():
    llama_7b = dict(hidden=4096, heads=32, intermediate=11008)
    assert resolve_quantization(None, None, hf_config(**llama_7b, **AWQ)) == QuantizationConfig("awq", 128)
    old_names = dict(quant_method="awq", w_bit=4, q_group_size=64, zero_point=True, version="GEMM")
    assert resolve_quantization("awq", None, hf_config(**old_names)) == QuantizationConfig("awq", 64)


def test_gptq_is_found_from_the_checkpoint():
    assert resolve_quantization(None, None, hf_config(hidden=4096, heads=32, intermediate=11008, **GPTQ)) == \
        QuantizationConfig("gptq", 128, zero_offset=1)
    v2 = dict(GPTQ, group_size=64, checkpoint_format="gptq_v2")
    assert resolve_quantization("gptq", None, hf_config(**v2)) == QuantizationConfig("gptq", 64, zero_offset=0)


@pytest.mark.parametrize("quantization,group_size,config,match", [
    ("int3", None, hf_config(), r"quantization must be one of int8, int4, fp8, gptq, awq .*'int3'"),
    ("int4", 48, hf_config(), "quantization_group_size must be one of 32, 64, 128"),
    ("int8", 64, hf_config(), "quantization_group_size applies to quantization='int4' only"),
    (None, 64, hf_config(), "quantization_group_size is set but quantization is not"),
    ("int4", 128, hf_config(), r"quantization_group_size \(128\) does not divide the input size of qkv_proj"),
    ("int4", None, hf_config(hidden=48, heads=3), r"quantization_group_size \(32\) does not divide"),
    ("int4", 64, hf_config(hidden=64, heads=4, intermediate=128), None),
    ("gptq", None, hf_config(), "needs a checkpoint quantized with gptq"),
    ("int8", None, hf_config(**GPTQ), "already quantized with gptq"),
    (None, None, hf_config(quant_method="bitsandbytes"), "quant_method='bitsandbytes' are not supported: Pagoda "
                                                           "loads GPTQ and AWQ int4 checkpoints and FP8"),
    ("int8", None, hf_config(**VLLM_FP8), "already quantized with fp8"),
    (None, None, hf_config(**dict(VLLM_FP8, fmt="e5m2")), "fmt='e5m2'"),
    (None, None, hf_config(**dict(VLLM_FP8, ignored_layers=["lm_head", "model.layers.0.mlp.down_proj"])),
     r"ignored_layers=\['model.layers.0.mlp.down_proj'\]"),
    (None, None, hf_config(**dict(VLLM_FP8, weight_block_size=[128])), "weight_block_size=\\[128\\]"),
    (None, None, hf_config(**ct_fp8(num_bits=4, type="int")), "weights type='int' num_bits=4"),
    (None, None, hf_config(**ct_fp8(strategy="group")), "strategy='group'"),
    (None, None, hf_config(**ct_fp8(strategy="block")), "strategy=block without block_structure"),
    (None, None, hf_config(**dict(ct_fp8(), format="pack-quantized")), "format='pack-quantized'"),
    ("int4", None, hf_config(**AWQ), "already quantized with awq"),
    ("awq", None, hf_config(**GPTQ), "already quantized with gptq"),
    (None, None, hf_config(**dict(AWQ, version="gemv")), "version='gemv'"),
    (None, None, hf_config(**dict(AWQ, zero_point=False)), "zero_point=false"),
    (None, None, hf_config(**dict(AWQ, modules_to_not_convert=["o_proj"])), "modules_to_not_convert"),
    (None, None, hf_config(**dict(GPTQ, bits=8)), "bits=8"),
    (None, None, hf_config(**dict(GPTQ, desc_act=True)), "desc_act=true"),
    (None, None, hf_config(**dict(GPTQ, group_size=-1)), "group_size=-1"),
    (None, None, hf_config(**dict(GPTQ, lm_head=True)), "lm_head=true"),
    (None, None, hf_config(**dict(GPTQ, checkpoint_format="marlin")), "checkpoint_format='marlin'"),
])
def test_refusals_name_what_is_wrong(quantization, group_size, config, match):
    if match is None:
        assert resolve_quantization(quantization, group_size, config, tp_size=1).group_size == 64
        with pytest.raises(ValueError, match="o_proj .* 32 with tensor_parallel_size=2"):
            resolve_quantization(quantization, group_size, config, tp_size=2)
        return
    with pytest.raises(ValueError, match=match):
        resolve_quantization(quantization, group_size, config)


def test_bad_value_is_refused_before_the_model_is_read(tmp_path):
    # the model path does not exist: the quantization value is checked first
    with pytest.raises(ValueError, match="quantization must be one of"):
        create_engine_config(EngineArgs(model=str(tmp_path / "absent"), quantization="fp4"))


def test_engine_args_resolve_the_scheme(tiny_llama_dir):
    config = create_engine_config(EngineArgs(model=str(tiny_llama_dir), quantization="int4", tensor_parallel_size=2))
    assert config.model.quantization == QuantizationConfig("int4", 32)
    with pytest.raises(ValueError, match="quantization_group_size .64. does not divide"):
        create_engine_config(EngineArgs(model=str(tiny_llama_dir), quantization="int4", quantization_group_size=64,
                   tensor_parallel_size=2))


def test_unsupported_quantized_checkpoint_is_refused(tiny_llama_dir, tmp_path):
    path = tmp_path / "bnb"
    shutil.copytree(tiny_llama_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method='bitsandbytes' are not supported: Pagoda loads GPTQ"):
        create_engine_config(EngineArgs(model=str(path)))


@pytest.mark.parametrize("flags,message", [
    (["--quantization", "int3"], "argument --quantization: invalid choice: 'int3'"),
    (["--quantization", "awq"], "--quantization='awq' needs a checkpoint quantized with awq"),
    (["--quantization", "int4", "--quantization-group-size", "48"],
     "argument --quantization-group-size: invalid choice: 48"),
    (["--quantization", "int4", "--quantization-group-size", "64", "--tensor-parallel-size", "2"],
     "--quantization-group-size (64) does not divide"),
    (["--quantization", "gptq"], "--quantization='gptq' needs a checkpoint quantized with gptq"),
])
def test_serve_flags_are_checked_before_the_port_opens(tiny_llama_dir, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", str(tiny_llama_dir), *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_serve_flag_from_the_environment(tiny_llama_dir, capsys, monkeypatch):
    monkeypatch.setenv("PAGODA_QUANTIZATION", "int2")
    with pytest.raises(SystemExit):
        main(["serve", str(tiny_llama_dir)])
    assert "PAGODA_QUANTIZATION" in capsys.readouterr().err
