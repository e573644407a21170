"""Speculative decoding through the public API: greedy outputs identical to decoding without it, in mixed
batches, with stops, n > 1, prefix caching, chunked prefill and preemption; and drafts that are accepted
on the default model when the answer copies its input."""

import pytest
from test_hf_parity import PROMPTS, pagoda_greedy

from pagoda import LLM, SamplingParams

pytestmark = pytest.mark.model

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
BLOCK_BYTES = 8192  # the tiny llama's KV block of 16 tokens, float32


@pytest.fixture(scope="module")
def reference(tiny_model_factory):
    return pagoda_greedy(tiny_model_factory("llama"))[1]


@pytest.fixture(scope="module")
def spec_llm(tiny_model_factory):
    return LLM(str(tiny_model_factory("llama")), dtype="float32", kv_cache_memory=0.02, speculative_config=NGRAM)


@pytest.mark.parametrize("engine_kwargs", [
    {},
    {"enable_prefix_caching": False},
    {"max_num_batched_tokens": 16},  # chunked prefill beside drafts
    {"kv_cache_memory": 10 * BLOCK_BYTES / 2**30, "max_model_len": 160, "preemption_mode": "recompute",
     "swap_space": 0},
    {"kv_cache_memory": 10 * BLOCK_BYTES / 2**30, "max_model_len": 160, "preemption_mode": "swap",
     "swap_space": 64 * BLOCK_BYTES / 2**30},
], ids=["default", "no-prefix-cache", "chunked-prefill", "preempt-recompute", "preempt-swap"])
def test_greedy_equals_decoding_without_speculation(tiny_model_factory, reference, engine_kwargs):
    # the prompts twice: the second copies hit the prefix cache
    llm, got = pagoda_greedy(tiny_model_factory("llama"), PROMPTS * 2, speculative_config=NGRAM, **engine_kwargs)
    assert got == reference * 2  # pagoda_greedy checked that no KV block leaked
    stats = llm.engine.get_stats()
    assert stats.spec_decode_num_drafts > 0 and stats.spec_decode_num_draft_tokens >= stats.spec_decode_num_drafts
    if "preemption_mode" in engine_kwargs:
        assert stats.num_preemptions > 0


def test_requests_that_do_not_speculate_share_the_batch(spec_llm, tiny_model_factory):
    plain = LLM(str(tiny_model_factory("llama")), dtype="float32", kv_cache_memory=0.02)
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=16, structured_outputs={"choice": ["yes", "no"]})]
    prompts = [PROMPTS[3]] * len(params)
    want = plain.generate(prompts, params, use_tqdm=False)
    got = spec_llm.generate(prompts, params, use_tqdm=False)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids and g.outputs[0].text == w.outputs[0].text
    assert got[1].outputs[0].logprobs is not None and len(got[1].outputs[0].logprobs) == 16
    assert got[3].outputs[0].text in ("yes", "no")
    spec_llm.engine.block_manager.check_no_leaks()


def test_sampling_with_n_and_seeds(spec_llm):
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, n=3, seed=11, ignore_eos=True)
    a = spec_llm.generate(PROMPTS[3], params, use_tqdm=False)[0]
    b = spec_llm.generate(["x", PROMPTS[3]], [SamplingParams(max_tokens=5), params], use_tqdm=False)[1]
    assert [len(c.token_ids) for c in a.outputs] == [20, 20, 20]
    # the drafts are a function of each sequence's own tokens, so a seed reproduces the outputs
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    spec_llm.engine.block_manager.check_no_leaks()


# --- the default model: drafts accepted when the answer copies the prompt -----------------------

TEXT = ("Paged attention stores the keys and values of every sequence in fixed-size blocks, so memory is "
        "allocated on demand and shared between requests that start with the same prompt.")
COPY_PROMPT = [{"role": "user", "content": f"Repeat this text exactly, word for word:\n\n{TEXT}"}]


