"""A forced tool choice as a grammar: a named function's output is its arguments (a JSON object of its
parameters' schema); `required` is a JSON array of {"name", "parameters"} calls. The grammar engine then
makes any model call tools, and the output is turned back into calls here (`auto`'s by the tool parser):
for every door that serves tools (chat, Responses, Messages)."""

import json

from pagoda.entrypoints.openai.tool_parsers import ParsedToolCall, ToolParser
from pagoda.errors import InvalidParam
from pagoda.sampling_params import StructuredOutputsParams

ANY_OBJECT = {"type": "object"}


def forced_tool_constraint(tools: list[tuple[str, dict | None]], mode: str, name: str | None,
                           parallel_tool_calls: bool | None) -> StructuredOutputsParams | None:
    """tools: (name, parameters schema) each; mode: none | auto | required | named (then `name`)."""
    if mode in ("required", "named") and not tools:
        raise InvalidParam("tool_choice", f"tool_choice {mode if mode == 'required' else name!r} needs tools")
    if mode == "named":
        schema = dict(tools).get(name, False)
        if schema is False:
            raise InvalidParam("tool_choice", f"tool_choice names function {name!r}, which is not in tools")
        return StructuredOutputsParams(json=schema or ANY_OBJECT, field="tools")
    if mode != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"enum": [tool]}, "parameters": schema or ANY_OBJECT},
              "required": ["name", "parameters"], "additionalProperties": False} for tool, schema in tools]
    array = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if parallel_tool_calls is False:
        array["maxItems"] = 1
    return StructuredOutputsParams(json=array, field="tools")


def forced_tool_calls(text: str, mode: str, name: str | None) -> list[ParsedToolCall]:
    """The calls in a finished forced output (the grammar guarantees its shape)."""
    if mode == "named":
        return [ParsedToolCall(name, text)]
    return [ParsedToolCall(call["name"], json.dumps(call["parameters"], ensure_ascii=False))
            for call in json.loads(text)]


def output_tool_calls(text: str, mode: str, name: str | None,
                      tool_parser: ToolParser | None) -> tuple[str | None, list[ParsedToolCall]]:
    """A finished output's text as (content, tool calls), by the request's tool mode: a forced one's output
    is all calls; `auto`'s are what the tool parser finds (the text around them is the content)."""
    if mode in ("named", "required"):
        return None, forced_tool_calls(text, mode, name)
    if mode == "auto":
        extracted = tool_parser.extract(text)
        return extracted.content, extracted.tool_calls
    return text, []
