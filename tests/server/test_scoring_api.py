"""Scoring and sampling parity through the official openai client against live `pagoda serve`s: echo with
max_tokens 0 (lm-eval-harness's loglikelihood), prompt_logprobs, chat logprobs while streaming, logit_bias,
allowed_token_ids, bad_words, continue_final_message, --chat-template, the generation config's defaults
and fill-in-the-middle `suffix`. Values are checked against transformers' log_softmax."""

import json
import shutil

import httpx
import openai
import pytest
import torch
from checkpoints import load_hf_reference
from transformers import AutoTokenizer

pytestmark = pytest.mark.server

MODEL = "tiny"
PROMPT = "Paged attention stores keys and values in fixed-size blocks. The quick brown fox"
CHAT = [{"role": "user", "content": "Hello, my name is Pagoda"}]
# the defaults the model's generation_config.json gives on the first server
GENERATION_DEFAULTS = {"max_new_tokens": 5, "top_k": 1}
CUSTOM_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory, tmp_path_factory):
    """The tiny Llama with FIM tokens and a generation config that sets defaults."""
    path = tmp_path_factory.mktemp("scoring") / "model"
    shutil.copytree(tiny_model_factory("llama", fim=True), path)
    config_path = path / "generation_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    config_path.write_text(json.dumps({**config, **GENERATION_DEFAULTS}))
    return path


@pytest.fixture(scope="module")
def server(server_factory, model_dir):
    # small blocks and chunks: prompts span several prefill steps and prefix-cache blocks
    return server_factory("--served-model-name", MODEL, "--dtype", "float32", "--block-size", "8", "--max-num-batched-tokens", "8",
                          "--enable-prefix-caching", model=model_dir)


@pytest.fixture(scope="module")
def client(server):
    return server.client("none", timeout=60)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def reference(model_dir):
    """transformers' log_softmax over token ids, [L, V]: row i predicts token i + 1."""
    model = load_hf_reference(model_dir)

    def logprobs(token_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([token_ids])).logits[0].float(), dim=-1)

    return logprobs


def error_of(exc_info) -> dict:
    return exc_info.value.body if "param" in exc_info.value.body else exc_info.value.body["error"]


def expect_400(call, param: str) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    error = error_of(e)
    assert error["param"] == param or error["param"].startswith(param + "."), error
    return error


# --- scoring: echo, max_tokens 0, prompt_logprobs --------------------------------------------------

def test_echo_with_max_tokens_0_returns_the_prompt_with_its_logprobs(client, tokenizer, reference):
    ids = tokenizer.encode(PROMPT)
    out = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, max_tokens=0, logprobs=2)
    choice = out.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = reference(ids)
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(float(ref[i - 1, ids[i]]), abs=1e-4)
        top = ref[i - 1].topk(2).indices.tolist()
        assert {tokenizer.decode([t]) for t in top} <= set(lp.top_logprobs[i])
        assert lp.tokens[i] in lp.top_logprobs[i] and len(lp.top_logprobs[i]) <= 3
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]


def test_loglikelihood_as_lm_eval_harness_asks_it(client, tokenizer, reference):
    """lm-eval's loglikelihood: echo the context + continuation as token ids, sum the continuation's."""
    context = tokenizer.encode("The quick brown fox")
    continuation = tokenizer.encode(" jumps over the lazy dog")
    ids = context + continuation
    out = client.completions.create(model=MODEL, prompt=ids, echo=True, max_tokens=0, logprobs=1, temperature=0)
    lp = out.choices[0].logprobs
    ours = sum(lp.token_logprobs[len(context):])
    ref = reference(ids)
    theirs = sum(float(ref[i - 1, ids[i]]) for i in range(len(context), len(ids)))
    assert ours == pytest.approx(theirs, abs=1e-3)
    # is_greedy: the continuation's tokens are each the top one (or not) as transformers says
    greedy = all(max(lp.top_logprobs[i].values()) == lp.token_logprobs[i] for i in range(len(context), len(ids)))
    assert greedy == all(int(ref[i - 1].argmax()) == ids[i] for i in range(len(context), len(ids)))


