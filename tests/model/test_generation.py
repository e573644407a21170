"""Generation features through the public API: n, seeds, stops, logprobs, chat, aborts, errors."""

import json
import random
import shutil

import pytest

from pagoda import LLM, SamplingParams

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    return LLM(str(tiny_model_factory("llama")), dtype="float32", kv_cache_memory=0.02)


def test_outputs_come_back_in_input_order_with_fields(llm):
    prompts = ["Hello", "The quick brown fox jumps over the lazy dog", {"prompt_token_ids": [5, 6, 7]}]
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert [o.prompt for o in outs] == ["Hello", "The quick brown fox jumps over the lazy dog", None]
    assert outs[2].prompt_token_ids == [5, 6, 7]
    for o in outs:
        assert o.finished and len(o.outputs[0].token_ids) == 5 and o.outputs[0].finish_reason == "length"
        assert o.outputs[0].text == llm.get_tokenizer().decode(o.outputs[0].token_ids)


def test_seed_reproduces_and_n_outputs_differ(llm):
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=123, n=3, ignore_eos=True)
    a = llm.generate("Hello, my name is", params, use_tqdm=False)[0]
    b = llm.generate(["x", "Hello, my name is", "y"], [params] * 3, use_tqdm=False)[1]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len(a.outputs) == 3 and [c.index for c in a.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1
    llm.engine.block_manager.check_no_leaks()


def test_stop_strings_stop_token_ids_and_min_tokens(llm):
    base = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    text, ids = base.outputs[0].text, base.outputs[0].token_ids
    stop = text[5:8]
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=20, stop=stop, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.find(stop)]
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[ids[3]]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ids[: ids.index(ids[3]) + 1] and out.stop_reason == ids[3]
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[ids[0]],
                                               min_tokens=4), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 4 and ids[0] not in out.token_ids[:4]


def test_logprobs(llm):
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 4
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert tok in entry and entry[tok].rank == 1 and len(entry) == 3
        assert max(lp.logprob for lp in entry.values()) == entry[tok].logprob
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


def test_chat_uses_the_template(llm):
    out = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=3, ignore_eos=True),
                   use_tqdm=False)[0]
    assert out.prompt.startswith("<|im_start|>user\nHi<|im_end|>") and out.prompt.endswith("assistant\n")
    outs = llm.chat([[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]],
                    SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(outs) == 2


@pytest.mark.parametrize("prompt,params,match", [
    ("", SamplingParams(), "prompt"),
    ({"prompt_token_ids": []}, SamplingParams(), "prompt"),
    ({"prompt_token_ids": [10**6]}, SamplingParams(), "token ids"),
    ("hi", SamplingParams(max_tokens=10**6), "maximum context length"),
])
def test_invalid_input_raises_and_disturbs_nobody(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(["fine", prompt], [SamplingParams(max_tokens=2), params], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate("fine", SamplingParams(max_tokens=2), use_tqdm=False)) == 1


def test_no_leaks_after_mixed_workload_with_aborts_and_preemption(tiny_model_factory):
    llm = LLM(str(tiny_model_factory("llama")), dtype="float32", max_model_len=128,
              kv_cache_memory=12 * 8192 / 2**30, max_num_batched_tokens=32)
    engine, rng = llm.engine, random.Random(0)
    shared = [rng.randrange(300) for _ in range(60)]
    for i in range(30):
        n = rng.choice([1, 1, 2])
        prompt = shared[: rng.randint(0, 60)] + [rng.randrange(300) for _ in range(rng.randint(1, 30))]
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt},
                           SamplingParams(max_tokens=rng.randint(1, 30), n=n, temperature=rng.choice([0, 1]),
                                          ignore_eos=True))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if steps % 7 == 0 and engine.requests:
            engine.abort_request(rng.choice(list(engine.requests)))
        assert steps < 2000
    engine.step()  # flush finished ids to the runner
    assert engine.get_stats().num_preemptions > 0
    engine.block_manager.check_no_leaks()
    assert not engine.executor.runner.seqs


def test_bad_checkpoints_get_clear_errors(tiny_model_factory, tmp_path):
    src = tiny_model_factory("llama")
    corrupt = tmp_path / "corrupt"
    shutil.copytree(src, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="model.safetensors"):
        LLM(str(corrupt), dtype="float32", kv_cache_memory=0.01)
    mismatched = tmp_path / "mismatched"
    shutil.copytree(src, mismatched)
    config = json.loads((mismatched / "config.json").read_text())
    config["intermediate_size"] = 100
    (mismatched / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="shape"):
        LLM(str(mismatched), dtype="float32", kv_cache_memory=0.01)
    missing = tmp_path / "missing"
    shutil.copytree(src, missing)
    config["intermediate_size"] = 128
    config["num_hidden_layers"] = 3
    (missing / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="missing weights"):
        LLM(str(missing), dtype="float32", kv_cache_memory=0.01)
