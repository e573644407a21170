"""What a tool-call parser returns (plain data: the server turns it into the wire format)."""

import json
from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI's `function.arguments`


@dataclass
class ExtractedToolCalls:
    content: str | None  # the text around the calls; None when there is none
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


class ToolParser(Protocol):
    def extract(self, text: str) -> ExtractedToolCalls:
        """A whole output -> its content and calls."""

    def content_prefix(self, text: str) -> int:
        """How many leading characters of an output, finished or not, are content no call can start in
        (what a stream may send before the output is whole)."""


def tool_call_from(obj, arguments_keys: tuple[str, ...]) -> ParsedToolCall | None:
    """{"name": ..., <one of arguments_keys>: {...}} -> a call; None if the object is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = next((obj[k] for k in arguments_keys if k in obj), {})
    if isinstance(arguments, str):  # some models write the arguments as JSON text already
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))
