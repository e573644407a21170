"""CUDA graphs' bucketing, padding and output slicing, rehearsed on a CPU with the stand-in capture
(PAGODA_CUDA_GRAPH_STAND_IN=1: the forward recorded as a closure over the static buffers and replayed): greedy
tokens equal to the eager engine's for batch sizes on, between and above the captured sizes, and padding rows
that never write a KV block."""

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.config.compilation import STAND_IN_ENV
from pagoda.worker import cuda_graphs

PROMPTS = ["Hello, my name is", "Paris is the capital of", "The quick brown fox", "a",
           "Paged attention stores keys", "San Francisco is", "héllo wörld", "Continuous batching lets new",
           "numbers 0123456789"]
SIZES = [1, 2, 4]  # 1 and 4 are captured, 3 pads to 4, 9 is above the largest
BATCHES = [1, 3, 4, 9]
MAX_TOKENS = 6


def make_llm(path, graphs: bool, **kwargs) -> LLM:
    extra = dict(compilation_config={"cudagraph_capture_sizes": SIZES}) if graphs else dict(enforce_eager=True)
    return LLM(str(path), dtype="float32", device="cpu", kv_cache_memory=0.01, max_num_seqs=16, seed=0,
               **extra, **kwargs)


def generate(llm: LLM, batch: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:batch], params, use_tqdm=False)]


def runner(llm: LLM):
    return llm.engine.executor.runner


@pytest.fixture(scope="module")
def path(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def eager_tokens(path):
    llm = make_llm(path, graphs=False)
    assert runner(llm).graphs is None
    return {batch: generate(llm, batch) for batch in BATCHES}


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setenv(STAND_IN_ENV, "1")


def test_greedy_tokens_equal_eager_on_between_and_above_the_sizes(path, eager_tokens, stand_in):
    llm = make_llm(path, graphs=True)
    graphs = runner(llm).graphs
    assert graphs is not None and graphs.sizes == tuple(SIZES) and isinstance(graphs.capturer,
                                                                               cuda_graphs.StandInCapture)
    for batch in BATCHES:
        before = dict(graphs.stats.replays_by_size)
        assert generate(llm, batch) == eager_tokens[batch], f"batch of {batch}"
        replayed = {size: n - before.get(size, 0) for size, n in graphs.stats.replays_by_size.items()
                    if n - before.get(size, 0)}
        # the prefill steps run eagerly; every decode step of the batch replays the graph of its bucket
        expected = {} if batch > max(SIZES) else {graphs.size_for(batch): MAX_TOKENS - 1}
        assert replayed == expected, f"batch of {batch}: replayed {replayed}"
    assert graphs.stats.eager_steps >= MAX_TOKENS - 1  # the batch of 9, above the largest size


def kv_caches(llm: LLM) -> list[torch.Tensor]:
    return [cache.clone() for cache in runner(llm).kv_caches]


def test_padding_rows_write_no_kv_block(path, stand_in):
    """A batch of 3 padded to 4: the KV cache after the run is the eager engine's (whose untouched blocks are
    still zeros), so the padding row wrote nowhere, neither a free block nor a sequence's."""
    eager = make_llm(path, graphs=False)
    generate(eager, 3)
    graph = make_llm(path, graphs=True)
    generate(graph, 3)
    assert runner(graph).graphs.stats.replays_by_size == {4: MAX_TOKENS - 1}
    for want, got in zip(kv_caches(eager), kv_caches(graph), strict=True):
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_enforce_eager_and_cpu_default_capture_nothing(path, monkeypatch):
    monkeypatch.delenv(STAND_IN_ENV, raising=False)
    assert runner(make_llm(path, graphs=True)).graphs is None  # a CPU without the stand-in: no graphs
    monkeypatch.setenv(STAND_IN_ENV, "1")
    assert runner(make_llm(path, graphs=False)).graphs is None  # enforce_eager=True


def test_what_keeps_the_whole_engine_eager(path, tiny_model_factory, stand_in):
    from dataclasses import replace

    from pagoda.config import EngineArgs, create_engine_config

    config = create_engine_config(EngineArgs(model=str(path), device="cpu",
                                             compilation_config={"cudagraph_capture_sizes": SIZES}))
    plain, cpu = torch.nn.Linear(1, 1), torch.device("cpu")
    assert cuda_graphs.eager_reason(config, plain, cpu, lora=False) is None
    for words, changed in [
            ("pipeline parallelism", replace(config, parallel=replace(config.parallel, pipeline_parallel_size=2))),
            ("tensor parallelism off CUDA", replace(config, parallel=replace(config.parallel, tensor_parallel_size=2))),
            ("calculate_kv_scales", replace(config, cache=replace(config.cache, calculate_kv_scales=True))),
            ("enforce_eager", replace(config, cudagraph_capture_sizes=()))]:
        assert words in cuda_graphs.eager_reason(changed, plain, cpu, lora=False)
    assert "LoRA" in cuda_graphs.eager_reason(config, plain, cpu, lora=True)
    assert "torch attention backend" in cuda_graphs.eager_reason(config, plain, torch.device("cuda"), lora=False)
    moe = LLM(str(tiny_model_factory("mixtral")), dtype="float32", device="cpu", kv_cache_memory=0.01,
              compilation_config={"cudagraph_capture_sizes": SIZES})
    assert runner(moe).graphs is None
