"""The agent doors' shared turn (pagoda/entrypoints/openai/agent_turns.py): a streamed turn's pieces by
tool mode, what is left to send once whole, and the calls a finished output holds. Both doors (Responses,
Messages) take it from there, not from each other, and use no private member of the chat server."""

import ast
import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from pagoda.engine.outputs import CompletionOutput, RequestOutput
from pagoda.entrypoints.openai.agent_turns import StreamedTurn, split_turn
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest
from pagoda.entrypoints.openai.tool_choice import output_tool_calls
from pagoda.entrypoints.openai.tool_parsers import HermesToolParser, ParsedToolCall

pytestmark = pytest.mark.unit

OPENAI = Path(__file__).resolve().parents[2] / "runtime" / "pagoda" / "entrypoints" / "openai"
TOOLS = [{"type": "function", "function": {"name": "locate", "parameters": {"type": "object"}}}]
CALL = '<tool_call>{"name": "locate", "arguments": {"city": "Paris"}}</tool_call>'
CHAT = SimpleNamespace(reasoning_parser=None, tool_parser=HermesToolParser())


def request(tool_choice=None) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}], tools=TOOLS,
                                 tool_choice=tool_choice)


def outputs(*texts: str) -> list[RequestOutput]:
    """The engine's cumulative outputs growing through `texts`, the last one finished."""
    return [RequestOutput("r", None, [1, 2], [CompletionOutput(0, text, list(range(i + 1)),
                                                               finish_reason="stop" if i == len(texts) - 1 else None)],
                          finished=i == len(texts) - 1) for i, text in enumerate(texts)]


def follow(chat_request: ChatCompletionRequest, texts: tuple[str, ...]):
    streamed = StreamedTurn(CHAT, chat_request, [1, 2])

    async def run():
        async def stream():
            for out in outputs(*texts):
                yield out

        return [piece async for piece in streamed.deltas(stream())]

    pieces = asyncio.run(run())
    turn = split_turn(CHAT, chat_request, streamed.final)
    return pieces, streamed.unsent_text(turn), streamed.calls_to_send(turn), turn


def test_auto_streams_text_until_a_call_could_start_then_sends_the_calls_whole():
    texts = ("Let me ", "Let me look. <tool", "Let me look. " + CALL)
    pieces, rest, calls, turn = follow(request("auto"), texts)
    assert "".join(text for _, text in pieces) + rest == "Let me look. "
    assert {kind for kind, _ in pieces} == {"text"}
    assert calls == turn.calls == [ParsedToolCall("locate", '{"city": "Paris"}')]


def test_none_streams_all_of_the_text():
    pieces, rest, calls, turn = follow(request("none"), ("Hel", "Hello " + CALL))
    assert [kind for kind, _ in pieces] == ["text", "text"] and rest == "" and calls == []
    assert "".join(text for _, text in pieces) == turn.content == "Hello " + CALL


def test_a_named_function_streams_its_arguments_and_nothing_is_left():
    named = {"type": "function", "function": {"name": "locate"}}
    pieces, rest, calls, turn = follow(request(named), ('{"city"', '{"city": "Paris"}'))
    assert pieces == [("arguments", '{"city"'), ("arguments", ': "Paris"}')]
    assert (rest, calls) == ("", []) and turn.calls == [ParsedToolCall("locate", '{"city": "Paris"}')]


def test_required_sends_nothing_until_whole():
    text = json.dumps([{"name": "locate", "parameters": {"city": "Tokyo"}}])
    pieces, rest, calls, _ = follow(request("required"), (text[:5], text))
    assert (pieces, rest) == ([], "")
    assert calls == [ParsedToolCall("locate", '{"city": "Tokyo"}')]


def test_output_tool_calls_by_mode():
    assert output_tool_calls("Hi " + CALL, "auto", None, HermesToolParser()) == (
        "Hi", [ParsedToolCall("locate", '{"city": "Paris"}')])
    assert output_tool_calls("Hi " + CALL, "none", None, None) == ("Hi " + CALL, [])
    assert output_tool_calls('{"a": 1}', "named", "f", None) == (None, [ParsedToolCall("f", '{"a": 1}')])


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}


def test_the_agent_doors_share_the_turn_module_not_each_other():
    for door, other in (("serving_messages", "serving_responses"), ("serving_responses", "serving_messages")):
        imports = imported_modules(OPENAI / f"{door}.py")
        assert f"pagoda.entrypoints.openai.{other}" not in imports, f"{door} imports {other}"
        assert "pagoda.entrypoints.openai.agent_turns" in imports, door


def test_no_module_uses_another_ones_private_members():
    """`obj._name` outside `self`/`cls`, where `_name` is a private method or function of these modules:
    what another module needs is made public and owned."""
    trees = {path: ast.parse(path.read_text()) for path in OPENAI.rglob("*.py")}
    private = {node.name for tree in trees.values() for node in ast.walk(tree)
               if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
               and node.name.startswith("_") and not node.name.startswith("__")}
    uses = [f"{path.name}:{node.lineno}: {ast.unparse(node)}" for path, tree in trees.items()
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr in private
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))]
    assert uses == []
