"""The hybrid KV cache manager (core.kv_cache_groups) on tiny Gemma 3 (8-token window) and gpt-oss (16-token window)
checkpoints, a sliding and a full layer each, at max_model_len 512: greedy tokens equal transformers with and
without chunked prefill, from the prefix cache and through preemption; the start-up concurrency line beats every
layer full (--disable-hybrid-kv-cache-manager) by the arithmetic; the windowed layers' blocks go back to the pool
as a long generation grows."""

import logging

import pytest
from checkpoints import PARITY_PROMPTS, hf_greedy

from pagoda import LLM, SamplingParams
from pagoda.core.kv_cache_groups import HybridBlockManager
from pagoda.core.kv_window import NULL_BLOCK

pytestmark = pytest.mark.model

PROMPTS = PARITY_PROMPTS
MAX_TOKENS = 40
LONG_TOKENS = 120  # the preemption test's
MAX_MODEL_LEN = 512
CHUNK = 32  # max_num_batched_tokens unless a test says otherwise
WINDOWS = {"gemma3": 8, "gpt-oss": 16}
LAYER_BLOCK_BYTES = 2 * 16 * 2 * 16 * 4  # K and V, 16 tokens, 2 KV heads of 16, float32
GIB = 2**30


def params(max_tokens=MAX_TOKENS):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def make_llm(path, **kwargs):
    kwargs = {"kv_cache_memory": 256 * LAYER_BLOCK_BYTES / GIB, "max_num_batched_tokens": CHUNK, **kwargs}
    return LLM(str(path), dtype="float32", max_model_len=MAX_MODEL_LEN, **kwargs)


def greedy(llm, prompts=PROMPTS, max_tokens=MAX_TOKENS):
    outs = llm.generate(prompts, params(max_tokens), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module", params=["gemma3", "gpt-oss"])
def checkpoint(request, tiny_model_factory):
    path = tiny_model_factory(request.param)
    return request.param, path, hf_greedy(path, PROMPTS, MAX_TOKENS)


def test_matches_transformers_with_chunked_prefill_and_prefix_hits(checkpoint):
    """32 tokens a step, then 7 (prompts straddle the windows in chunks, decodes in between), then again from the
    prefix cache: windowed layers read only the blocks they still hold."""
    _, path, reference = checkpoint
    assert len({tuple(r) for r in reference}) == len(PROMPTS)  # not degenerate
    for chunk in (CHUNK, 7):
        llm = make_llm(path, max_num_batched_tokens=chunk)
        assert isinstance(llm.engine.block_manager, HybridBlockManager)
        assert greedy(llm) == reference
        again = greedy(llm, PROMPTS[::-1])[::-1]
        assert llm.engine.get_stats().prefix_cache_hits > 0
        assert again == reference
        llm.engine.block_manager.check_no_leaks()


def test_matches_transformers_without_chunked_prefill(checkpoint):
    _, path, reference = checkpoint
    llm = make_llm(path, enable_chunked_prefill=False, max_num_batched_tokens=MAX_MODEL_LEN)
    assert greedy(llm) == reference


@pytest.fixture(scope="module")
def long_reference(checkpoint):
    arch, path, _ = checkpoint
    return hf_greedy(path, PROMPTS, LONG_TOKENS)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_matches_transformers_through_preemption(checkpoint, long_reference, preemption):
    """A cache of 40 blocks (a sequence of 512 tokens needs 36) for four sequences of 120 tokens and more: they
    preempt each other (dropped and recomputed, or swapped out and in, every group's blocks together) and still
    give transformers' tokens."""
    _, path, _ = checkpoint
    swap = {"swap_space": 64 * LAYER_BLOCK_BYTES / GIB, "preemption_mode": "swap"} if preemption == "swap" else {}
    llm = make_llm(path, kv_cache_memory=40 * LAYER_BLOCK_BYTES / GIB, **swap)
    assert greedy(llm, max_tokens=LONG_TOKENS) == long_reference
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0
    if preemption == "swap":
        assert stats.num_swapped_in > 0
    llm.engine.block_manager.check_no_leaks()


def test_concurrency_line_beats_every_layer_full_by_the_arithmetic(checkpoint, caplog):
    arch, path, _ = checkpoint
    with caplog.at_level(logging.INFO):
        hybrid = make_llm(path)
        full = make_llm(path, disable_hybrid_kv_cache_manager=True)
    assert not isinstance(full.engine.block_manager, HybridBlockManager)
    window = WINDOWS[arch]
    # hybrid: a block holds one layer (the groups are one layer each); a sequence holds 32 full-layer blocks
    # and its window's: ceil((window - 1 + 32) / 16) + 1
    hybrid_expected = 256 / (32 + -(-(window - 1 + CHUNK) // 16) + 1)
    full_expected = 128 / 32  # a block holds both layers; 32 blocks of 16 tokens each
    assert hybrid.engine.max_concurrency == pytest.approx(hybrid_expected)
    assert full.engine.max_concurrency == pytest.approx(full_expected)
    assert hybrid.engine.max_concurrency > full.engine.max_concurrency
    assert f"Maximum concurrency for 512 tokens per request: {hybrid_expected:.2f}x" in caplog.text
    assert f"Maximum concurrency for 512 tokens per request: {full_expected:.2f}x" in caplog.text
    # without the hybrid manager the same tokens come out (every layer full, the current path)
    assert greedy(full, PROMPTS[:2], 8) == greedy(hybrid, PROMPTS[:2], 8)


def test_windowed_blocks_return_to_the_pool_in_a_long_generation(checkpoint):
    arch, path, _ = checkpoint
    llm = make_llm(path)
    engine, bm = llm.engine, llm.engine.block_manager
    engine.add_request("long", PROMPTS[1], params(400))
    held, used = [], []
    while engine.has_unfinished_requests():
        engine.step()
        for table in (m.tables for m in bm.managers[1:]):
            held += [sum(1 for b in t if b != NULL_BLOCK) for t in table.values()]
        used.append(bm.num_used_blocks)
    # a decode's window spans at most 2 blocks of 16, a 32-token chunk's at most 4
    assert max(held) <= -(-(WINDOWS[arch] - 1 + CHUNK) // 16) + 1
    num_tokens = len(engine.tokenizer(PROMPTS[1]).input_ids) + 400
    assert max(used) <= -(-num_tokens // 16) + 4  # every layer full would hold twice the full layer's
    bm.check_no_leaks()


@pytest.mark.parametrize("variant", ["ngram", "async", "n2"])
def test_drafts_async_scheduling_and_forks(checkpoint, variant):
    """n-gram drafts (rejected drafts' slots released in every group), async scheduling (steps scheduled ahead
    carry every group's table) and n=2 (both outputs share the prompt's blocks in every group, copy-on-write):
    transformers' tokens."""
    _, path, reference = checkpoint
    kwargs = {"ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                               "prompt_lookup_max": 3, "prompt_lookup_min": 1}},
              "async": {"async_scheduling": True}, "n2": {}}[variant]
    llm = make_llm(path, **kwargs)
    sampling = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=2 if variant == "n2" else 1)
    outs = llm.generate(PROMPTS, sampling, use_tqdm=False)
    assert [[list(c.token_ids) for c in o.outputs] for o in outs] == [[r] * sampling.n for r in reference]
    llm.engine.block_manager.check_no_leaks()
