"""Swap space with TP=2 and PP=2: the swap copies travel in the SchedulerOutput, so every rank (TP peers,
later pipeline stages) swaps its own share of the KV; greedy tokens equal the single process's."""

import pytest

from pagoda import LLM, SamplingParams

pytestmark = pytest.mark.distributed

PROMPTS = [
    "Hello, my name is",
    "The quick brown fox jumps over the lazy dog. Paged attention stores keys and values in blocks",
    "a",
    "Continuous batching lets new requests join between steps. " * 2,
]
PARAMS = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def greedy_under_pressure(path, kv_blocks, **kwargs):
    # float32, 3 layers, 1 KV head of 16 dims: one block of 16 tokens is 2 * 16 * 16 * 4 * 3 bytes
    block_bytes = 2 * 16 * 16 * 4 * 3
    llm = LLM(str(path), dtype="float32", max_model_len=128, kv_cache_memory=kv_blocks * block_bytes / 2**30,
              **kwargs)
    try:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        llm.engine.block_manager.check_no_leaks()
        return [o.outputs[0].token_ids for o in outs], llm.engine.get_stats()
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def model_3_layers(tiny_model_factory):
    return tiny_model_factory("llama", num_layers=3, num_kv_heads=1)


@pytest.fixture(scope="module")
def reference(model_3_layers):
    tokens, stats = greedy_under_pressure(model_3_layers, 64, preemption_mode="recompute")
    assert stats.num_preemptions == 0
    return tokens


@pytest.mark.parametrize("kwargs", [
    dict(tensor_parallel_size=2),
    dict(pipeline_parallel_size=2, max_num_batched_tokens=16),
], ids=["tp2", "pp2"])
def test_parallel_swap_equals_single_process(model_3_layers, reference, kwargs):
    tokens, stats = greedy_under_pressure(model_3_layers, 10, preemption_mode="swap", swap_space=0.01, **kwargs)
    assert stats.num_swapped_out > 0 and stats.num_swapped_in == stats.num_swapped_out
    assert tokens == reference
