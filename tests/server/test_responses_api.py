"""The Responses API through the official openai client (`client.responses`) against a live `pagoda serve`
on the tiny checkpoint that thinks (tests/thinking_checkpoint.py), with --reasoning-parser and a tool-call
parser: plain, streamed (typed events in order, numbered), function tools and their outputs, structured
text formats, stored responses and previous_response_id, errors naming the field."""

import json

import httpx
import jsonschema
import openai
import pytest
from live_server import API_KEY
from thinking_checkpoint import ANSWER, REASONING
from thinking_checkpoint import MAX_STORED_RESPONSES as MAX_STORED
from thinking_checkpoint import SERVED_NAME as MODEL
from transformers import AutoTokenizer

pytestmark = pytest.mark.server

SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]}}, "required": ["city"],
          "additionalProperties": False}
TOOLS = [{"type": "function", "name": "locate", "description": "Where a landmark is", "parameters": SCHEMA}]


@pytest.fixture(scope="module")
def server(thinking_server):
    return thinking_server


@pytest.fixture(scope="module")
def client(server):
    return server.client(API_KEY, timeout=120)


def create(client, **kwargs):
    kwargs.setdefault("input", "Where is the Golden Gate?")
    return client.responses.create(model=MODEL, max_output_tokens=kwargs.pop("max_output_tokens", 40),
                                   temperature=0, **kwargs)


def prompt_tokens(server, messages) -> int:
    return httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": messages},
                      headers={"Authorization": f"Bearer {API_KEY}"}).json()["count"]


def test_a_plain_response_has_reasoning_then_the_answer(client, thinking_dir):
    r = create(client)
    assert r.status == "completed" and r.id.startswith("resp_") and r.object == "response"
    assert r.output_text == ANSWER
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == REASONING
    assert message.type == "message" and message.role == "assistant"
    thinking = len(AutoTokenizer.from_pretrained(thinking_dir).encode(REASONING, add_special_tokens=False))
    assert r.usage.output_tokens_details.reasoning_tokens == thinking
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens >= 0


def test_instructions_and_message_items_make_the_prompt(server, client):
    items = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Where?"}]}]
    r = create(client, instructions="Answer briefly.", input=items)
    assert r.output_text == ANSWER and r.instructions == "Answer briefly."
    expected = prompt_tokens(server, [{"role": "system", "content": "Answer briefly."}, *items[:2],
                                      {"role": "user", "content": "Where?"}])
    assert r.usage.input_tokens == expected


def test_streamed_events_come_in_order_with_sequence_numbers(client):
    events = list(create(client, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[-1] == "response.completed"
    # the reasoning item closes before the message opens
    assert types.index("response.reasoning_text.done") < types.index("response.output_text.delta")
    assert types.count("response.output_item.added") == types.count("response.output_item.done") == 2
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (reasoning, text) == (REASONING, ANSWER)
    final = events[-1].response
    assert final.output_text == ANSWER and final.status == "completed"
    assert [item.id for item in final.output] == [e.item.id for e in events if e.type == "response.output_item.done"]
    assert client.responses.retrieve(final.id).output_text == ANSWER


def test_a_forced_function_call_then_its_output_continue_the_conversation(server, client):
    first = create(client, tools=TOOLS, tool_choice="required", max_output_tokens=150)
    calls = [item for item in first.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["locate"] and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMA)
    second = create(client, previous_response_id=first.id, tools=TOOLS, tool_choice="auto",
                    input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "San Francisco"}])
    assert second.output_text == ANSWER and second.previous_response_id == first.id
    assert not [item for item in second.output if item.type == "function_call"]
    # the prompt held the first turn, its call and the call's output; the first prompt came from the cache
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0


def test_a_streamed_function_call(client):
    events = list(create(client, stream=True, tools=TOOLS, tool_choice={"type": "function", "name": "locate"},
                         max_output_tokens=150))
    types = [e.type for e in events]
    assert "response.function_call_arguments.delta" in types and types[-1] == "response.completed"
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    jsonschema.validate(json.loads(arguments), SCHEMA)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(d.name, d.arguments) for d in done] == [("locate", arguments)]
    call = events[-1].response.output[-1]
    assert (call.type, call.name, call.arguments) == ("function_call", "locate", arguments)


@pytest.mark.parametrize("fmt", [{"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True},
                                 {"type": "json_object"}])
def test_text_formats_apply_after_the_reasoning(client, fmt):
    r = create(client, text={"format": fmt}, max_output_tokens=60 if fmt["type"] == "json_schema" else 30)
    assert r.output[0].content[0].text == REASONING
    if fmt["type"] == "json_schema":
        jsonschema.validate(json.loads(r.output_text), SCHEMA)
    else:  # any object: this model, steered into a string key, writes its script into it until the limit
        assert r.output_text.startswith('{"') and r.status == "incomplete"


def test_stored_responses_are_bounded_least_recently_used_first(client):
    ids = [create(client, max_output_tokens=3).id for _ in range(MAX_STORED)]
    client.responses.retrieve(ids[0])  # now the most recently used
    create(client, max_output_tokens=3)  # one more: the least recently used, ids[1], goes
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[1])
    assert client.responses.retrieve(ids[0]).id == ids[0]


def test_store_false_keeps_nothing(client):
    r = create(client, store=False, max_output_tokens=3)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        create(client, previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id"


def test_a_finished_response_cannot_be_cancelled(client):
    r = create(client, max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_unknown")


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"background": True}, "background"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nowhere"}}, "tool_choice"),
])
def test_unsupported_or_invalid_fields_are_refused_by_name(client, fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, **{"input": "Hi", **fields})
    assert e.value.body["param"] == param


def test_cancel_stops_a_running_response(client):
    """json_object steers this model into a string it never closes: it runs until cancelled or out of budget.
    On a loaded two-core box the server can spend the whole budget before the client reads the first delta;
    only that race is tried again, and an attempt must be cancelled mid-run for the test to pass."""
    for _attempt in range(3):
        stream = create(client, stream=True, text={"format": {"type": "json_object"}}, max_output_tokens=400)
        events = []
        for event in stream:
            events.append(event)
            if event.type == "response.output_text.delta":
                break
        try:
            cancelled = client.responses.cancel(events[0].response.id)
        except openai.BadRequestError as error:
            assert "'incomplete'" in str(error), error
            stream.close()
            continue
        assert cancelled.status == "cancelled"
        break
    else:
        pytest.fail("every attempt ran out its 400 tokens before the cancel reached the server")
    events += list(stream)
    final = events[-1]
    assert final.type == "response.incomplete" and final.response.status == "cancelled"
    assert final.response.usage.output_tokens < 400
    assert client.responses.retrieve(final.response.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(final.response.id)
