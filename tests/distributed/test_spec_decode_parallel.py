"""Speculative decoding with TP and PP (local processes over gloo): greedy tokens equal the single-process
output without speculation; drafts (n-gram, or a draft model's, proposed unsharded on the driver) are
verified across ranks and stages."""

import re
from contextlib import contextmanager

import pytest
from test_parallel_llm import PARAMS, PROMPTS, greedy

from pagoda import LLM, SamplingParams

pytestmark = pytest.mark.distributed

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@contextmanager
def speculating(path, speculative_config, **kwargs):
    """A parallel engine that speculates; shut down after, and checked for KV block leaks first."""
    llm = LLM(str(path), dtype="float32", speculative_config=speculative_config, **kwargs)
    try:
        yield llm
        llm.engine.block_manager.check_no_leaks()
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def model_3_layers(tiny_model_factory):
    # 3 layers (uneven over 2 stages), 1 KV head (fewer than 2 TP ranks: replicated)
    return tiny_model_factory("llama", num_layers=3, num_kv_heads=1)


@pytest.mark.parametrize("kwargs", [
    dict(tensor_parallel_size=2),
    dict(pipeline_parallel_size=2, max_num_batched_tokens=16),
], ids=["tp2", "pp2-chunked"])
def test_ngram_speculation_in_parallel_equals_single_process(model_3_layers, kwargs):
    reference = greedy(model_3_layers)
    with speculating(model_3_layers, NGRAM, kv_cache_memory=0.02, **kwargs) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        stats = llm.engine.get_stats()
    assert got == reference
    assert stats.spec_decode_num_drafts > 0


# --- a draft model ---------------------------------------------------------------------------------

def greedy_mix(reference_text: str | None = None) -> list[SamplingParams]:
    """Greedy requests: plain, n = 2, and one that stops at a word of the plain run's output (so inside a
    run of accepted drafts where there is one)."""
    params = [PARAMS, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, n=2)]
    if reference_text is not None:
        word = re.search(r"[A-Za-z]{2,}", reference_text[4:])
        assert word is not None, reference_text
        params.append(SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[word.group()]))
    return params


def outputs(llm: LLM, params: list[SamplingParams]) -> list[list[tuple]]:
    prompts = [PROMPTS[3]] * len(params) + PROMPTS[:3]
    params = params + [PARAMS] * 3
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs]
            for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def draft_reference(model_3_layers):
    """The single-process outputs without speculation, and the requests they answer."""
    llm = LLM(str(model_3_layers), dtype="float32", kv_cache_memory=0.02)
    text = llm.generate(PROMPTS[3], PARAMS, use_tqdm=False)[0].outputs[0].text
    params = greedy_mix(text)
    return params, outputs(llm, params)


@pytest.mark.parametrize("draft,kwargs", [
    ("self", dict(tensor_parallel_size=2)),
    ("other", dict(tensor_parallel_size=2, max_num_batched_tokens=16)),
    ("self", dict(pipeline_parallel_size=2)),
    ("other", dict(pipeline_parallel_size=2, max_num_batched_tokens=16)),
    ("other", dict(tensor_parallel_size=2, pipeline_parallel_size=2)),
], ids=["tp2-self", "tp2-other-chunked", "pp2-self", "pp2-other-chunked", "tp2xpp2-other"])
def test_draft_model_in_parallel_equals_single_process(model_3_layers, tiny_model_factory, draft_reference,
                                                       draft, kwargs):
    params, want = draft_reference
    draft_path = model_3_layers if draft == "self" else tiny_model_factory("llama", seed=1, num_layers=1)
    config = {"model": str(draft_path), "num_speculative_tokens": 3}
    with speculating(model_3_layers, config, kv_cache_memory=0.03, **kwargs) as llm:
        got = outputs(llm, params)
        greedy_stats = llm.engine.get_stats()
        llm.engine.block_manager.check_no_leaks()
        # sampling: the draft's distributions travel to the rank that verifies (the last stage under PP);
        # with the target as its own draft p = q, so nearly every draft is accepted (as point masses
        # they would be accepted with probability p(x) only)
        sampled = SamplingParams(temperature=1.0, top_k=20, max_tokens=24, n=2, seed=5, ignore_eos=True)
        runs = [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS[:2], sampled, use_tqdm=False)]
        again = [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS[:2], sampled, use_tqdm=False)]
        stats = llm.engine.get_stats()
    assert got == want
    assert greedy_stats.spec_decode_num_drafts > 0
    assert any(o[0][2] == "stop" for o in want)  # the stop string was met
    assert runs == again  # seeds reproduce
    drafted = stats.spec_decode_num_draft_tokens - greedy_stats.spec_decode_num_draft_tokens
    accepted = stats.spec_decode_num_accepted_tokens - greedy_stats.spec_decode_num_accepted_tokens
    assert drafted > 0
    if draft == "self":
        assert greedy_stats.spec_decode_num_accepted_tokens > 0.9 * greedy_stats.spec_decode_num_draft_tokens
        assert accepted > 0.95 * drafted
