"""Tool calling through the official openai client against a live `pagoda serve` on a tiny random Llama:
a forced tool choice (a named function, or "required") is enforced by the grammar engine, so even a
random model calls tools; a two-tool agent loop runs to its final answer; streamed calls reassemble to
the non-streamed ones."""

import json

import jsonschema
import openai
import pytest
from live_server import API_KEY

pytestmark = pytest.mark.server

MODEL = "tiny"
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]},
                                            "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
USER = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory("--served-model-name", MODEL, env={"PAGODA_API_KEY": API_KEY})


@pytest.fixture(scope="module")
def client(server):
    return server.client(API_KEY, timeout=120)


def check_calls(message) -> None:
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_two_tool_agent_loop_runs_to_its_final_answer(client):
    messages = list(USER)
    prompt_tokens = []
    for tool, result in (("get_weather", "18 C, sunny"), ("get_time", "14:05")):
        out = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice=named(tool),
                                             max_tokens=200, temperature=1.0, seed=11)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert [c.function.name for c in choice.message.tool_calls] == [tool]
        check_calls(choice.message)
        prompt_tokens.append(out.usage.prompt_tokens)
        call = choice.message.tool_calls[0]
        messages.append(choice.message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "name": tool, "content": result})
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                           max_tokens=12)
    assert final.choices[0].message.tool_calls is None
    assert final.choices[0].message.content and final.choices[0].finish_reason in ("stop", "length")
    # the tool messages reached the template: each turn's prompt holds the previous one's call and result
    assert prompt_tokens[0] < prompt_tokens[1] < final.usage.prompt_tokens


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_at_least_one_known_tool(client, parallel):
    out = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=parallel, max_tokens=300, n=2, temperature=1.0,
                                         seed=4)
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        check_calls(choice.message)
        if not parallel:
            assert len(choice.message.tool_calls) == 1


def reassemble(stream) -> dict[int, list[tuple[str, str]]]:
    """choice index -> [(name, arguments)] from delta.tool_calls chunks, as clients rebuild them."""
    calls: dict[int, dict[int, list[str]]] = {}
    reasons = {}
    for chunk in stream:
        for c in chunk.choices:
            for delta in c.delta.tool_calls or []:
                entry = calls.setdefault(c.index, {}).setdefault(delta.index, ["", ""])
                if delta.id:
                    assert delta.function.name and delta.type == "function"
                if delta.function and delta.function.name:
                    entry[0] += delta.function.name
                if delta.function and delta.function.arguments:
                    entry[1] += delta.function.arguments
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert set(reasons.values()) == {"tool_calls"}, reasons
    return {i: [tuple(v) for _, v in sorted(by_call.items())] for i, by_call in calls.items()}


@pytest.mark.parametrize("tool_choice", [named("get_time"), "required"])
def test_streamed_tool_calls_reassemble_to_the_non_streamed_ones(client, tool_choice):
    kwargs = dict(model=MODEL, messages=USER, tools=TOOLS, tool_choice=tool_choice, max_tokens=300, n=2,
                  temperature=0.0)
    whole = client.chat.completions.create(**kwargs)
    streamed = reassemble(client.chat.completions.create(**kwargs, stream=True))
    for choice in whole.choices:
        expected = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert streamed[choice.index] == expected


@pytest.mark.parametrize("kwargs, param", [
    ({"tools": TOOLS, "tool_choice": named("missing")}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),  # this server has no tool-call parser
    ({"tools": TOOLS}, "tool_choice"),  # auto is the default with tools
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}], "tool_choice": "none"}, "tools"),
])
def test_bad_tool_requests_are_400_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, **kwargs)
    assert e.value.body["param"].split(".")[0] == param, e.value.body


def test_auto_parses_the_models_output_with_the_chosen_parser(server_factory):
    server = server_factory("--served-model-name", MODEL, "--enable-auto-tool-choice", "--tool-call-parser",
                            "hermes", env={"PAGODA_API_KEY": API_KEY})
    client = server.client(API_KEY, timeout=120)
    out = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=16, seed=1)
    # a random model writes no <tool_call> block: its text is content, as the parser found no call
    assert out.choices[0].message.tool_calls is None and out.choices[0].message.content
    forced = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required",
                                            max_tokens=300, seed=1)
    check_calls(forced.choices[0].message)


def test_auto_streams_its_content_and_reassembles_to_the_whole_reply(server_factory):
    server = server_factory("--served-model-name", MODEL, "--enable-auto-tool-choice", "--tool-call-parser",
                            "llama3_json", env={"PAGODA_API_KEY": API_KEY})
    client = server.client(API_KEY, timeout=120)
    kwargs = dict(model=MODEL, messages=USER, tools=TOOLS, tool_choice="auto", max_tokens=24, temperature=0.0)
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    content = "".join(c.delta.content or "" for c in chunks)
    assert whole.message.tool_calls is None and content == whole.message.content
    assert chunks[-1].finish_reason == whole.finish_reason
    assert sum(1 for c in chunks if c.delta.content) > 1  # streamed as it came, not in one piece at the end
