"""Quantized engines with tensor, pipeline and expert parallelism (gloo, local processes): each rank quantizes its
own shard (int8 row-parallel ranks agree on each row's scale), and greedy tokens equal the single-process
quantized engine's."""

import pytest
from quantized_checkpoints import write_quantized_model

from pagoda import LLM, SamplingParams

pytestmark = pytest.mark.distributed

PROMPTS = [
    "Hello, my name is",
    "The quick brown fox jumps over the lazy dog. Paged attention stores keys and values in blocks",
    "Continuous batching lets new requests join between steps. " * 2,
]
PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def greedy(path, **kwargs):
    llm = LLM(str(path), dtype="float32", kv_cache_memory=0.02, **kwargs)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def model_1_kv_head(tiny_model_factory):
    return tiny_model_factory("llama", num_layers=2, num_kv_heads=1)  # KV head replicated on both ranks


@pytest.mark.parametrize("quantization,parallel", [
    ("int8", dict(tensor_parallel_size=2)),
    ("int4", dict(tensor_parallel_size=2)),
    ("int4", dict(pipeline_parallel_size=2)),
], ids=["int8-tp2", "int4-tp2", "int4-pp2"])
def test_parallel_quantized_equals_single_process_quantized(model_1_kv_head, quantization, parallel):
    assert greedy(model_1_kv_head, quantization=quantization, **parallel) == \
        greedy(model_1_kv_head, quantization=quantization)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_tp2_checkpoint_quantized_equals_tp1(tiny_model_factory, tmp_path, method):
    path = tmp_path / method
    write_quantized_model(tiny_model_factory("qwen2"), path, tmp_path / "dequantized", method, group_size=32,
                          sym=False)
    assert greedy(path, tensor_parallel_size=2) == greedy(path)


@pytest.mark.parametrize("quantization,parallel", [
    ("int8", dict(tensor_parallel_size=2)),
    ("int4", dict(tensor_parallel_size=2, enable_expert_parallel=True)),
], ids=["int8-tp2", "int4-ep2"])
def test_quantized_experts_split_or_whole_equal_single_process(tiny_model_factory, quantization, parallel):
    """Online quantization of a mixture of experts: every expert split over the ranks (TP: the down projections'
    ranks agree on each row's scale), or whole experts per rank (EP: each quantized as one process would)."""
    path = tiny_model_factory("mixtral")
    assert greedy(path, quantization=quantization, **parallel) == greedy(path, quantization=quantization)
