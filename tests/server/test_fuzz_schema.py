"""Schemathesis against a live `pagoda serve`: requests generated from the published OpenAPI document,
valid and invalid. No answer is a server error, every status and body is the one the document
describes (400 for bad bodies, in OpenAI's error shape), every schema-violating request is refused.

The `positive_data_acceptance` check is left out: limits the schema cannot state (token ids within the
vocabulary, prompt plus max_tokens within the context, top_logprobs only with logprobs) make some
schema-valid requests a correct 400.

Anthropic's door (`/v1/messages`) gets its own hostile bodies too: valid conversations (text, thinking,
tool_use and tool_result blocks, tools, system blocks) with parts replaced by any JSON, removed, or joined
by unknown fields. No answer is a 5xx, and every error is in Anthropic's shape.

`PAGODA_FUZZ_EXAMPLES` (default 15) sets examples per operation; `PAGODA_FUZZ_PHASES` (default
`fuzzing`) the schemathesis phases: `make fuzz` runs every phase with many more examples."""

import copy
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = [pytest.mark.server, pytest.mark.fuzz]


def test_schemathesis_finds_no_mismatch(server_factory, tmp_path):
    # a short context keeps every generated request (no max_tokens: up to the context) quick
    server = server_factory("--max-model-len", "64", "--max-num-seqs", "16")
    st = Path(sys.executable).parent / "st"
    command = [str(st), "run", server.url + "/openapi.json", "--checks", "all",
               "--exclude-checks", "positive_data_acceptance", "--max-examples",
               os.environ.get("PAGODA_FUZZ_EXAMPLES", "15"), "--phases",
               os.environ.get("PAGODA_FUZZ_PHASES", "fuzzing"), "--generation-deterministic",
               "--request-timeout", "60", "--max-response-time", "60", "--no-color"]
    # run in a temporary directory: schemathesis keeps a cache of what it found in the working directory
    proc = subprocess.run(command, capture_output=True, text=True, timeout=3000, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert server.process.poll() is None, "the server died"


TOOL = {"name": "locate", "description": "Where a landmark is",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
CONVERSATION = [
    {"role": "user", "content": "Where is the Golden Gate?"},
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "Look it up.", "signature": ""},
                                      {"type": "text", "text": "Let me look."},
                                      {"type": "tool_use", "id": "toolu_1", "name": "locate", "input": {"city": "SF"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                  "content": [{"type": "text", "text": "In San Francisco."}]},
                                 {"type": "text", "text": "Thanks."}]},
]
# valid bodies, each the seed of many hostile ones
MESSAGES_BODIES = [
    {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]},
    {"model": "tiny", "max_tokens": 4, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "stop_sequences": ["x"],
     "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
     "metadata": {"user_id": "u"}, "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]},
    {"model": "tiny", "max_tokens": 4, "system": "Find landmarks.", "tools": [TOOL], "tool_choice": {"type": "auto"},
     "messages": CONVERSATION},
]
COUNT_FIELDS = ("model", "messages", "system", "tools", "tool_choice")
ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["type", "text", "content", "id", "name", "input", "tool_use_id", "role", "x"]), inner,
        max_size=3),
    max_leaves=6)
# values the door has typed places for: blocks of every kind, some not served
BLOCKS = st.sampled_from([{"type": "text", "text": "a"}, {"type": "image", "source": {"type": "base64"}},
                          {"type": "tool_use", "id": "t", "name": "locate", "input": {}},
                          {"type": "tool_result", "tool_use_id": "t", "content": ["plain"]},
                          {"type": "thinking", "thinking": "t"}, {"type": "document"}, {"type": None}])
HOSTILE = ANY_JSON | BLOCKS | st.lists(ANY_JSON | BLOCKS, max_size=3)


def places(value, path=()):
    """Every place in a JSON value: the paths of its items and fields."""
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        yield path + (key,)
        yield from places(child, path + (key,))


@st.composite
def hostile_bodies(draw):
    body = copy.deepcopy(draw(st.sampled_from(MESSAGES_BODIES)))
    for _ in range(draw(st.integers(1, 2))):
        path = draw(st.sampled_from(list(places(body))))
        parent = body
        for key in path[:-1]:
            parent = parent[key]
        how = draw(st.sampled_from(["replace", "remove", "add field"]))
        if how == "remove":
            del parent[path[-1]]
        elif how == "add field" and isinstance(parent, dict):
            parent[draw(st.sampled_from(["extra", "frequency_penalty", "source", "name"]))] = draw(HOSTILE)
        else:
            parent[path[-1]] = draw(HOSTILE)
        if not isinstance(body, dict) or not body:
            break
    return body


@pytest.fixture(scope="module")
def messages_server(server_factory):
    return server_factory("--max-model-len", "64", "--served-model-name", "tiny", "--enable-auto-tool-choice",
                          "--tool-call-parser", "hermes")


@settings(max_examples=int(os.environ.get("PAGODA_FUZZ_EXAMPLES", "15")) * 8, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(body=hostile_bodies())
def test_hostile_anthropic_bodies_get_anthropics_errors(messages_server, body):
    with httpx.Client(base_url=messages_server.url, timeout=60) as client:
        for path, sent in (("/v1/messages", body),
                           ("/v1/messages/count_tokens", {k: v for k, v in body.items() if k in COUNT_FIELDS})):
            r = client.post(path, json=sent)
            assert r.status_code < 500, (path, sent, r.text)
            if r.status_code >= 400:
                error = r.json()
                assert error["type"] == "error" and set(error["error"]) == {"type", "message"}, (sent, error)
                assert error["error"]["type"] == {400: "invalid_request_error", 404: "not_found_error",
                                                  429: "rate_limit_error"}[r.status_code], (sent, error)
                assert error["error"]["message"], sent
    assert messages_server.process.poll() is None, "the server died"
