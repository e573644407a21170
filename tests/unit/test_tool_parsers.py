"""Tool-call parsers on fixed model outputs."""

import json

import pytest

from pagoda.entrypoints.openai.tool_parsers import TOOL_PARSERS

hermes = TOOL_PARSERS["hermes"]()
llama = TOOL_PARSERS["llama3_json"]()


def calls(extracted):
    return [(c.name, json.loads(c.arguments)) for c in extracted.tool_calls]


def test_hermes_one_call_with_content_before():
    out = hermes.extract('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                         '</tool_call>')
    assert out.content == "Let me look."
    assert calls(out) == [("get_weather", {"city": "Paris"})]


def test_hermes_parallel_calls_and_an_unclosed_last_block():
    out = hermes.extract('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
                         '<tool_call>{"name": "b", "arguments": {"x": [1, 2]}}')
    assert out.content is None
    assert calls(out) == [("a", {}), ("b", {"x": [1, 2]})]


@pytest.mark.parametrize("text", ["just an answer", "<tool_call>{not json}</tool_call>",
                                  '<tool_call>{"arguments": {}}</tool_call>',
                                  '<tool_call>{"name": "a", "arguments": [1]}</tool_call>'])
def test_hermes_text_that_is_not_a_call_is_content(text):
    out = hermes.extract(text)
    assert out.content == text and out.tool_calls == []


def test_llama3_json_single_and_several_calls():
    out = llama.extract('{"name": "search", "parameters": {"query": "kv cache"}}')
    assert out.content is None and calls(out) == [("search", {"query": "kv cache"})]
    out = llama.extract('<|python_tag|>{"name": "a", "parameters": {"n": 1}}; {"name": "b", "arguments": "{}"}')
    assert calls(out) == [("a", {"n": 1}), ("b", {})]


@pytest.mark.parametrize("text", ["The answer is 4.", '{"name": "a", "parameters": {}} and then prose',
                                  '{"x": 1}', '{"name": "a", "parameters": {'])
def test_llama3_json_text_that_is_not_a_call_is_content(text):
    out = llama.extract(text)
    assert out.content == text and out.tool_calls == []


def test_auto_tool_choice_needs_a_parser():
    from pagoda.entrypoints.openai.cli_args import ServerArgs

    with pytest.raises(ValueError, match="--tool-call-parser"):
        ServerArgs(enable_auto_tool_choice=True)
    assert ServerArgs(enable_auto_tool_choice=True, tool_call_parser="hermes").tool_call_parser == "hermes"


@pytest.mark.parametrize("text, prefix", [
    ("Sure, ", 6), ("Sure <tool", 5), ("Sure <tool_call>{", 5), ("<", 0), ("a < b", 5), ("", 0)])
def test_hermes_content_prefix_holds_back_a_possible_call(text, prefix):
    assert hermes.content_prefix(text) == prefix


@pytest.mark.parametrize("text, prefix", [
    ('{"name"', 0), ("  <|python", 0), ("<|python_tag|>{", 0), ("", 0), ("The answer", 10), ("<b>hi", 5)])
def test_llama3_json_content_prefix_holds_back_a_possible_call(text, prefix):
    assert llama.content_prefix(text) == prefix


@pytest.mark.parametrize("parser", [hermes, llama])
def test_streamed_content_is_a_prefix_of_the_whole_text(parser):
    whole = 'Checking. <tool_call>{"name": "a", "arguments": {}}</tool_call>'
    sent = 0
    for end in range(len(whole) + 1):  # the text as it grows token by token
        sent = max(sent, parser.content_prefix(whole[:end]))
        assert whole[:end].startswith(whole[:sent])