def test_echo_with_generation_concatenates_prompt_and_completion_logprobs(client, tokenizer):
    ids = tokenizer.encode(PROMPT)
    kwargs = dict(model=MODEL, prompt=PROMPT, echo=True, max_tokens=4, logprobs=1, temperature=0,
                  extra_body={"ignore_eos": True})
    out = client.completions.create(**kwargs).choices[0]
    assert out.text.startswith(PROMPT) and len(out.logprobs.tokens) == len(ids) + 4
    assert out.logprobs.token_logprobs[0] is None and all(v is not None for v in out.logprobs.token_logprobs[1:])
    chunks = list(client.completions.create(stream=True, **kwargs))
    streamed = [t for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.token_logprobs]
    assert "".join(ch.text for c in chunks for ch in c.choices) == out.text
    assert streamed == pytest.approx(out.logprobs.token_logprobs, abs=1e-6, nan_ok=True) or (
        streamed[0] is None and streamed[1:] == pytest.approx(out.logprobs.token_logprobs[1:], abs=1e-6))


def test_echo_with_max_tokens_0_streams_the_prompt(client, tokenizer):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, echo=True, max_tokens=0, logprobs=0,
                                            stream=True))
    choices = [ch for c in chunks for ch in c.choices]
    assert "".join(ch.text for ch in choices) == PROMPT
    tokens = [t for ch in choices if ch.logprobs for t in ch.logprobs.tokens]
    assert len(tokens) == len(tokenizer.encode(PROMPT)) and choices[-1].finish_reason == "length"


def test_max_tokens_0_without_echo_is_400(client):
    expect_400(lambda: client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0), "max_tokens")


def _check_prompt_logprobs(entries, ids, k, reference):
    assert len(entries) == len(ids) and entries[0] is None
    ref = reference(ids)
    for i in range(1, len(ids)):
        entry = {int(t): v for t, v in entries[i].items()}
        assert entry[ids[i]]["logprob"] == pytest.approx(float(ref[i - 1, ids[i]]), abs=1e-4)
        assert entry[ids[i]]["rank"] == int((ref[i - 1] > ref[i - 1, ids[i]]).sum()) + 1
        assert set(ref[i - 1].topk(k).indices.tolist()) <= set(entry) and len(entry) <= k + 1


def test_prompt_logprobs_on_completions(client, tokenizer, reference):
    ids = tokenizer.encode(PROMPT)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"prompt_logprobs": 2})
    _check_prompt_logprobs(out.choices[0].model_extra["prompt_logprobs"], ids, 2, reference)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, stream=True,
                                            extra_body={"prompt_logprobs": 2}))
    scored = [ch.model_extra["prompt_logprobs"] for c in chunks for ch in c.choices
              if (ch.model_extra or {}).get("prompt_logprobs")]
    assert len(scored) == 1
    _check_prompt_logprobs(scored[0], ids, 2, reference)


def test_prompt_logprobs_are_right_after_the_prefix_was_cached(client, tokenizer, reference):
    prompt = PROMPT + " jumps over the lazy dog. Continuous batching lets new requests join"
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)  # a prefix-cache hit now
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 1})
    _check_prompt_logprobs(out.choices[0].model_extra["prompt_logprobs"], tokenizer.encode(prompt), 1, reference)


def test_prompt_logprobs_on_chat(client, tokenizer, reference):
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,
                                         extra_body={"prompt_logprobs": 1})
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    entries = out.model_extra["prompt_logprobs"]
    _check_prompt_logprobs(entries, ids, 1, reference)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, stream=True,
                                                 extra_body={"prompt_logprobs": 1}))
    scored = [c.model_extra["prompt_logprobs"] for c in chunks if (c.model_extra or {}).get("prompt_logprobs")]
    assert scored == [entries]


def test_chat_logprobs_while_streaming(client):
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=6, logprobs=True, top_logprobs=2, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    streamed = [t for c in client.chat.completions.create(stream=True, **kwargs) for ch in c.choices
                if ch.logprobs and ch.logprobs.content for t in ch.logprobs.content]
    assert len(whole) == 6 and [t.token for t in streamed] == [t.token for t in whole]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in whole], abs=1e-5)
    assert all(len(t.top_logprobs) == 2 for t in streamed)


# --- sampling parity: logit_bias, allowed_token_ids, bad_words ----------------------------------------

