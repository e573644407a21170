"""Greedy output equals Hugging Face transformers token for token (float32) on tiny random checkpoints."""

import pytest
from checkpoints import PARITY_PROMPTS, hf_greedy, hf_greedy_stepwise

from pagoda import LLM, SamplingParams

pytestmark = pytest.mark.model

PROMPTS = [*PARITY_PROMPTS, "Paris is the capital of"]
MAX_TOKENS = 24


def pagoda_greedy(path, prompts=PROMPTS, max_tokens=MAX_TOKENS, **engine_kwargs):
    engine_kwargs.setdefault("kv_cache_memory", 0.02)
    llm = LLM(str(path), dtype="float32", **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.block_manager.check_no_leaks()
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(tiny_model_factory):
    cache = {}

    def get(arch, **kwargs):
        key = (arch, tuple(sorted(kwargs.items())))
        if key not in cache:
            cache[key] = hf_greedy(tiny_model_factory(arch, **kwargs), PROMPTS, MAX_TOKENS)
        return cache[key]

    return get


NEW_FAMILIES = ["mistral-window", "qwen2-window", "gemma2", "gemma3", "phi3", "mixtral", "qwen2-moe", "qwen3-moe",
                "olmoe"]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", *NEW_FAMILIES])
def test_matches_transformers_per_architecture(tiny_model_factory, reference, arch):
    _, got = pagoda_greedy(tiny_model_factory(arch))
    assert got == reference(arch)


@pytest.mark.parametrize("arch", NEW_FAMILIES)
def test_new_families_with_chunked_prefill_and_prefix_hits(tiny_model_factory, reference, arch):
    """Every prompt chunked (7 tokens a step, decodes in between), then all again from the prefix cache; the
    windowed models' sequences run past their 16-token window, chunks straddle it."""
    path = tiny_model_factory(arch)
    llm, got = pagoda_greedy(path, max_num_batched_tokens=7)
    assert got == reference(arch)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    again = llm.generate(PROMPTS[::-1], params, use_tqdm=False)[::-1]
    assert llm.engine.get_stats().prefix_cache_hits > 0
    assert [o.outputs[0].token_ids for o in again] == reference(arch)


@pytest.mark.parametrize("engine_kwargs", [
    dict(enable_prefix_caching=False),
    dict(enable_chunked_prefill=False, max_num_batched_tokens=512),
    dict(max_num_batched_tokens=7),  # every prompt is chunked, decodes interleave
    dict(block_size=32, max_num_seqs=2),
], ids=["no-prefix-cache", "no-chunked-prefill", "tiny-token-budget", "block32-two-seqs"])
def test_matches_transformers_under_scheduler_settings(tiny_model_factory, reference, engine_kwargs):
    _, got = pagoda_greedy(tiny_model_factory("llama"), **engine_kwargs)
    assert got == reference("llama")


def test_matches_transformers_when_preemption_happens(tiny_model_factory, reference):
    # 10 blocks of 16 tokens; the first three sequences alone grow to 11: sequences are preempted and recomputed
    llm, got = pagoda_greedy(tiny_model_factory("llama"), max_model_len=160, kv_cache_memory=10 * 8192 / 2**30)
    assert llm.engine.num_blocks == 10
    assert llm.engine.get_stats().num_preemptions > 0
    assert got == reference("llama")


def test_a_windowed_model_runs_sequences_longer_than_its_kv_cache(tiny_model_factory, reference):
    """Every layer of mistral-window slides (16 tokens): blocks behind the window are freed as sequences
    advance, so 4 blocks of 16 tokens serve sequences of more than 64 tokens, which would need up to 10
    unwindowed (max_model_len=160); a model with global layers (Gemma 2) is refused the same cache: its global
    layer keeps all 10 (and its local layer 3, in blocks of one layer: the hybrid KV cache manager's 8)."""
    cache = dict(max_model_len=160, max_num_batched_tokens=16, kv_cache_memory=4 * 8192 / 2**30)
    llm, got = pagoda_greedy(tiny_model_factory("mistral-window"), **cache)
    assert llm.engine.num_blocks == 4 and llm.engine.block_manager.sliding_window == 16
    assert max(len(llm.get_tokenizer()(p).input_ids) + MAX_TOKENS for p in PROMPTS) > 4 * 16
    assert got == reference("mistral-window")
    with pytest.raises(ValueError, match="holds 8 blocks .* fewer than the 13 one sequence of max_model_len=160 needs"):
        LLM(str(tiny_model_factory("gemma2")), dtype="float32", **cache)


def test_phi3_longrope_past_its_original_length_with_a_window(tiny_model_factory):
    """Phi-3 with LongRoPE from original_max_position_embeddings=16 and a 16-token window on every layer: short
    prompts (chunked) start below position 16 and decode past it, so later positions take the long factors
    while blocks behind the window are freed. The reference is transformers' model one token at a time
    through its cache (its generate() instead recomputes the whole sequence with the long factors at
    position 16; vLLM keeps the cache, as Pagoda)."""
    path = tiny_model_factory("phi3-long")
    prompts = ["Hello, my name is", "a", "Paris is the capital of"]
    llm, got = pagoda_greedy(path, prompts, max_num_batched_tokens=7)
    assert max(len(llm.get_tokenizer()(p).input_ids) for p in prompts) <= 16
    assert llm.engine.block_manager.sliding_window == 16
    assert got == hf_greedy_stepwise(path, prompts, MAX_TOKENS)


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.mark.parametrize("arch,draft", [("mistral-window", None), ("mistral-window", "llama"), ("qwen2-moe", "llama")],
                         ids=["window-ngram", "window-draft-model", "moe-draft-model"])
def test_speculative_decoding_on_the_new_families(tiny_model_factory, reference, arch, draft):
    """Drafts verified by a windowed target (n-gram drafts: blocks behind the window freed while drafts come and
    go; a draft model: nothing freed, it reads the same tables) and by a mixture of experts: transformers'
    tokens."""
    spec = NGRAM if draft is None else {"model": str(tiny_model_factory(draft, seed=1, num_layers=1)),
                                        "num_speculative_tokens": 3}
    llm, got = pagoda_greedy(tiny_model_factory(arch), speculative_config=spec,
                             kv_cache_memory=0.02 if draft is None else 0.04)
    assert got == reference(arch)
    assert llm.engine.get_stats().spec_decode_num_drafts > 0
    assert llm.engine.block_manager.sliding_window == (16 if (arch, draft) == ("mistral-window", None) else None)


def test_a_windowed_prefix_hit_needs_only_its_last_window_cached(tiny_model_factory):
    """mistral-window (every layer slides, 16 tokens) on 6 blocks of 16: a prompt of more than 6 blocks runs
    by reusing the blocks behind its window, so its first blocks are evicted while it runs. Asked again, it
    still hits: the lookup searches from the end and needs only the blocks its window reaches (a hit from
    the first block would need more blocks than the cache has). Both runs give transformers' tokens."""
    path = tiny_model_factory("mistral-window")
    prompt = "Continuous batching lets new requests join between steps. " * 4
    llm = LLM(str(path), dtype="float32", max_model_len=256, kv_cache_memory=6 * 8192 / 2**30,
              max_num_batched_tokens=16)
    assert llm.engine.num_blocks == 6
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first, again = (llm.generate([prompt], params, use_tqdm=False)[0] for _ in range(2))
    num_prompt = len(first.prompt_token_ids)
    assert num_prompt > 6 * 16
    assert again.num_cached_tokens == (num_prompt - 1) // 16 * 16
    assert llm.engine.get_stats().prefix_cache_hits == again.num_cached_tokens
    expected = hf_greedy(path, [prompt], 8)[0]
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == expected
    llm.engine.block_manager.check_no_leaks()


def test_prefix_cache_hits_give_the_same_tokens(tiny_model_factory, reference):
    path = tiny_model_factory("llama")
    llm = LLM(str(path), dtype="float32", kv_cache_memory=0.02)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = llm.generate(PROMPTS, params, use_tqdm=False)
    again = llm.generate(PROMPTS[::-1], params, use_tqdm=False)[::-1]
    assert llm.engine.get_stats().prefix_cache_hits > 0
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first] == reference("llama")
    assert again[1].num_cached_tokens >= 16


def test_gqa_mqa_and_sharded_checkpoint(tiny_model_factory):
    for kwargs in [dict(num_kv_heads=1), dict(num_kv_heads=4, shards=3)]:
        path = tiny_model_factory("llama", **kwargs)
        _, got = pagoda_greedy(path, PROMPTS[:3])
        assert got == hf_greedy(path, PROMPTS[:3], MAX_TOKENS)


def test_the_new_families_references_are_not_degenerate(reference):
    """Greedy parity tests nothing when a tiny checkpoint only repeats a token (Gemma's did: its scaled
    embeddings swamped the layers): every new family's reference continues most prompts with varied tokens."""
    for arch in NEW_FAMILIES:
        assert sum(len(set(tokens)) >= MAX_TOKENS // 3 for tokens in reference(arch)) >= 4, arch
