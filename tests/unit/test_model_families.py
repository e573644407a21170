"""What models.family reads from config.json: each layer's window, the one rule that keeps a model off the C++
layer loop, MoE routing options; and the refusal of an unsupported architecture pointing at the table."""

import pytest
from transformers import AutoConfig

from pagoda.config.model_files import check_supported
from pagoda.models.family import family_options, layer_windows

pytestmark = pytest.mark.unit


ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mistral": "MistralForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                 "gemma3_text": "Gemma3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "olmoe": "OlmoeForCausalLM"}


def config(model_type, **kw):
    kw.setdefault("num_hidden_layers", 4)
    return AutoConfig.for_model(model_type, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                intermediate_size=128, vocab_size=100, architectures=[ARCHITECTURES[model_type]],
                                **kw)


def test_windows_per_layer_as_transformers_applies_them():
    assert layer_windows(config("gemma2", sliding_window=16)) == [16, None, 16, None]
    assert layer_windows(config("gemma3_text", sliding_window=8, num_hidden_layers=7)) == [8] * 5 + [None, 8]
    assert layer_windows(config("qwen2", use_sliding_window=True, sliding_window=32, max_window_layers=2)) == \
        [None, None, 32, 32]
    assert layer_windows(config("qwen2", sliding_window=32)) == [None] * 4  # use_sliding_window off
    assert layer_windows(config("mistral", sliding_window=4096)) == [4096] * 4
    assert layer_windows(config("llama")) == [None] * 4


@pytest.mark.parametrize("model_type,kw,plain", [
    ("llama", {}, True),
    ("qwen3", {}, True),
    ("phi3", {}, True),  # fused tensors load into the same layout
    ("mistral", dict(sliding_window=4096), False),
    ("gemma2", {}, False),
    ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None), False),
    ("olmoe", dict(num_experts=4, num_experts_per_tok=2), False),
])
def test_only_plain_llama_layers_take_the_cpp_loop(model_type, kw, plain):
    cfg = config(model_type, **kw)
    assert family_options(cfg).plain_llama_layers is plain


def test_moe_options_follow_the_config():
    mixtral = family_options(config("mixtral", num_local_experts=8, num_experts_per_tok=2, sliding_window=None)).moe
    assert (mixtral.num_experts, mixtral.top_k, mixtral.norm_topk_prob) == (8, 2, True)  # always renormalised
    qwen = family_options(config("qwen2_moe", num_experts=8, num_experts_per_tok=4, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=96, norm_topk_prob=False, mlp_only_layers=[1],
                                 decoder_sparse_step=1)).moe
    assert qwen.sparse_layers == (True, False, True, True)
    assert (qwen.intermediate_size, qwen.shared_expert_intermediate_size, qwen.norm_topk_prob) == (32, 96, False)


def test_unsupported_architecture_points_at_the_table():
    cfg = config("llama")
    cfg.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match=r"unsupported architecture \['GPT2LMHeadModel'\].*docs/models.md#supported"):
        check_supported(cfg)


@pytest.mark.parametrize("qc", [
    dict(quant_method="gptq", bits=4, group_size=128, desc_act=False),
    dict(quant_method="awq", bits=4, group_size=128, zero_point=True, version="gemm"),
], ids=["gptq", "awq"])
def test_gptq_and_awq_experts_are_refused_naming_the_way_that_works(qc):
    moe = config("mixtral", num_local_experts=4, num_experts_per_tok=2, sliding_window=None, quantization_config=qc)
    method = qc["quant_method"].upper()
    with pytest.raises(ValueError, match=rf"{method} checkpoints of mixture-of-experts models \(MixtralForCausalLM\) "
                                         r"are not supported yet.*quantization='int8' or 'int4'"):
        check_supported(moe)
    check_supported(config("llama", quantization_config=qc))  # dense: loads
