"""One assistant turn (n=1) of the agent doors, Responses and Messages: split into reasoning, content and
tool calls once whole (`split_turn`), or followed as it streams (`StreamedTurn`). Each door turns these into
its own items or blocks and events."""

from collections.abc import AsyncIterator
from dataclasses import dataclass

from pagoda.engine.outputs import RequestOutput
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest
from pagoda.entrypoints.openai.serving_chat import OpenAIServingChat, reasoning_tokens
from pagoda.entrypoints.openai.serving_completion import finish_reason
from pagoda.entrypoints.openai.tool_choice import output_tool_calls
from pagoda.entrypoints.openai.tool_parsers import ParsedToolCall


@dataclass
class Turn:
    """One turn's output, split: what the items (Responses) or blocks (Messages) are made of."""

    reasoning: str | None
    content: str | None
    calls: list[ParsedToolCall]
    status: str  # completed | incomplete | cancelled
    usage: dict | None
    stop_reason: int | str | None = None  # the stop string or token id that ended it


def split_turn(chat: OpenAIServingChat, chat_request: ChatCompletionRequest, final: RequestOutput,
               cancelled: bool = False) -> Turn:
    """A finished output as reasoning, content and tool calls, with its status and usage (the Responses
    API's names; the Messages API renames them)."""
    c = final.outputs[0]
    parser = chat.reasoning_parser
    reasoning, content = parser.split(c.text, final.prompt_token_ids) if parser is not None else (None, c.text)
    reason = finish_reason(c)
    calls = []
    if reason == "stop" and not cancelled:
        content, calls = output_tool_calls(content or "", *chat_request.tool_mode, chat.tool_parser)
    status = "cancelled" if cancelled else ("incomplete" if reason == "length" else "completed")
    thinking = reasoning_tokens(parser, c, final.prompt_token_ids) if parser is not None else 0
    prompt, output = len(final.prompt_token_ids), len(c.token_ids)
    usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": final.num_cached_tokens},
             "output_tokens": output, "output_tokens_details": {"reasoning_tokens": thinking},
             "total_tokens": prompt + output}
    return Turn(reasoning, content or None, calls, status, usage, c.stop_reason)


class StreamedTurn:
    """A turn as it streams, by the request's tool mode: the thinking (with --reasoning-parser) as it
    comes; the text as far as no tool call can start in it (`none`: all of it; `auto`: up to where a call
    could begin); a named function's arguments as the model writes them (its output is the arguments).
    `required`'s and `auto`'s calls are known once the output is whole: `unsent_text` and `calls_to_send`
    then say what is left to send."""

    def __init__(self, chat: OpenAIServingChat, chat_request: ChatCompletionRequest, prompt_token_ids: list[int]):
        self.mode, self.name = chat_request.tool_mode
        self.tool_parser = chat.tool_parser
        parser = chat.reasoning_parser
        self.splitter = parser.splitter(prompt_token_ids) if parser is not None else None
        self.final: RequestOutput | None = None  # the last output seen
        self.content = ""  # the output so far, without the thinking
        self.sent = 0  # content characters sent

    async def deltas(self, stream: AsyncIterator[RequestOutput]) -> AsyncIterator[tuple[str, str]]:
        """(kind, text) pieces as the stream goes: kind `reasoning`, `text` or `arguments` (named mode)."""
        async for out in stream:
            self.final = out
            c = out.outputs[0]
            if self.splitter is not None:
                thinking = self.splitter.feed(c.text, final=c.finish_reason is not None)
                if thinking:
                    yield "reasoning", thinking
                self.content = self.splitter.content
            else:
                self.content = c.text
            if self.mode in ("none", "named"):
                safe = len(self.content)
            elif self.mode == "auto" and c.finish_reason is None:
                safe = self.tool_parser.content_prefix(self.content)
            else:
                continue  # required, or auto once whole: the calls come with the final output
            if safe > self.sent:
                yield ("arguments" if self.mode == "named" else "text"), self.content[self.sent:safe]
                self.sent = safe

    def unsent_text(self, turn: Turn) -> str:
        """Once whole, the text not sent yet: up to the first call, if any (`none` and `auto` only)."""
        if self.mode not in ("none", "auto"):
            return ""
        end = self.tool_parser.content_prefix(self.content) if turn.calls else len(self.content)
        return self.content[self.sent:end]

    def calls_to_send(self, turn: Turn) -> list[ParsedToolCall]:
        """The calls still to send whole: all of them, but a named function's (already streamed)."""
        return [] if self.mode == "named" else turn.calls