def _greedy_tokens(client, stream=False, **extra) -> list[int]:
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0,
                  extra_body={"ignore_eos": True},
                  **extra)
    if stream:
        tokens = [t for c in client.completions.create(stream=True, **kwargs) for ch in c.choices
                  if ch.logprobs for t in ch.logprobs.tokens]
    else:
        tokens = client.completions.create(**kwargs).choices[0].logprobs.tokens
    return tokens


def test_logit_bias_forces_a_token_streaming_and_not(client, tokenizer):
    for stream in (False, True):
        tokens = _greedy_tokens(client, stream, logit_bias={"7": 100})
        assert tokens == [tokenizer.decode([7])] * 6
    base = _greedy_tokens(client)
    first = tokenizer.encode(base[0], add_special_tokens=False)[0]
    assert _greedy_tokens(client, logit_bias={str(first): -100})[0] != base[0]


@pytest.mark.parametrize("bias", [{"999999": 5}, {"abc": 5}, {"-3": 5}, {"7": 101}])
def test_bad_logit_bias_is_400_naming_it(client, bias):
    error = expect_400(lambda: client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                                         logit_bias=bias), "logit_bias")
    if "999999" in bias:
        assert "vocabulary" in error["message"]
    expect_400(lambda: client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, logit_bias=bias),
               "logit_bias")


def test_allowed_token_ids(client, tokenizer):
    allowed = [11, 12, 13]
    for stream in (False, True):
        kwargs = dict(model=MODEL, messages=CHAT, max_tokens=8, temperature=1.0, seed=3,
                      extra_body={"allowed_token_ids": allowed, "ignore_eos": True})
        if stream:
            text = "".join(ch.delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                           for ch in c.choices)
        else:
            text = client.chat.completions.create(**kwargs).choices[0].message.content
        assert set(tokenizer.encode(text, add_special_tokens=False)) <= set(allowed), text
    expect_400(lambda: client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,
                                                      extra_body={"allowed_token_ids": [10**7]}),
               "allowed_token_ids")
    expect_400(lambda: client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,
                                                      extra_body={"allowed_token_ids": []}), "allowed_token_ids")


def _ids(tokenizer, *words: str) -> list[int]:
    ids = [tokenizer.encode(w, add_special_tokens=False) for w in words]
    assert all(len(i) == 1 for i in ids), ids  # each a single token of the tiny vocabulary
    return [i[0] for i in ids]


def test_bad_words_single_and_multi_token(client, tokenizer):
    the, and_, is_ = _ids(tokenizer, " the", " and", " is")

    def tokens(stream: bool, **extra) -> list[int]:
        # only three tokens may come, sampled: the banned ones would show up without bad_words
        kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=1.0, seed=7, logprobs=0,
                      extra_body={"ignore_eos": True, "allowed_token_ids": [the, and_, is_], **extra})
        if stream:
            text = [t for c in client.completions.create(stream=True, **kwargs) for ch in c.choices
                    if ch.logprobs for t in ch.logprobs.tokens]
        else:
            text = client.completions.create(**kwargs).choices[0].logprobs.tokens
        return [{" the": the, " and": and_, " is": is_}[t] for t in text]

    def pairs(ids):
        return set(zip(ids, ids[1:]))

    base = tokens(False)
    assert is_ in base and (the, and_) in pairs(base)  # so the checks below can fail
    for stream in (False, True):
        out = tokens(stream, bad_words=["is", "the and"])  # "is" is banned as " is" too
        assert is_ not in out and (the, and_) not in pairs(out) and len(out) == 24
    expect_400(lambda: client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                                 extra_body={"bad_words": "dog"}), "bad_words")


# --- chat prompts: continue_final_message, add_generation_prompt ---------------------------------------

