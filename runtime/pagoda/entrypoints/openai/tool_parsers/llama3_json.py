"""Llama 3.1+/3.2 JSON tool calls: the reply is `{"name": ..., "parameters": {...}}` (optionally after
`<|python_tag|>`), several separated by `;`."""

import json

from pagoda.entrypoints.openai.tool_parsers.base import ExtractedToolCalls, tool_call_from

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser:
    def extract(self, text: str) -> ExtractedToolCalls:
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):].lstrip()
        if not body.startswith("{"):
            return ExtractedToolCalls(text)
        decoder = json.JSONDecoder()
        calls, position = [], 0
        while position < len(body):
            try:
                obj, end = decoder.raw_decode(body, position)
            except json.JSONDecodeError:
                return ExtractedToolCalls(text)
            call = tool_call_from(obj, ("parameters", "arguments"))
            if call is None:
                return ExtractedToolCalls(text)
            calls.append(call)
            rest = body[end:].lstrip()
            if rest and not rest.startswith(";"):
                return ExtractedToolCalls(text)
            position = len(body) - len(rest[1:].lstrip()) if rest else len(body)
        return ExtractedToolCalls(None, calls)

    def content_prefix(self, text: str) -> int:
        body = text.lstrip()
        # a reply that is (or may become) a call starts with "{" or the python tag: none of it is content yet
        if not body or body.startswith("{") or PYTHON_TAG.startswith(body[: len(PYTHON_TAG)]):
            return 0
        return len(text)
