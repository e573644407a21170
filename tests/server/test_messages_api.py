"""Anthropic's Messages API through the official `anthropic` SDK against a live `pagoda serve` on the tiny
checkpoint that thinks (tests/thinking_checkpoint.py), with --reasoning-parser and a tool-call parser: plain,
streamed (Anthropic's event types in order), tools and their results, stop sequences, count_tokens, and
errors in Anthropic's shape."""

import json

import anthropic
import httpx
import jsonschema
import pytest
from live_server import API_KEY
from thinking_checkpoint import ANSWER, REASONING
from thinking_checkpoint import SERVED_NAME as MODEL

pytestmark = pytest.mark.server

SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]}}, "required": ["city"],
          "additionalProperties": False}
TOOLS = [{"name": "locate", "description": "Where a landmark is", "input_schema": SCHEMA}]
USER = [{"role": "user", "content": "Where is the Golden Gate?"}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(thinking_server):
    return thinking_server


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)


def create(client, **kwargs):
    kwargs.setdefault("messages", USER)
    # temperature: SDK 2.x dropped the argument; older clients send it, and the server still takes it
    return client.messages.create(model=MODEL, max_tokens=kwargs.pop("max_tokens", 40), extra_body=GREEDY, **kwargs)


def test_a_message_thinks_then_answers(server, client):
    m = create(client, system="Be brief.")
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert (m.content[0].thinking, m.content[1].text) == (REASONING, ANSWER)
    assert (m.stop_reason, m.stop_sequence) == ("end_turn", None)
    counted = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=USER).input_tokens
    tokenized = httpx.post(server.url + "/tokenize", headers={"x-api-key": API_KEY}, json={
        "messages": [{"role": "system", "content": "Be brief."}, *USER]}).json()["count"]
    assert m.usage.input_tokens == counted == tokenized
    assert m.usage.output_tokens > 0


def test_a_streamed_message_sends_anthropics_events_in_order(client):
    with client.messages.stream(model=MODEL, max_tokens=40, extra_body=GREEDY, messages=USER) as stream:
        events = list(stream)
        final = stream.get_final_message()
    types = [e.type for e in events if e.type in ("message_start", "content_block_start", "content_block_stop",
                                                  "message_delta", "message_stop")]
    assert types == ["message_start", "content_block_start", "content_block_stop", "content_block_start",
                     "content_block_stop", "message_delta", "message_stop"]
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == REASONING
    assert "".join(d.text for d in deltas if d.type == "text_delta") == ANSWER
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[1].text == ANSWER
    assert final.stop_reason == "end_turn" and final.usage.output_tokens > 0


