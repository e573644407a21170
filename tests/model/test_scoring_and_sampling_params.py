"""Prompt logprobs (scoring) and the logits-processor sampling settings through the offline `LLM`:
prompt_logprobs against transformers' log_softmax, with prefix caching and chunked prefill; logit_bias,
allowed_token_ids, bad_words; the model's generation_config defaults."""

import json

import pytest
import torch
from checkpoints import load_hf_reference

from pagoda import LLM, SamplingParams
from pagoda.errors import InvalidParam

pytestmark = pytest.mark.model

PROMPT = "Paged attention stores keys and values in fixed-size blocks. The quick brown fox"


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def llm(model_dir):
    # prefix caching on, small chunks: the scored prompt spans several prefill steps
    return LLM(str(model_dir), dtype="float32", kv_cache_memory=0.02, block_size=8, enable_prefix_caching=True,
               enable_chunked_prefill=True, max_num_batched_tokens=8)


@pytest.fixture(scope="module")
def hf_logprobs(model_dir):
    """The reference: transformers' log_softmax over the prompt, [L, V]; row i predicts token i + 1."""
    model = load_hf_reference(model_dir)

    def reference(token_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([token_ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)

    return reference


def _check_against_reference(out, reference, k: int) -> None:
    ids = out.prompt_token_ids
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids)
    assert out.prompt_logprobs[0] is None
    ref = reference(ids)
    for position in range(1, len(ids)):
        entry = out.prompt_logprobs[position]
        token = ids[position]
        expected = ref[position - 1]
        assert entry[token].logprob == pytest.approx(float(expected[token]), abs=1e-4)
        assert entry[token].rank == int((expected > expected[token]).sum()) + 1
        top = expected.topk(k).indices.tolist()
        assert set(top) <= set(entry) and len(entry) in (k, k + 1)
        for tid in top:
            assert entry[tid].logprob == pytest.approx(float(expected[tid]), abs=1e-4)


def test_prompt_logprobs_match_transformers_across_chunks(llm, hf_logprobs):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=3), use_tqdm=False)[0]
    assert len(out.prompt_token_ids) > 8  # more than one prefill chunk
    _check_against_reference(out, hf_logprobs, 3)
    assert out.prompt_logprobs[1][out.prompt_token_ids[1]].decoded_token == llm.get_tokenizer().decode(
        [out.prompt_token_ids[1]])


def test_prompt_logprobs_are_whole_when_the_prefix_is_cached(llm, hf_logprobs):
    plain = SamplingParams(max_tokens=1)
    llm.generate(PROMPT, plain, use_tqdm=False)  # fills the prefix cache
    hits_before = llm.engine.get_stats().prefix_cache_hits
    again = llm.generate(PROMPT, plain, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and llm.engine.get_stats().prefix_cache_hits > hits_before
    scored = llm.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert scored.num_cached_tokens == 0
    _check_against_reference(scored, hf_logprobs, 0)


def test_prompt_logprobs_in_a_mixed_batch_with_n_and_sample_logprobs(llm, hf_logprobs):
    outs = llm.generate([PROMPT, "Hello", "Continuous batching lets new requests join"],
                        [SamplingParams(max_tokens=3, prompt_logprobs=2, n=2, logprobs=1, seed=1),
                         SamplingParams(max_tokens=3),
                         SamplingParams(max_tokens=2, prompt_logprobs=1, temperature=0)], use_tqdm=False)
    _check_against_reference(outs[0], hf_logprobs, 2)
    assert len(outs[0].outputs) == 2 and all(len(c.logprobs) == 3 for c in outs[0].outputs)
    assert outs[1].prompt_logprobs is None
    _check_against_reference(outs[2], hf_logprobs, 1)
    llm.engine.block_manager.check_no_leaks()


def test_loglikelihood_of_a_continuation_equals_transformers(llm, hf_logprobs):
    """lm-eval-harness's loglikelihood: the sum of the continuation tokens' prompt logprobs."""
    tokenizer = llm.get_tokenizer()
    context, continuation = tokenizer.encode("The quick brown fox"), tokenizer.encode(" jumps over the lazy dog")
    ids = context + continuation
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    ours = sum(out.prompt_logprobs[i][ids[i]].logprob for i in range(len(context), len(ids)))
    ref = hf_logprobs(ids)
    theirs = sum(float(ref[i - 1, ids[i]]) for i in range(len(context), len(ids)))
    assert ours == pytest.approx(theirs, abs=1e-3)


def _greedy(llm, prompt="Hello", **kwargs):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, **kwargs)
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]


def test_logit_bias_forces_and_bans_tokens(llm):
    base = _greedy(llm)
    forced = _greedy(llm, logit_bias={7: 100.0})
    assert forced.token_ids == [7] * 8
    banned = _greedy(llm, logit_bias={base.token_ids[0]: -100.0})
    assert banned.token_ids[0] != base.token_ids[0]
    # the raw model's logprobs are reported, as vLLM's: the bias changes the choice, not the scores
    scored = _greedy(llm, logit_bias={7: 100.0}, logprobs=0)
    assert scored.logprobs[0][7].logprob < 0 and scored.logprobs[0][7].rank > 0


