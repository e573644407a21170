"""Quantized engines against transformers running the dequantized weights (float32, greedy): online int8
and int4 (each group size the tiny models allow), GPTQ and AWQ checkpoints packed as AutoGPTQ and AutoAWQ
pack them."""

import json
import shutil

import pytest
import torch
from checkpoints import hf_greedy as hf_greedy_of
from quantized_checkpoints import LINEAR_NAMES, write_gptq_model, write_quantized_model
from safetensors.torch import load_file, save_file

from pagoda import LLM, SamplingParams
from pagoda.layers.linear import LinearBase
from pagoda.layers.quantization import int4, int8
from pagoda.layers.quantization.methods import weight_bytes

pytestmark = pytest.mark.model

PROMPTS = [
    "Hello, my name is",
    "The quick brown fox jumps over the lazy dog. Paged attention stores keys and values in blocks",
    "a",
    "Paris is the capital of",
]
MAX_TOKENS = 20


def hf_reference(path):
    return hf_greedy_of(path, PROMPTS, MAX_TOKENS)


def pagoda_greedy(path, **kwargs):
    llm = LLM(str(path), dtype="float32", kv_cache_memory=0.02, **kwargs)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                            use_tqdm=False)
        llm.engine.block_manager.check_no_leaks()
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.engine.shutdown()


def write_dequantized(float_dir, out_dir, dequantize):
    """The float checkpoint with every linear weight replaced by ``dequantize(weight)``."""
    shutil.copytree(float_dir, out_dir)
    (file,) = out_dir.glob("*.safetensors")
    tensors = load_file(file)
    for name, tensor in tensors.items():
        if name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEAR_NAMES:
            tensors[name] = dequantize(tensor)
    save_file(tensors, file, metadata={"format": "pt"})
    return out_dir


def int8_reference(weight):
    q, scales = int8.quantize_rows(weight, weight.abs().amax(dim=1))
    return q.float() * scales[:, None]


def int4_reference(group_size):
    def dequantize(weight):
        codes, scales, zeros = int4.quantize_groups(weight, group_size, weight.dtype)
        return ((codes.float() - 8) * scales.repeat_interleave(group_size, 1)
                + zeros.repeat_interleave(group_size, 1))
    return dequantize


@pytest.mark.parametrize("arch,quantization,group_size", [
    ("llama", "int8", None), ("llama", "int4", 32), ("llama", "int4", 64), ("qwen2", "int8", None),
    ("qwen2", "int4", 64),
])
def test_online_quantization_matches_transformers_on_the_dequantized_weights(
        tiny_model_factory, tmp_path, arch, quantization, group_size):
    path = tiny_model_factory(arch)
    dequantize = int8_reference if quantization == "int8" else int4_reference(group_size)
    reference = hf_reference(write_dequantized(path, tmp_path / "dequantized", dequantize))
    got = pagoda_greedy(path, quantization=quantization, quantization_group_size=group_size)
    assert got == reference
    assert got != hf_reference(path) or quantization == "int8"  # int4 is coarse enough to change the tokens


def test_int4_group_128_on_a_wider_model(tiny_model_factory, tmp_path):
    path = tiny_model_factory("llama", hidden=128, num_heads=4)
    reference = hf_reference(write_dequantized(path, tmp_path / "dequantized", int4_reference(128)))
    assert pagoda_greedy(path, quantization="int4", quantization_group_size=128) == reference


@pytest.mark.parametrize("arch,group_size,sym,fmt", [
    ("llama", 32, True, "gptq"), ("llama", 64, False, "gptq"), ("qwen2", 32, False, "gptq_v2"),
])
def test_gptq_checkpoint_matches_transformers_on_the_dequantized_weights(
        tiny_model_factory, tmp_path, arch, group_size, sym, fmt):
    gptq, dequantized = tmp_path / "gptq", tmp_path / "dequantized"
    write_gptq_model(tiny_model_factory(arch), gptq, dequantized, group_size, sym, fmt)
    assert pagoda_greedy(gptq) == hf_reference(dequantized)  # found from config.json, no argument


@pytest.mark.parametrize("arch,group_size", [("llama", 32), ("qwen2", 64)])
def test_awq_checkpoint_matches_transformers_on_the_dequantized_weights(tiny_model_factory, tmp_path, arch,
                                                                          group_size):
    awq, dequantized = tmp_path / "awq", tmp_path / "dequantized"
    write_quantized_model(tiny_model_factory(arch), awq, dequantized, "awq", group_size)
    assert pagoda_greedy(awq) == hf_reference(dequantized)


def test_gptq_checkpoint_with_a_real_bias_where_the_model_has_none_is_refused(tiny_model_factory, tmp_path):
    gptq = tmp_path / "gptq"
    write_gptq_model(tiny_model_factory("llama"), gptq, tmp_path / "dequantized")
    tensors = load_file(gptq / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.bias"] += 1
    save_file(tensors, gptq / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="down_proj.bias matches no parameter"):
        LLM(str(gptq), dtype="float32", kv_cache_memory=0.02)


def test_gptq_act_order_checkpoint_is_refused_at_configuration(tiny_model_factory, tmp_path):
    gptq = tmp_path / "gptq"
    write_gptq_model(tiny_model_factory("llama"), gptq, tmp_path / "dequantized")
    config = json.loads((gptq / "config.json").read_text())
    config["quantization_config"]["desc_act"] = True
    (gptq / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="desc_act=true"):
        LLM(str(gptq), dtype="float32", kv_cache_memory=0.02)


@pytest.mark.parametrize("quantization", ["int8", "int4", "gptq"])
def test_linear_layers_quantized_embeddings_and_lm_head_not(tiny_model_factory, tmp_path, quantization):
    path = str(tiny_model_factory("llama"))
    quantized_path = path
    if quantization == "gptq":  # group 32, scales saved in float16, run in bfloat16
        quantized_path = tmp_path / "gptq"
        write_gptq_model(path, quantized_path, tmp_path / "dequantized")
    llm = LLM(str(quantized_path), dtype="bfloat16", kv_cache_memory=0.02,
              quantization=None if quantization == "gptq" else quantization)
    plain = LLM(path, dtype="bfloat16", kv_cache_memory=0.02)
    try:
        model = llm.engine.executor.runner.model
        layers = [m for m in model.modules() if isinstance(m, LinearBase)]
        assert len(layers) == 4 * model.config.num_hidden_layers
        for layer in layers:  # quantized, and kept off the oneDNN bfloat16 packing
            assert layer.weight is None and layer.packed_weight is None
            assert layer.qweight.dtype == (torch.int8 if quantization == "int8" else torch.uint8)
        assert model.model.embed_tokens.weight.dtype == torch.bfloat16
        head = model.lm_head
        assert (head.weight if head.packed_weight is None else head.packed_weight.data).dtype == torch.bfloat16
        plain_layers = [m for m in plain.engine.executor.runner.model.modules() if isinstance(m, LinearBase)]
        ratio = sum(map(weight_bytes, layers)) / sum(map(weight_bytes, plain_layers))
        # int8: 1 byte a weight + a scale a row; int4: half a byte + a scale and a zero a group of 32
        assert 0.5 < ratio < 0.6 if quantization == "int8" else 0.25 < ratio < 0.4
        out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.engine.shutdown()
        plain.engine.shutdown()