def test_a_tool_use_then_its_result(client):
    first = create(client, tools=TOOLS, tool_choice={"type": "any"}, max_tokens=150)
    assert first.stop_reason == "tool_use"
    use = first.content[-1]
    assert use.type == "tool_use" and use.name == "locate" and use.id
    jsonschema.validate(use.input, SCHEMA)
    second = create(client, tools=TOOLS, messages=[
        *USER, {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Not there."}]}])
    assert second.stop_reason == "end_turn" and second.content[-1].text == ANSWER


def test_a_streamed_tool_use(client):
    with client.messages.stream(model=MODEL, max_tokens=150, extra_body=GREEDY, messages=USER, tools=TOOLS,
                                tool_choice={"type": "tool", "name": "locate"}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    partial = "".join(e.delta.partial_json for e in events
                      if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    use = final.content[-1]
    assert use.type == "tool_use" and use.name == "locate" and use.input == json.loads(partial)
    jsonschema.validate(use.input, SCHEMA)
    assert final.stop_reason == "tool_use"


def test_stop_sequences(client):
    m = create(client, stop_sequences=["Franc"])
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "Franc")
    assert m.content[-1].text == ANSWER[: ANSWER.index("Franc")]


def test_max_tokens_ends_the_message(client):
    m = create(client, max_tokens=3)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


def test_errors_come_in_anthropics_shape(server, client):
    with pytest.raises(anthropic.BadRequestError) as e:
        create(client, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "messages.0.content.0" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="elsewhere", max_tokens=5, messages=USER)
    assert e.value.body["error"]["type"] == "not_found_error"
    missing = httpx.post(server.url + "/v1/messages", headers={"x-api-key": API_KEY},
                         json={"model": MODEL, "messages": USER})  # no max_tokens
    assert missing.status_code == 400 and missing.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in missing.json()["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=5, messages=USER)
    assert e.value.body["error"]["type"] == "authentication_error"


TOOL_USE = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "locate",
                                              "input": {"city": "Paris"}}]}


def tool_result(content):
    return [*USER, TOOL_USE, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": content}]}]


# (messages, other fields, the field the error names): each a 400 in Anthropic's shape, never a 500
MALFORMED = {
    "a tool_result's content holds a plain string": (
        tool_result(["Not there."]), {}, "messages.2.content.0.tool_result.content.0:"),
    "a tool_result's content holds a number": (tool_result([7]), {}, "messages.2.content.0.tool_result.content.0:"),
    "a tool_result's content is a number": (tool_result(7), {}, "messages.2.content.0.tool_result.content:"),
    "a content block is a number": (
        [{"role": "user", "content": [{"type": "text", "text": "Hi"}, 5]}], {}, "messages.0.content.1:"),
    "a content block is a string": ([{"role": "user", "content": ["Hi"]}], {}, "messages.0.content.0:"),
    "content is a number": ([{"role": "user", "content": 5}], {}, "messages.0.content:"),
    "a text block without text": ([{"role": "user", "content": [{"type": "text"}]}], {},
                                  "messages.0.content.0.text.text:"),
    "a block field the API does not have": (
        [{"role": "user", "content": [{"type": "text", "text": "Hi", "colour": "red"}]}], {},
        "messages.0.content.0.text.colour:"),
    "a tool_use in a user message": ([{"role": "user", "content": TOOL_USE["content"]}], {}, "messages.0.content.0:"),
    "a system block that is a number": (USER, {"system": [3]}, "system.0:"),
    "an unknown top-level field": (USER, {"frequency_penalty": 0.5}, "frequency_penalty:"),
    "a server tool": (USER, {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0:"),
    "a tool that is a string": (USER, {"tools": ["locate"]}, "tools.0:"),
    "metadata with an unknown field": (USER, {"metadata": {"user_id": "u", "team": "a"}}, "metadata.team:"),
}


@pytest.mark.parametrize("messages, fields, where", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_body_is_a_400_naming_the_field(client, messages, fields, where):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=5, messages=messages, extra_body=fields)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert e.value.body["error"]["message"].startswith(where), e.value.body["error"]["message"]


def test_count_tokens_refuses_what_create_refuses(client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.count_tokens(model=MODEL, messages=tool_result(["Not there."]))
    assert e.value.body["error"]["message"].startswith("messages.2.content.0.tool_result.content.0:")
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.count_tokens(model=MODEL, messages=USER, extra_body={"max_tokens": 5})
    assert e.value.body["error"]["message"].startswith("max_tokens:")  # count_tokens has no max_tokens


def test_what_the_sdk_sends_back_is_accepted(client):
    """An agent sends the reply's blocks back as the SDK dumps them (`citations`, `caller`, ... as null),
    with cache_control breakpoints and a tool_result of text blocks: all accepted."""
    first = create(client, tools=TOOLS, tool_choice={"type": "any"}, max_tokens=150)
    use = first.content[-1]
    cached = {"type": "ephemeral"}
    second = create(client, tools=[{**TOOLS[0], "cache_control": cached}],
                    system=[{"type": "text", "text": "Be brief.", "cache_control": cached}],
                    metadata={"user_id": "u-1"}, messages=[
        *USER, {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "is_error": False,
                                      "content": [{"type": "text", "text": "Not there.", "cache_control": cached}]},
                                     {"type": "text", "text": "Where then?"}]}])
    assert second.stop_reason == "end_turn" and second.content[-1].text == ANSWER