def test_continue_final_message_continues_the_assistant_prefill(client, tokenizer):
    messages = CHAT + [{"role": "assistant", "content": "The quick brown"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert rendered.endswith("The quick brown")
    expected = client.completions.create(model=MODEL, prompt=tokenizer.encode(rendered, add_special_tokens=False),
                                         max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    for stream in (False, True):
        kwargs = dict(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                      extra_body={"continue_final_message": True, "add_generation_prompt": False,
                                  "ignore_eos": True})
        if stream:
            text = "".join(ch.delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                           for ch in c.choices)
        else:
            out = client.chat.completions.create(**kwargs)
            text = out.choices[0].message.content
            assert out.usage.prompt_tokens == expected.usage.prompt_tokens
        assert text == expected.choices[0].text


def test_continue_final_message_with_add_generation_prompt_is_400(client):
    messages = CHAT + [{"role": "assistant", "content": "The quick"}]
    expect_400(lambda: client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                                      extra_body={"continue_final_message": True}),
               "continue_final_message")


# --- the generation config's defaults ---------------------------------------------------------------

def test_generation_config_defaults_apply_and_requests_override_them(client):
    out = client.chat.completions.create(model=MODEL, messages=CHAT, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == GENERATION_DEFAULTS["max_new_tokens"]
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=9, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 9
    # top_k 1 by default: sampling at temperature 1 is greedy whatever the seed ...
    texts = {client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=s,
                                       extra_body={"ignore_eos": True}).choices[0].text for s in range(3)}
    assert len(texts) == 1
    # ... unless the request sets top_k itself
    texts = {client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=s,
                                       extra_body={"ignore_eos": True, "top_k": -1}).choices[0].text
             for s in range(3)}
    assert len(texts) > 1


# --- fill in the middle ------------------------------------------------------------------------------

def test_suffix_builds_a_fill_in_the_middle_prompt(client, tokenizer):
    prefix, suffix = "The quick brown", " over the lazy dog"
    fim = [tokenizer.convert_tokens_to_ids(t) for t in ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")]
    ids = ([fim[0]] + tokenizer.encode(prefix, add_special_tokens=False) + [fim[1]]
           + tokenizer.encode(suffix, add_special_tokens=False) + [fim[2]])
    expected = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0,
                                         extra_body={"ignore_eos": True})
    out = client.completions.create(model=MODEL, prompt=prefix, suffix=suffix, max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens == len(ids) and out.choices[0].text == expected.choices[0].text
    streamed = "".join(ch.text for c in client.completions.create(model=MODEL, prompt=prefix, suffix=suffix,
                                                                   max_tokens=4, temperature=0, stream=True,
                                                                   extra_body={"ignore_eos": True})
                       for ch in c.choices)
    assert streamed == expected.choices[0].text


# --- a model without a chat template, --chat-template, --generation-config vllm ------------------------

@pytest.fixture(scope="module")
def templated_server(server_factory, model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("no-template") / "model"
    shutil.copytree(model_dir, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    for extra in path.glob("chat_template.*"):
        extra.unlink()
    template_file = path.parent / "template.jinja"
    template_file.write_text(CUSTOM_TEMPLATE)
    no_template = server_factory("--served-model-name", MODEL, "--generation-config", "vllm", model=path)
    with_template = server_factory("--served-model-name", MODEL, "--chat-template", str(template_file),
                                   "--generation-config", "vllm", model=path)
    return path, no_template, with_template


def test_chat_template_flag_for_a_model_without_one(templated_server, tokenizer):
    path, no_template, with_template = templated_server
    bare = openai.OpenAI(base_url=no_template.url + "/v1", api_key="none", max_retries=0)
    error = expect_400(lambda: bare.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2), "messages")
    assert "--chat-template" in error["message"]
    client = openai.OpenAI(base_url=with_template.url + "/v1", api_key="none", max_retries=0)
    rendered = "[user] Hello, my name is Pagoda\n[assistant] "
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0,
                                         extra_body={"ignore_eos": True})
    expected = client.completions.create(model=MODEL, prompt=tokenizer.encode(rendered, add_special_tokens=False),
                                         max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens == expected.usage.prompt_tokens
    assert out.choices[0].message.content == expected.choices[0].text
    tokens = httpx.post(with_template.url + "/tokenize", json={"messages": CHAT}).json()["tokens"]
    assert tokens == tokenizer.encode(rendered, add_special_tokens=False)


def test_generation_config_vllm_ignores_the_models_defaults(templated_server):
    _, no_template, _ = templated_server
    client = openai.OpenAI(base_url=no_template.url + "/v1", api_key="none", max_retries=0)
    texts = {client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=s,
                                       extra_body={"ignore_eos": True}).choices[0].text for s in range(3)}
    assert len(texts) > 1  # no top_k 1 from generation_config.json
