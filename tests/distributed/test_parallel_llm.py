"""TP and PP through `LLM`, in local processes over gloo: greedy tokens equal the single-process output; bad
sizes and a rank that dies during start-up fail with clear errors."""

import multiprocessing
import os
import signal
import threading
import time

import pytest

from pagoda import LLM, SamplingParams

pytestmark = pytest.mark.distributed

PROMPTS = [
    "Hello, my name is",
    "The quick brown fox jumps over the lazy dog. Paged attention stores keys and values in blocks",
    "a",
    "Continuous batching lets new requests join between steps. " * 2,
]
PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def greedy(path, prompts=PROMPTS, **kwargs):
    llm = LLM(str(path), dtype="float32", kv_cache_memory=0.02, **kwargs)
    try:
        first = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
        # again: the second pass hits the prefix cache on every rank
        second = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
        assert first == second
        assert llm.engine.get_stats().prefix_cache_hits > 0
        llm.engine.block_manager.check_no_leaks()
        return first
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def model_3_layers(tiny_model_factory):
    # 3 layers (uneven over 2 stages), 1 KV head (fewer than 2 TP ranks: replicated)
    return tiny_model_factory("llama", num_layers=3, num_kv_heads=1)


@pytest.fixture(scope="module")
def reference(model_3_layers):
    return greedy(model_3_layers)


@pytest.mark.parametrize("kwargs", [
    dict(tensor_parallel_size=2),
    dict(pipeline_parallel_size=2, max_num_batched_tokens=16),
    dict(pipeline_parallel_size=2, pp_layer_partition=[2, 1], pipeline_fill=False),
    dict(tensor_parallel_size=2, pipeline_parallel_size=2, max_num_batched_tokens=24),
], ids=["tp2", "pp2-chunked", "pp2-partition-unpipelined", "tp2xpp2-chunked"])
def test_parallel_greedy_equals_single_process(model_3_layers, reference, kwargs):
    assert greedy(model_3_layers, **kwargs) == reference


def test_qwen2_tied_embeddings_with_bias_tp2(tiny_model_factory):
    path = tiny_model_factory("qwen2")
    assert greedy(path, PROMPTS[:2], tensor_parallel_size=2) == greedy(path, PROMPTS[:2])


def test_sizes_that_cannot_be_split_name_them(tiny_model_factory):
    path = tiny_model_factory("llama", num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not split the model's 4 attention heads"):
        LLM(str(path), dtype="float32", tensor_parallel_size=3, kv_cache_memory=0.01)


def test_bad_layer_partition_is_rejected(model_3_layers):
    with pytest.raises(ValueError, match="pp_layer_partition"):
        LLM(str(model_3_layers), dtype="float32", pipeline_parallel_size=2, pp_layer_partition=[1, 1],
            kv_cache_memory=0.01)


def test_a_rank_that_dies_during_start_up_fails_the_engine_at_once(model_3_layers):
    """The head's rendezvous used to wait for the dead rank until --distributed-timeout."""
    def kill_rank_1():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for child in multiprocessing.active_children():
                if child.name == "pagoda-rank1" and child.pid is not None:
                    os.kill(child.pid, signal.SIGKILL)
                    return
            time.sleep(0.005)

    killer = threading.Thread(target=kill_rank_1, daemon=True)
    killer.start()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"pagoda-rank1 exited with code -9"):
        LLM(str(model_3_layers), dtype="float32", tensor_parallel_size=2, kv_cache_memory=0.02,
            distributed_timeout=300)
    killer.join()
    assert time.monotonic() - started < 120, "the head waited for the dead rank"
    assert not [c for c in multiprocessing.active_children() if c.name.startswith("pagoda-rank")]
