"""Embedding requests through TP x PP worker processes equal the single-process engine's (last and mean
pooling, chunked prefill, generation in the same batches)."""

import pytest
import torch

from pagoda import LLM, PoolingParams, SamplingParams

pytestmark = pytest.mark.distributed

PROMPTS = ["Hello, my name is", "The quick brown fox jumps over the lazy dog. Paged attention stores keys " * 2]


def embed_all(path, **kwargs) -> list[list[float]]:
    with LLM(str(path), dtype="float32", kv_cache_memory=0.02, **kwargs) as llm:
        params = [PoolingParams("last"), PoolingParams("mean"), SamplingParams(max_tokens=4)]
        outs = llm.generate([p for p in PROMPTS for _ in params], params * len(PROMPTS), use_tqdm=False)
        llm.engine.block_manager.check_no_leaks()
        return [o.embedding for o in outs if o.embedding is not None]


def test_tp2_pp2_embeddings_equal_single_process(tiny_model_factory):
    path = tiny_model_factory("llama", num_layers=3, num_kv_heads=1)
    want = embed_all(path)
    got = embed_all(path, tensor_parallel_size=2, pipeline_parallel_size=2, max_num_batched_tokens=24)
    assert len(got) == len(want) == 2 * len(PROMPTS)
    for g, w in zip(got, want):
        assert torch.allclose(torch.tensor(g), torch.tensor(w), atol=1e-5)
