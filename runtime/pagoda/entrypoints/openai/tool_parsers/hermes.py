"""Hermes-style tool calls (Qwen2.5, Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
one block per call, content before them."""

import json
import re

from pagoda.entrypoints.openai.tool_parsers.base import ExtractedToolCalls, tool_call_from

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


class HermesToolParser:
    def extract(self, text: str) -> ExtractedToolCalls:
        if START not in text:
            return ExtractedToolCalls(text)
        calls = []
        for body in _BLOCK.findall(text):
            try:
                call = tool_call_from(json.loads(body.strip()), ("arguments", "parameters"))
            except json.JSONDecodeError:
                call = None
            if call is None:  # not a well-formed call: the whole text is content, as the model wrote it
                return ExtractedToolCalls(text)
            calls.append(call)
        content = text[: text.index(START)].strip()
        return ExtractedToolCalls(content or None, calls)

    def content_prefix(self, text: str) -> int:
        start = text.find(START)
        if start >= 0:
            return start
        # hold back an ending that could be the start of "<tool_call>"
        for k in range(min(len(START) - 1, len(text)), 0, -1):
            if text.endswith(START[:k]):
                return len(text) - k
        return len(text)