@pytest.fixture(scope="module")
def default_pair():
    kwargs = dict(dtype="float32", kv_cache_memory=0.25, max_model_len=1024)
    spec = LLM(**kwargs, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                             "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    return LLM(**kwargs), spec


def test_default_model_accepts_drafts_and_keeps_greedy_output(default_pair):
    plain, spec = default_pair
    params = SamplingParams(temperature=0, max_tokens=48)
    want = plain.chat(COPY_PROMPT, params, use_tqdm=False)[0].outputs[0]
    steps_before = spec.engine.get_stats().spec_decode_num_drafts
    got = spec.chat(COPY_PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids and got.text == want.text
    assert "fixed-size blocks" in got.text
    stats = spec.engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens > 0
    assert stats.spec_decode_accepted_per_pos[0] > 0
    # fewer verification steps than tokens: runs of accepted drafts
    assert stats.spec_decode_num_drafts - steps_before < len(got.token_ids)
    spec.engine.block_manager.check_no_leaks()


@pytest.mark.parametrize("stop", ["stop_string", "stop_token", "max_tokens"])
def test_default_model_stops_inside_an_accepted_run(default_pair, stop):
    plain, spec = default_pair
    base = plain.chat(COPY_PROMPT, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    # cut well inside the copied text, where runs of drafts are accepted
    kwargs = {"stop_string": {"stop": base.text[60:70]}, "stop_token": {"stop_token_ids": [base.token_ids[23]]},
              "max_tokens": {"max_tokens": 23}}[stop]
    params = SamplingParams(temperature=0, **{"max_tokens": 40, **kwargs})
    want = plain.chat(COPY_PROMPT, params, use_tqdm=False)[0].outputs[0]
    got = spec.chat(COPY_PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == \
        (want.token_ids, want.text, want.finish_reason, want.stop_reason)
    assert len(got.token_ids) < 40
    spec.engine.block_manager.check_no_leaks()


# --- a draft model -------------------------------------------------------------------------------

@pytest.mark.parametrize("draft,engine_kwargs", [
    ("self", {}),
    ("other", {"max_num_batched_tokens": 16}),
    ("self", {"kv_cache_memory": 10 * BLOCK_BYTES / 2**30, "max_model_len": 160, "preemption_mode": "swap",
              "swap_space": 64 * BLOCK_BYTES / 2**30}),
    ("other", {"kv_cache_memory": 10 * BLOCK_BYTES / 2**30, "max_model_len": 160, "preemption_mode": "recompute",
               "swap_space": 0}),
], ids=["self", "other-chunked", "self-preempt-swap", "other-preempt-recompute"])
def test_draft_model_greedy_equals_decoding_without_speculation(tiny_model_factory, reference, draft, engine_kwargs):
    target = tiny_model_factory("llama")
    draft_path = target if draft == "self" else tiny_model_factory("llama", seed=1, num_layers=1)
    if "kv_cache_memory" in engine_kwargs:  # the draft's blocks come from the same budget
        engine_kwargs["kv_cache_memory"] *= 2 if draft == "self" else 1.5
    llm, got = pagoda_greedy(target, PROMPTS * 2, speculative_config={"model": str(draft_path),
                                                                      "num_speculative_tokens": 3}, **engine_kwargs)
    assert got == reference * 2
    stats = llm.engine.get_stats()
    assert stats.spec_decode_num_drafts > 0
    if draft == "self":  # the target's own greedy tokens: every draft accepted
        assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    if "preemption_mode" in engine_kwargs:
        assert stats.num_preemptions > 0


def test_draft_model_proposes_its_own_greedy_continuation_after_rejections(tiny_model_factory, monkeypatch):
    """The draft model's K/V after verification rejected some of its drafts: each proposal equals what the
    draft model alone continues the sequence's tokens with (a stale K/V from a rejected draft would not)."""
    from pagoda.spec_decode.draft_model import DraftModelProposer

    draft_path = tiny_model_factory("llama", seed=1, num_layers=1)
    proposals = []  # (the sequence's tokens, the drafts proposed after them)
    propose = DraftModelProposer.propose

    def recording(self, out, seqs):
        propose(self, out, seqs)
        proposals.extend((list(seqs[s.seq_id].token_ids), s.draft_token_ids) for s in out.scheduled
                         if s.num_draft_tokens)

    monkeypatch.setattr(DraftModelProposer, "propose", recording)
    # few KV blocks: some steps have no room for a sequence's drafts, so tokens the draft model never saw
    # pile up after a rejected draft's position (and preemptions make it start over)
    llm = LLM(str(tiny_model_factory("llama")), dtype="float32", kv_cache_memory=14 * BLOCK_BYTES * 1.5 / 2**30,
              max_model_len=160, preemption_mode="recompute", swap_space=0,
              speculative_config={"model": str(draft_path), "num_speculative_tokens": 3})
    before = llm.engine.get_stats()
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    stats = llm.engine.get_stats()
    rejected = (stats.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
                - (stats.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens))
    assert len(proposals) > 20 and rejected > 10 and stats.num_preemptions > 0
    draft = LLM(str(draft_path), dtype="float32", kv_cache_memory=0.02)
    alone = draft.generate([{"prompt_token_ids": tokens} for tokens, _ in proposals],
                           [SamplingParams(temperature=0, max_tokens=len(d), ignore_eos=True) for _, d in proposals],
                           use_tqdm=False)
    assert [d for _, d in proposals] == [o.outputs[0].token_ids for o in alone]


def test_draft_model_sampling_accepts_its_own_distribution(tiny_model_factory):
    """With the target as its own draft p = q, so every sampled draft is accepted; seeds reproduce."""
    path = str(tiny_model_factory("llama"))
    llm = LLM(path, dtype="float32", kv_cache_memory=0.02,
              speculative_config={"model": path, "num_speculative_tokens": 3})
    params = SamplingParams(temperature=1.0, top_k=20, max_tokens=24, n=2, seed=5, ignore_eos=True)
    a = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    b = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in a] == [[c.token_ids for c in o.outputs] for o in b]
    stats = llm.engine.get_stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    llm.engine.block_manager.check_no_leaks()


def test_draft_model_with_another_vocabulary_is_refused(tiny_model_factory, tmp_path):
    import json
    import shutil

    draft = tmp_path / "draft"
    shutil.copytree(tiny_model_factory("llama"), draft)
    config = json.loads((draft / "config.json").read_text())
    config["vocab_size"] += 1
    (draft / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="speculative_config.*vocabulary"):
        LLM(str(tiny_model_factory("llama")), speculative_config={"model": str(draft), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="speculative_config.*cannot be loaded"):
        LLM(str(tiny_model_factory("llama")), speculative_config={"model": str(tmp_path / "nope"),
                                                                  "num_speculative_tokens": 2})


# --- logits processors: verification applies them at each position ------------------------------

def two_token_bad_word(tokenizer, tokens: list[int]) -> tuple[int, str]:
    """(i, word): a word the output spells with tokens[i], tokens[i + 1], banned as those two tokens."""
    from pagoda.sample.logits_processors import tokenize_bad_words

    for i in range(3, len(tokens) - 1):
        word = tokenizer.decode(tokens[i : i + 2])
        if word.strip() and tokens[i : i + 2] in tokenize_bad_words(tokenizer, [word]):
            return i, word
    raise AssertionError(f"no two-token word in {tokens}")


@pytest.fixture(scope="module")
def self_draft_llm(tiny_model_factory):
    path = str(tiny_model_factory("llama"))
    return LLM(path, dtype="float32", kv_cache_memory=0.04,
               speculative_config={"model": path, "num_speculative_tokens": 3})


def test_logits_processors_greedy_equals_decoding_without_speculation(spec_llm, self_draft_llm, tiny_model_factory):
    plain = LLM(str(tiny_model_factory("llama")), dtype="float32", kv_cache_memory=0.02)
    tokenizer = plain.get_tokenizer()
    prompt = PROMPTS[3]
    greedy = dict(temperature=0, max_tokens=24, ignore_eos=True)
    free = plain.generate(prompt, SamplingParams(**greedy), use_tqdm=False)[0].outputs[0].token_ids
    i, word = two_token_bad_word(tokenizer, free)
    allowed = sorted((set(tokenizer.encode(prompt)) | set(free)) - {free[6]})
    params = [SamplingParams(**greedy, logit_bias={free[4]: -100.0, free[2]: 5.0}),
              SamplingParams(**greedy, allowed_token_ids=allowed),
              SamplingParams(**greedy, bad_words=[word])]
    want = [o.outputs[0].token_ids for o in plain.generate([prompt] * 3, params, use_tqdm=False)]
    assert all(w != free for w in want)  # each processor changed the output
    assert want[2][: i + 1] == free[: i + 1] and want[2][i + 1] != free[i + 1]  # the word's 2nd token banned
    for llm in (spec_llm, self_draft_llm):
        before = llm.engine.get_stats()
        got = [o.outputs[0].token_ids for o in llm.generate([prompt] * 3, params, use_tqdm=False)]
        stats = llm.engine.get_stats()
        assert got == want
        assert stats.spec_decode_num_drafts > before.spec_decode_num_drafts  # they speculated
        llm.engine.block_manager.check_no_leaks()
    # the draft model applies the processors too: the target accepts its every greedy draft
    drafted = stats.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    assert stats.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens == drafted


def chi_square_critical(df: int, z: float = 3.09) -> float:
    """The chi-square value exceeded with probability 0.001 (z: the normal's), by Wilson and Hilferty."""
    h = 2 / (9 * df)
    return df * (1 - h + z * h**0.5) ** 3


def two_token_word(tokenizer) -> tuple[str, int, int]:
    """A word of two different letter tokens that bad_words bans as exactly those two: (word, first, second)."""
    from pagoda.sample.logits_processors import tokenize_bad_words

    letters = [t for t in range(len(tokenizer)) if tokenizer.decode([t]).isalpha()]
    for a in letters:
        for b in letters:
            word = tokenizer.decode([a, b])
            if a != b and tokenize_bad_words(tokenizer, [word]) == [[a, b]]:
                return word, a, b
    raise AssertionError("no two-token word in the vocabulary")


@pytest.mark.parametrize("speculation", ["none", "ngram", "draft-model"])
def test_logits_processors_keep_the_sampled_distribution(tiny_model_factory, speculation):
    """Three tokens sampled at temperature 1 under allowed_token_ids, logit_bias and a two-token bad word
    follow the distribution computed from transformers' logits: with speculation the second token is
    verified as a draft and the third comes after it, so a banned pair never appears across a draft."""
    import torch
    from checkpoints import load_hf_reference

    path = tiny_model_factory("llama")
    config = {"none": None, "ngram": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2},
              "draft-model": {"model": str(tiny_model_factory("llama", seed=1, num_layers=1)),
                              "num_speculative_tokens": 2}}[speculation]
    llm = LLM(str(path), dtype="float32", kv_cache_memory=0.05, speculative_config=config)
    word, a, b = two_token_word(llm.get_tokenizer())
    c = next(t for t in range(3, 300) if t not in (a, b))
    allowed, bias = [a, b, c], 1.0
    # n-gram drafts: after a sampled c the draft is a ("a c" was followed by a), whose verified successor
    # must not be b
    prompt = [b, a, c, a, b, c, b, a]

    hf = load_hf_reference(path)

    def probs(outputs: list[int]) -> torch.Tensor:  # [3]: over allowed, as the processors make them
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + outputs])).logits[0, -1, allowed].double()
        logits[0] += bias
        if outputs and outputs[-1] == a:
            logits[1] = float("-inf")  # b right after a
        return torch.softmax(logits, dim=0)

    expected = torch.zeros(3, 3, 3, dtype=torch.float64)  # [t1, t2, t3] as indices into allowed
    p1 = probs([])
    for i in range(3):
        p2 = probs([allowed[i]])
        for j in range(3):
            expected[i, j] = p1[i] * p2[j] * probs([allowed[i], allowed[j]])

    num = 6000
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, allowed_token_ids=allowed,
                            logit_bias={a: bias}, bad_words=[word])
    outs = llm.generate([{"prompt_token_ids": prompt}] * num, params, use_tqdm=False)
    counts = torch.zeros(3, 3, 3, dtype=torch.float64)
    for o in outs:
        counts[tuple(allowed.index(t) for t in o.outputs[0].token_ids)] += 1
    stats = llm.engine.get_stats()
    llm.engine.block_manager.check_no_leaks()
    assert counts[expected == 0].sum() == 0  # never b right after a
    # the chi-square test wants >= 5 expected per cell: the rarest sequences share one
    flat_expected, flat_counts = expected.flatten(), counts.flatten()
    order = [i for i in flat_expected.argsort().tolist() if flat_expected[i] > 0]  # rarest first
    merged = 1
    while flat_expected[order[:merged]].sum() * num < 5:
        merged += 1
    bins = [order[:merged]] + [[i] for i in order[merged:]]
    want = torch.stack([flat_expected[cells].sum() for cells in bins]) * num
    got = torch.stack([flat_counts[cells].sum() for cells in bins])
    chi2 = float(((got - want) ** 2 / want).sum())
    assert chi2 < chi_square_critical(len(want) - 1), (chi2, got, want)
    if speculation != "none":  # the second token was verified as a draft, accepted or not
        assert stats.spec_decode_num_drafts > num / 2
        assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
