"""Reasoning parsers through the official openai client against a live `pagoda serve --reasoning-parser qwen3`
on a tiny checkpoint that thinks (tests/thinking_checkpoint.py): the thinking leaves `content` for
`reasoning` (and vLLM's older `reasoning_content`), streamed or not; structured outputs and forced tool calls
apply after it; `chat_template_kwargs` turns Qwen3's thinking off."""

import json

import jsonschema
import pytest
from live_server import API_KEY
from thinking_checkpoint import ANSWER, REASONING
from thinking_checkpoint import SERVED_NAME as MODEL
from transformers import AutoTokenizer

from pagoda.entrypoints.openai.reasoning_parsers import ReasoningSplitter, reasoning_parser

pytestmark = pytest.mark.server

USER = [{"role": "user", "content": "Where is the Golden Gate?"}]
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]}}, "required": ["city"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def client(thinking_server):
    return thinking_server.client(API_KEY, timeout=120)


def chat(client, max_tokens=40, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=USER, max_tokens=max_tokens, temperature=0,
                                          **kwargs)


def test_the_thinking_moves_to_reasoning(client):
    out = chat(client)
    message = out.choices[0].message
    assert message.content == ANSWER
    assert message.reasoning == REASONING
    assert message.model_extra["reasoning_content"] == REASONING  # vLLM's name before v0.11, still sent


def test_reasoning_tokens_count_the_thinking(client, thinking_dir):
    """The tokens between the tags: the tags and the answer are not reasoning."""
    usage = chat(client).usage
    tokenizer = AutoTokenizer.from_pretrained(thinking_dir)
    thinking = len(tokenizer.encode(REASONING, add_special_tokens=False))
    assert usage.completion_tokens_details.reasoning_tokens == thinking
    assert usage.completion_tokens == thinking + 2 + len(tokenizer.encode(ANSWER, add_special_tokens=False)) + 1


def test_streamed_deltas_add_up_to_the_same_split(client):
    reasoning, content, usage = [], [], None
    for chunk in chat(client, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            assert extra.get("reasoning") == extra.get("reasoning_content")
            reasoning.append(extra.get("reasoning") or "")
            content.append(choice.delta.content or "")
    assert "".join(reasoning) == REASONING
    assert "".join(content) == ANSWER
    assert usage.completion_tokens_details.reasoning_tokens > 0


def test_the_split_is_the_same_at_every_cut_of_the_real_output(client, thinking_dir):
    """The engine's raw text (completions do not parse reasoning) cut into three deltas at every pair of
    positions splits as the chat API split it whole."""
    tokenizer = AutoTokenizer.from_pretrained(thinking_dir)
    prompt = tokenizer.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    raw = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0).choices[0].text
    assert raw == f"<think>{REASONING}</think>{ANSWER}"
    whole = chat(client).choices[0].message
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    parser = reasoning_parser("qwen3", tokenizer)
    for i in range(len(raw) + 1):
        for j in range(i, len(raw) + 1):
            splitter = parser.splitter(prompt_ids)
            streamed = "".join(splitter.feed(raw[:cut], final=cut == len(raw)) for cut in (i, j, len(raw)))
            assert (streamed, splitter.content) == (whole.reasoning, whole.content), (i, j)


def test_include_reasoning_false_leaves_the_thinking_out(client):
    message = chat(client, extra_body={"include_reasoning": False}).choices[0].message
    assert (message.content, message.reasoning, message.model_extra["reasoning_content"]) == (ANSWER, None, None)
    deltas = [c.choices[0].delta for c in chat(client, stream=True, extra_body={"include_reasoning": False})
              if c.choices]
    assert not any((d.model_extra or {}).get("reasoning") for d in deltas)
    assert "".join(d.content or "" for d in deltas) == ANSWER


def test_enable_thinking_false_reaches_the_template(client):
    out = chat(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = out.choices[0].message
    assert (message.content, message.reasoning) == (ANSWER, None)
    assert out.usage.completion_tokens_details.reasoning_tokens == 0


def test_structured_output_starts_after_the_thinking(client):
    """Were the grammar applied from the first token, `<think>` would be masked and no reasoning could come."""
    out = chat(client, response_format={"type": "json_schema",
                                         "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}})
    message = out.choices[0].message
    assert message.reasoning == REASONING
    jsonschema.validate(json.loads(message.content), SCHEMA)


def test_forced_tool_call_after_the_thinking(client):
    tools = [{"type": "function", "function": {"name": "locate", "parameters": SCHEMA}}]
    for stream, choice in ((False, "required"), (True, {"type": "function", "function": {"name": "locate"}})):
        kwargs = dict(tools=tools, tool_choice=choice, max_tokens=100)  # the JSON is about a token a character
        if not stream:
            message = chat(client, **kwargs).choices[0].message
            reasoning, calls = message.reasoning, message.tool_calls
            arguments = calls[0].function.arguments
        else:
            reasoning, arguments, names = "", "", []
            for chunk in chat(client, stream=True, **kwargs):
                delta = chunk.choices[0].delta if chunk.choices else None
                if delta is None:
                    continue
                reasoning += (delta.model_extra or {}).get("reasoning") or ""
                for call in delta.tool_calls or []:
                    names += [call.function.name] if call.function.name else []
                    arguments += call.function.arguments or ""
            assert names == ["locate"]
        assert reasoning == REASONING
        jsonschema.validate(json.loads(arguments), SCHEMA)


def test_deepseek_r1_and_qwen3_differ_only_with_thinking_off(thinking_dir):
    tokenizer = AutoTokenizer.from_pretrained(thinking_dir)
    qwen3, r1 = reasoning_parser("qwen3", tokenizer), reasoning_parser("deepseek_r1", tokenizer)
    off = {"enable_thinking": False}
    for parser in (qwen3, r1):
        assert parser.split("<think>a</think>b", []) == ("a", "b")
        assert parser.split("a</think>b", []) == ("a", "b")  # the template opened the thinking
        assert parser.split("cut short", []) == ("cut short", None)
        assert parser.split("<think>a</think>", []) == ("a", None)
        ended = tokenizer.encode("<think></think>", add_special_tokens=False)
        assert parser.split("all answer", ended) == (None, "all answer")
    assert qwen3.split("no thinking", [], off) == (None, "no thinking")
    assert r1.split("no thinking", [], off) == ("no thinking", None)
    assert qwen3.split("<think>a</think>b", [], off) == ("a", "b")


def test_streaming_holds_back_a_split_tag():
    splitter = ReasoningSplitter(in_reasoning=True)
    assert splitter.feed("abc</th") == "abc"
    assert splitter.feed("abc</think>d") == ""
    assert (splitter.reasoning, splitter.content) == ("abc", "d")


def test_a_tokenizer_without_the_tags_is_refused_naming_the_flag(tiny_llama_dir):
    """The server builds its parser as the model loads and exits non-zero with this message."""
    with pytest.raises(ValueError, match="--reasoning-parser deepseek_r1: the model's tokenizer has no <think> "
                                         "or </think> token"):
        reasoning_parser("deepseek_r1", AutoTokenizer.from_pretrained(tiny_llama_dir))
