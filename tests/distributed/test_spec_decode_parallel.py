"""N-gram speculative decoding with TP and PP (local processes over gloo): greedy tokens equal the
single-process output without speculation; drafts are verified across ranks and stages."""

import pytest
from test_parallel_llm import PARAMS, PROMPTS, greedy

from pagoda import LLM

pytestmark = pytest.mark.distributed

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.mark.parametrize("kwargs", [
    dict(tensor_parallel_size=2),
    dict(pipeline_parallel_size=2, max_num_batched_tokens=16),
], ids=["tp2", "pp2-chunked"])
def test_ngram_speculation_in_parallel_equals_single_process(tiny_model_factory, kwargs):
    path = tiny_model_factory("llama", num_layers=3, num_kv_heads=1)
    reference = greedy(path)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=0.02, speculative_config=NGRAM, **kwargs)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        stats = llm.engine.get_stats()
        llm.engine.block_manager.check_no_leaks()
    finally:
        llm.engine.shutdown()
    assert got == reference
    assert stats.spec_decode_num_drafts > 0