def test_allowed_token_ids_restrict_sampling(llm):
    allowed = [11, 12, 13]
    for seed in range(3):
        out = llm.generate("Hello", SamplingParams(temperature=1.0, max_tokens=10, seed=seed, ignore_eos=True,
                                                   allowed_token_ids=allowed), use_tqdm=False)[0].outputs[0]
        assert set(out.token_ids) <= set(allowed)


def test_bad_words_single_and_multi_token(llm):
    tokenizer = llm.get_tokenizer()
    base = _greedy(llm)
    first_word = tokenizer.decode(base.token_ids[:1])
    out = _greedy(llm, bad_words=[first_word])
    assert base.token_ids[0] not in out.token_ids[:1]
    # a two-token word: its last token is banned right after its first
    pair = tokenizer.decode(base.token_ids[1:3])
    word_ids = tokenizer.encode(pair.lstrip(), add_special_tokens=False)
    out = _greedy(llm, bad_words=[pair])
    for i in range(len(out.token_ids) - len(word_ids) + 1):
        assert out.token_ids[i : i + len(word_ids)] != word_ids


def test_mixed_batch_processors_apply_per_row(llm):
    base = _greedy(llm)
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={7: 100.0}),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]
    outs = llm.generate(["Hello", "Hello"], params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == [7] * 8
    assert outs[1].outputs[0].token_ids == base.token_ids


@pytest.mark.parametrize(("kwargs", "field"), [
    (dict(logit_bias={5: 101}), "logit_bias"),
    (dict(logit_bias={-1: 1}), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(bad_words=[""]), "bad_words"),
    (dict(prompt_logprobs=21), "prompt_logprobs"),
])
def test_bad_values_are_refused_by_name(kwargs, field):
    with pytest.raises(InvalidParam) as e:
        SamplingParams(**kwargs)
    assert e.value.param == field


@pytest.mark.parametrize("field", ["logit_bias", "allowed_token_ids"])
def test_token_ids_outside_the_vocabulary_are_refused(llm, field):
    value = {10**6: 1.0} if field == "logit_bias" else [10**6]
    with pytest.raises(InvalidParam) as e:
        llm.generate("Hello", SamplingParams(**{field: value}), use_tqdm=False)
    assert e.value.param == field and "vocabulary" in str(e.value)


@pytest.fixture(scope="module")
def model_with_defaults(model_dir, tmp_path_factory):
    import shutil

    path = tmp_path_factory.mktemp("defaults") / "model"
    shutil.copytree(model_dir, path)
    config_path = path / "generation_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    config_path.write_text(json.dumps({**config, "temperature": 0.25, "top_k": 3, "max_new_tokens": 7}))
    return path


def test_generation_config_gives_the_default_sampling_params(model_with_defaults):
    with LLM(str(model_with_defaults), dtype="float32", kv_cache_memory=0.02) as llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.25, 3, 7)
        out = llm.generate("Hello", use_tqdm=False)[0].outputs[0]  # no SamplingParams: the defaults
        assert len(out.token_ids) == 7 or out.finish_reason == "stop"
    with LLM(str(model_with_defaults), dtype="float32", kv_cache_memory=0.02, generation_config="vllm") as llm:
        assert llm.get_default_sampling_params() == SamplingParams()


def test_generation_config_argument_is_checked(model_dir, tmp_path):
    with pytest.raises(InvalidParam) as e:
        LLM(str(model_dir), kv_cache_memory=0.02, generation_config=str(tmp_path))
    assert e.value.param == "generation_config"


def test_chat_continue_final_message(llm):
    messages = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "The quick brown"}]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = llm.chat(messages, params, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt.endswith("The quick brown")
    with pytest.raises(InvalidParam) as e:
        llm.chat(messages, params, use_tqdm=False, continue_final_message=True)
    assert e.value.param == "continue_final_message"


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_prompt_logprobs_stay_whole_under_preemption(model_dir, hf_logprobs, mode):
    """Ten 16-token KV blocks for four growing sequences: some are preempted, a recomputed one scores its
    prompt again; each prompt token is kept once."""
    prompts = [f"{PROMPT} {i}" for i in range(4)]
    block_bytes = 8192  # the tiny llama's KV block of 16 tokens, float32
    with LLM(str(model_dir), dtype="float32", max_model_len=160, kv_cache_memory=10 * block_bytes / 2**30,
             preemption_mode=mode, swap_space=(64 if mode == "swap" else 0) * block_bytes / 2**30) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, prompt_logprobs=1),
                            use_tqdm=False)
        assert llm.engine.get_stats().num_preemptions > 0
        llm.engine.block_manager.check_no_leaks()
    for out in outs:
        _check_against_reference(out, hf_logprobs, 1)
