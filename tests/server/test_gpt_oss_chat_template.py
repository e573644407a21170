"""gpt-oss's real chat template (Harmony: system, developer, channels; tests/fixtures) rendered by the path
/v1/chat/completions and /tokenize take equals transformers' apply_chat_template on the same conversation,
and what the model answers in Harmony splits into reasoning and content with --reasoning-parser openai_gptoss."""

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest
from checkpoints import write_tokenizer

from pagoda.entrypoints.openai.harmony_reasoning import MARKERS
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest
from pagoda.entrypoints.openai.reasoning_parsers import reasoning_parser
from pagoda.entrypoints.openai.serving_chat import OpenAIServingChat

TEMPLATE = (Path(__file__).parent.parent / "fixtures" / "gpt_oss_chat_template.jinja").read_text()
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "the city"},
        "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
        "days": {"type": "integer"}}}}}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("gpt-oss-tok")
    write_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": list(MARKERS)})
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)  # the template as the checkpoint ships it, in tokenizer_config / chat_template.jinja
    return AutoTokenizer.from_pretrained(path)


def pagoda_render(tokenizer, body: dict) -> tuple[str, list[int]]:
    """OpenAIServingChat.render, the one door every chat prompt goes through (chat, /tokenize)."""
    server = SimpleNamespace(tokenizer=tokenizer, chat_template=None, trust_request_chat_template=False)
    request = ChatCompletionRequest.model_validate({"model": "m", **body})
    return asyncio.run(OpenAIServingChat.render(server, request))


def reference(tokenizer, messages, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


def test_template_is_the_checkpoints(tokenizer):
    assert tokenizer.chat_template == TEMPLATE
    assert "# Valid channels: analysis, commentary, final" in TEMPLATE


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"}],
    [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "And?"}],
], ids=["plain", "system", "multi-turn"])
def test_conversation_renders_as_transformers(tokenizer, messages):
    text, ids = pagoda_render(tokenizer, {"messages": messages})
    expected = reference(tokenizer, messages)
    assert text == expected
    assert text.startswith("<|start|>system<|message|>You are ChatGPT") and text.endswith("<|start|>assistant")
    assert "Reasoning: medium" in text
    assert ids == tokenizer.encode(expected, add_special_tokens=False)
    assert tokenizer.convert_tokens_to_ids("<|start|>") in ids  # the markers are one special token each


@pytest.mark.parametrize("effort", ["low", "high"])
def test_reasoning_effort_reaches_the_template(tokenizer, effort):
    messages = [{"role": "user", "content": "Hi"}]
    expected = reference(tokenizer, messages, reasoning_effort=effort)
    assert f"Reasoning: {effort}" in expected
    assert pagoda_render(tokenizer, {"messages": messages, "reasoning_effort": effort})[0] == expected
    # vLLM's other door: a template kwarg
    kwargs = {"reasoning_effort": effort, "model_identity": "You are Pagoda.", "builtin_tools": ["python"]}
    text = pagoda_render(tokenizer, {"messages": messages, "chat_template_kwargs": kwargs})[0]
    assert text == reference(tokenizer, messages, **kwargs) and "You are Pagoda." in text and "## python" in text


def test_tools_render_as_typescript_namespace(tokenizer):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    text = pagoda_render(tokenizer, {"messages": messages, "tools": [TOOL]})[0]
    assert text == reference(tokenizer, messages, tools=[TOOL])
    assert "namespace functions {" in text and "type get_weather = (_: {" in text
    assert "Calls to these tools must go to the commentary channel: 'functions'." in text


def test_assistant_tool_call_with_prior_reasoning(tokenizer):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    body = {"tools": [TOOL], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning": "Need the weather tool.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]}
    text = pagoda_render(tokenizer, body)[0]
    expected = reference(tokenizer, [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "thinking": "Need the weather tool.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"}], tools=[TOOL])
    assert text == expected
    # the analysis of a call still pending is kept (gpt-oss continues from it)
    assert "<|channel|>analysis<|message|>Need the weather tool.<|end|>" in text
    assert '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}' in text


def test_earlier_turns_reasoning_is_dropped(tokenizer):
    """CoT of finished turns never goes back to the model: the template's rule, reasoning sent back or not."""
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello.", "reasoning": "Greet back."},
                {"role": "user", "content": "Bye"}]
    text = pagoda_render(tokenizer, {"messages": messages})[0]
    assert "Greet back." not in text and "<|channel|>final<|message|>Hello.<|end|>" in text


def test_harmony_answer_to_the_rendered_prompt_splits(tokenizer):
    """The model's Harmony answer after this template's prompt: analysis is reasoning, final is content,
    whole or streamed token by token."""
    _, prompt_ids = pagoda_render(tokenizer, {"messages": [{"role": "user", "content": "Hi"}]})
    parser = reasoning_parser("openai_gptoss", tokenizer)
    output = ("<|channel|>analysis<|message|>User greets; reply.<|end|>"
              "<|start|>assistant<|channel|>final<|message|>Hello there.<|return|>")
    assert parser.split(output, prompt_ids) == ("User greets; reply.", "Hello there.")
    token_ids = tokenizer.encode(output, add_special_tokens=False)
    splitter = parser.splitter(prompt_ids)
    text, reasoning = "", ""
    for i in range(1, len(token_ids) + 1):
        text = tokenizer.decode(token_ids[:i], skip_special_tokens=False)
        reasoning += splitter.feed(text, final=i == len(token_ids))
    assert reasoning == "User greets; reply." and splitter.content == "Hello there."
