"""`POST /tokenize` with a door's own body (`{"endpoint": path, "request": body}`) answers the prompt tokens
the engine gets when that body is sent to the door: chat with tools and `chat_template_kwargs`, Responses
with instructions, tools and a `previous_response_id` history, Messages with a system prompt and tools. The
precise router hashes these tokens, so they must be the engine's to the last one. The server is a live one
on the tiny Llama that logs each prompt it hands the engine (prompt_recording_serve.py)."""

import json
import sys
from pathlib import Path

import httpx
import pytest
from agent_template import AGENT_TEMPLATE, WEATHER_TOOL
from live_server import start_server

pytestmark = pytest.mark.server

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    """(client, prompt log): a live server whose chat template writes tools and a template variable, and the
    file its doors write each engine prompt's token ids to."""
    directory = tmp_path_factory.mktemp("tokenize-doors")
    template, prompts = directory / "agent.jinja", directory / "prompts.jsonl"
    template.write_text(AGENT_TEMPLATE)
    prompts.touch()
    live = start_server(tiny_llama_dir, directory, "--served-model-name", MODEL, "--chat-template", str(template),
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                        launcher=[sys.executable, str(Path(__file__).parent / "prompt_recording_serve.py")],
                        env={"TEST_SERVE_PROMPT_LOG": str(prompts),
                             "PAGODA_CPU_KERNELS": "0"})  # the torch path: no C++ build (prompts are tested)
    try:
        with httpx.Client(base_url=live.url, timeout=60) as client:
            yield client, prompts
    finally:
        live.stop()


def engine_prompt(server, path: str, body: dict) -> list[int]:
    """Send `body` to the door at `path`: the prompt's token ids the engine got."""
    client, prompts = server
    before = len(prompts.read_text().splitlines())
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    lines = prompts.read_text().splitlines()
    assert len(lines) == before + 1
    return json.loads(lines[-1])


def tokenize(server, body: dict, status: int = 200) -> dict:
    r = server[0].post("/tokenize", json=body)
    assert r.status_code == status, r.text
    return r.json()


def test_chat_with_tools_and_template_kwargs(server):
    body = {"model": MODEL, "max_tokens": 2, "tools": [WEATHER_TOOL], "tool_choice": "required",
            "chat_template_kwargs": {"persona": "a terse forecaster"},
            "messages": [{"role": "system", "content": "You answer with tools."},
                         {"role": "user", "content": "Weather in Paris?"},
                         {"role": "assistant", "content": "", "tool_calls": [{
                             "id": "call_1", "type": "function",
                             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                         {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
                         {"role": "user", "content": "And tomorrow?"}]}
    expected = engine_prompt(server, "/v1/chat/completions", body)
    got = tokenize(server, {"model": MODEL, "endpoint": "/v1/chat/completions", "request": body})
    assert got["tokens"] == expected and got["count"] == len(expected)
    # vLLM's chat shape with its tools and kwargs renders the same prompt
    vllm_shape = {k: body[k] for k in ("model", "messages", "tools", "chat_template_kwargs")}
    assert tokenize(server, vllm_shape)["tokens"] == expected
    # the messages alone (what the router sent before) are another prompt from the first token on
    alone = tokenize(server, {"model": MODEL, "messages": body["messages"]})["tokens"]
    assert alone[:8] != expected[:8]


def test_responses_with_a_stored_history(server):
    tools = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
              "parameters": WEATHER_TOOL["function"]["parameters"]}]
    first = {"model": MODEL, "instructions": "You are a weather agent.", "input": "Weather in Oslo?",
             "tools": tools, "max_output_tokens": 2}
    assert tokenize(server, {"endpoint": "/v1/responses", "request": first})["tokens"] == \
        engine_prompt(server, "/v1/responses", first)
    previous = server[0].post("/v1/responses", json=first).json()["id"]
    follow_up = {"model": MODEL, "instructions": "You are a weather agent.", "previous_response_id": previous,
                 "input": [{"role": "user", "content": "And in Bergen?"}], "tools": tools, "max_output_tokens": 2}
    got = tokenize(server, {"model": MODEL, "endpoint": "/v1/responses", "request": follow_up})["tokens"]
    expected = engine_prompt(server, "/v1/responses", follow_up)
    assert got == expected
    assert len(expected) > len(tokenize(server, {"endpoint": "/v1/responses", "request": first})["tokens"])


def test_messages_with_a_system_prompt_and_tools(server):
    body = {"model": MODEL, "max_tokens": 2, "system": "You are a careful weather agent.",
            "tools": [{"name": "get_weather", "description": "The weather in a city",
                       "input_schema": WEATHER_TOOL["function"]["parameters"]}],
            "messages": [{"role": "user", "content": "Weather in Rome?"},
                         {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                            "input": {"city": "Rome"}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                       "content": "rain"},
                                                      {"type": "text", "text": "Should I take an umbrella?"}]}]}
    expected = engine_prompt(server, "/v1/messages", body)
    assert tokenize(server, {"model": MODEL, "endpoint": "/v1/messages", "request": body})["tokens"] == expected


def test_bad_door_bodies_are_errors_naming_the_field(server):
    error = tokenize(server, {"endpoint": "/v1/responses", "request": {"model": MODEL, "input": 3}}, 400)["error"]
    assert error["param"].startswith("request.input")
    error = tokenize(server, {"endpoint": "/v1/responses",
                              "request": {"model": MODEL, "input": "x", "previous_response_id": "resp_none"}},
                     404)["error"]
    assert error["param"] == "previous_response_id"
    assert tokenize(server, {"endpoint": "/v1/messages", "request": {"model": MODEL}}, 400)["error"]["param"] \
        .startswith("request.")
    assert tokenize(server, {"prompt": "hi", "endpoint": "/v1/messages", "request": {}}, 400)["error"]["param"] \
        == "endpoint"
    assert tokenize(server, {"endpoint": "/v1/messages"}, 400)["error"]["param"] == "request"
    assert tokenize(server, {"endpoint": "/v1/embeddings", "request": {}}, 400)["error"]["param"] == "endpoint"
    assert tokenize(server, {"prompt": "hello"})["count"] > 0  # vLLM's shapes still work
