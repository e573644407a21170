"""Data parallelism (engine/data_parallel.py): one engine core per DP rank, each with its own scheduler, block
manager and KV cache; with MoE and expert parallelism the experts split over every DP x TP rank and each MoE
layer exchanges tokens between the ranks. Greedy tokens equal transformers' whichever rank served a request."""

import pytest
from checkpoints import hf_greedy

from pagoda import LLM, SamplingParams
from pagoda.config import EngineArgs
from pagoda.errors import InvalidParam

pytestmark = pytest.mark.distributed

PROMPTS = ["Hello, my name is", "Continuous batching lets new requests join between steps. " * 2,
           "The capital of France is", "one two three four five six"]
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
MOE = ("mixtral", "qwen2-moe", "qwen3-moe", "olmoe")


@pytest.fixture(scope="module")
def reference(tiny_model_factory):
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = hf_greedy(tiny_model_factory(arch), PROMPTS, MAX_TOKENS)
        return cache[arch]

    return get


def dp_llm(path, **kwargs):
    options = dict(dtype="float32", kv_cache_memory=0.02, max_num_batched_tokens=16, data_parallel_size=2)
    return LLM(str(path), **{**options, **kwargs})


def served_ranks(llm) -> list[int]:
    """Sequences each DP rank was given so far."""
    return llm.engine.core.num_added


def run(llm, prompts=PROMPTS, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("arch", MOE)
def test_moe_dp2_with_experts_over_both_ranks_equals_transformers(tiny_model_factory, reference, arch):
    llm = dp_llm(tiny_model_factory(arch), enable_expert_parallel=True)
    try:
        assert run(llm) == reference(arch)
        # both ranks served requests, and each holds half the experts
        ranks = [core.block_manager for core in llm.engine.core.cores]
        assert all(bm.num_blocks > 0 for bm in ranks)
        assert all(n > 0 for n in served_ranks(llm))
        stats = llm.engine.get_stats()
        assert sum(sum(c) for c in stats.expert_tokens.values()) > 0
        # one request alone: the other rank is idle and runs dummy batches while this one steps
        assert run(llm, PROMPTS[:1]) == reference(arch)[:1]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_dense_dp2_equals_transformers(tiny_model_factory, reference, arch):
    llm = dp_llm(tiny_model_factory(arch))
    try:
        assert run(llm) == reference(arch)
        assert all(n > 0 for n in served_ranks(llm))
    finally:
        llm.shutdown()


def test_mixtral_dp2_tp2_with_experts_over_four_ranks(tiny_model_factory, reference):
    llm = dp_llm(tiny_model_factory("mixtral"), enable_expert_parallel=True, tensor_parallel_size=2)
    try:
        assert run(llm) == reference("mixtral")
        assert all(n > 0 for n in served_ranks(llm))
    finally:
        llm.shutdown()


def test_bad_combinations_are_refused_by_name():
    with pytest.raises(InvalidParam) as e:
        EngineArgs(data_parallel_size=2, pipeline_parallel_size=2).validate()
    assert e.value.param == "pipeline_parallel_size" and "data_parallel_size=2" in str(e.value)
    with pytest.raises(InvalidParam) as e:
        EngineArgs(data_parallel_size=0).validate()
    assert e.value.param == "data_parallel_size"
    with pytest.raises(InvalidParam) as e:
        EngineArgs(data_parallel_size=2, distributed_executor_backend="uni").validate()
    assert e.value.param == "distributed_executor_backend"
    EngineArgs(data_parallel_size=2).validate()  # no longer refused
