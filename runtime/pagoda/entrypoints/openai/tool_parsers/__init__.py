"""Tool-call parsers for `tool_choice: "auto"`: a model's text -> content and tool calls. One module per
model family's format, chosen by `--tool-call-parser` (vLLM's names)."""

from pagoda.entrypoints.openai.tool_parsers.base import ExtractedToolCalls, ParsedToolCall, ToolParser
from pagoda.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagoda.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}

__all__ = ["TOOL_PARSERS", "ExtractedToolCalls", "ParsedToolCall", "ToolParser"]
