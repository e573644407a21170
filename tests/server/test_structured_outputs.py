"""Structured outputs through the official openai client against a live `pagoda serve` on a tiny random
Llama (garbage unconstrained): every constrained answer parses and validates, streamed or not, n > 1,
greedy and sampled, alongside free requests; a constraint that does not compile is a 400 naming its field."""

import asyncio
import json
import re

import jsonschema
import openai
import pytest
from live_server import API_KEY

pytestmark = pytest.mark.server

MODEL = "tiny"
CHAT = [{"role": "user", "content": "Describe a pet as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "kind": {"enum": ["cat", "dog", "fox"]},
        "friends": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2},
    },
    "required": ["name", "age", "kind", "friends"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
REGEX = r"(yes|no)-[0-9]{1,3}"
CHOICES = ["Paris", "San Francisco", "Kubernetes"]


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory("--served-model-name", MODEL, env={"PAGODA_API_KEY": API_KEY})


@pytest.fixture(scope="module")
def client(server):
    return server.client(API_KEY, timeout=120)


@pytest.fixture
def async_client(server):
    return server.client(API_KEY, timeout=120, asynchronous=True)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chat_json_schema_always_validates(client, temperature):
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=300, n=3, seed=7,
                                         temperature=temperature, response_format=RESPONSE_FORMAT)
    assert len(out.choices) == 3
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_chat_json_object(client):
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=300, seed=1,
                                         response_format={"type": "json_object"})
    choice = out.choices[0]
    # a random model may not close a string within max_tokens (whether it does depends on the random stream)
    assert choice.message.content.lstrip().startswith("{"), choice
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert choice.finish_reason == "length" and out.usage.completion_tokens == 300


def test_streamed_json_schema_reassembles_to_valid_json(client):
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=300, n=2, seed=3,
                                            temperature=1.0, response_format=RESPONSE_FORMAT, stream=True)
    texts, reasons = ["", ""], [None, None]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert reasons == ["stop", "stop"]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_vllm_extras_on_completions(client):
    out = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=20, n=2, temperature=1.0, seed=5,
                                    extra_body={"guided_regex": REGEX})
    assert all(re.fullmatch(REGEX, c.text) for c in out.choices), out
    out = client.completions.create(model=MODEL, prompt="City:", max_tokens=20, temperature=1.0, seed=5,
                                    extra_body={"guided_choice": CHOICES})
    assert out.choices[0].text in CHOICES
    out = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=300, seed=5,
                                    extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(out.choices[0].text), SCHEMA)
    stream = client.completions.create(model=MODEL, prompt="x", max_tokens=20, temperature=1.0, seed=9,
                                       stream=True, extra_body={"structured_outputs": {"choice": CHOICES}})
    assert "".join(c.choices[0].text for c in stream) in CHOICES


def test_chat_structured_outputs_extra_and_response_format_on_completions(client):
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=1.0, seed=2,
                                         extra_body={"structured_outputs": {"regex": REGEX}})
    assert re.fullmatch(REGEX, out.choices[0].message.content)
    out = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=300, seed=5,
                                    extra_body={"response_format": RESPONSE_FORMAT})
    jsonschema.validate(json.loads(out.choices[0].text), SCHEMA)


def test_constrained_and_free_requests_run_together(async_client):
    async def run():
        constrained = [async_client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=300, temperature=1.0, seed=i, response_format=RESPONSE_FORMAT)
            for i in range(4)]
        free = [async_client.completions.create(model=MODEL, prompt="free text", max_tokens=40, seed=i,
                                                temperature=1.0, extra_body={"ignore_eos": True})
                for i in range(4)]
        return await asyncio.gather(*constrained, *free)

    results = asyncio.run(run())
    for out in results[:4]:
        jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    for out in results[4:]:
        assert out.usage.completion_tokens == 40


@pytest.mark.parametrize("field, value", [
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x"}}),
    ("response_format", {"type": "yaml"}),
    ("guided_regex", "(unclosed"),
    ("guided_choice", []),
    ("guided_json", "{not json"),
    ("structured_outputs", {"grammar": "root ::= missing_rule"}),
    ("structured_outputs", {"regex": "a", "choice": ["a"]}),
    ("structured_outputs", {"pattern": "a"}),
])
def test_invalid_constraints_are_400_naming_the_field(client, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, extra_body={field: value})
    assert e.value.body["param"].split(".")[0] == field, e.value.body


def test_two_constraints_are_refused(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4,
                                       response_format={"type": "json_object"}, extra_body={"guided_regex": "a"})
    assert e.value.body["param"] == "guided_regex"


def test_logprobs_of_constrained_outputs_are_the_models_own_and_finite(client):
    # one allowed token at a time leaves the other top alternatives masked out: they keep their raw logprobs
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, logprobs=True, top_logprobs=5,
                                         extra_body={"guided_choice": ["Kubernetes"]})
    assert out.choices[0].message.content == "Kubernetes"
    for entry in out.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 5
        assert all(-1e4 < alt.logprob <= 0 for alt in entry.top_logprobs)
