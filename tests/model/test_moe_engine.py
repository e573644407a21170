"""Mixtures of experts in the engine: the per-expert load in the stats, online quantization of the experts."""

import pytest

from pagoda import LLM, SamplingParams
from pagoda.layers.moe import SparseMoE
from pagoda.layers.quantization.methods import weight_bytes

pytestmark = pytest.mark.model

PROMPTS = ["Hello, my name is", "Continuous batching lets new requests join between steps. " * 2]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_expert_load_counts_every_routed_row(tiny_model_factory):
    """Each computed token is routed to top_k experts in every MoE layer: the per-expert counts add up to
    exactly that, prefix-cache hits (not computed) excluded."""
    llm = LLM(str(tiny_model_factory("qwen2-moe")), dtype="float32", kv_cache_memory=0.02)
    llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    llm.generate(PROMPTS, PARAMS, use_tqdm=False)  # again: the prompts mostly come from the prefix cache
    stats = llm.engine.get_stats()
    assert stats.prefix_cache_hits > 0
    assert sorted(stats.expert_tokens) == [0]  # layer 1 is dense (mlp_only_layers)
    assert len(stats.expert_tokens[0]) == 4
    assert sum(stats.expert_tokens[0]) == 2 * stats.iteration_tokens_sum  # top-2
    assert min(stats.expert_tokens[0]) > 0


@pytest.mark.parametrize("method,share", [("int8", 0.3), ("int4", 0.2)])
def test_online_quantization_covers_the_experts(tiny_model_factory, method, share):
    """Every expert's matrices are quantized (float32 checkpoint: int8 takes about a quarter of the bytes, int4
    with its scales and zeros less) and the model still generates."""
    path = tiny_model_factory("mixtral")
    llm = LLM(str(path), dtype="float32", kv_cache_memory=0.02, quantization=method)
    model = llm.engine.executor.runner.model
    experts = [e for m in model.modules() if isinstance(m, SparseMoE) for e in m.experts]
    assert len(experts) == 2 * 4
    assert all(e.gate_up_proj.quant_method is not None and e.down_proj.quant_method is not None for e in experts)
    float_bytes = sum(4 * 3 * 64 * 128 for _ in experts)  # gate, up, down: 64 x 128 float32 each
    assert sum(weight_bytes(e) for e in experts) < share * float_bytes
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [12, 12]
