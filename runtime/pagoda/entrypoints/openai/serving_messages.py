"""`POST /v1/messages` and `/v1/messages/count_tokens`: Anthropic's Messages API over the chat machinery, as
vLLM serves it, so the `anthropic` SDK and agents that take an Anthropic base URL can use a local model.

A request becomes a chat request (system prompt, text, tool_use and tool_result blocks as the template's
messages and tool calls); the output becomes content blocks: `thinking` (with --reasoning-parser), `text`,
`tool_use`. Streaming sends Anthropic's events (message_start, content_block_start / _delta / _stop,
message_delta, message_stop). Errors, including a bad body, are in Anthropic's shape."""

import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from pagoda.engine.outputs import RequestOutput
from pagoda.entrypoints.openai.agent_turns import StreamedTurn, Turn, split_turn
from pagoda.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ChatTool,
    FunctionCall,
    FunctionDefinition,
    FunctionName,
    NamedToolChoice,
    ToolCall,
)
from pagoda.entrypoints.openai.protocol_messages import (
    CountTokensRequest,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
    anthropic_error,
    validation_message,
)
from pagoda.entrypoints.openai.serving_base import EventStreamResponse, cancel_on_disconnect, last_output
from pagoda.entrypoints.openai.serving_chat import OpenAIServingChat
from pagoda.entrypoints.openai.tool_parsers import ParsedToolCall
from pagoda.errors import InvalidParam
from pagoda.http.errors import APIError

logger = logging.getLogger(__name__)


async def handle(raw: Request, model: type[BaseModel], checks: Callable[[], None],
                 work: Callable[[BaseModel], Awaitable]):
    """Run an Anthropic route: its checks (key, readiness), the body parsed, the work; any error in
    Anthropic's shape (a malformed body: 400 naming the field)."""
    try:
        checks()
        try:
            body = model.model_validate_json(await raw.body())
        except ValidationError as e:
            raise APIError(400, validation_message(e)) from None
        return await work(body)
    except InvalidParam as e:
        return anthropic_error(400, str(e))
    except APIError as e:
        return anthropic_error(e.status, e.message, e.headers)
    except Exception as e:  # a bug: still Anthropic's shape, so the client's SDK reads it
        logger.exception("unexpected error while serving an Anthropic request")
        return anthropic_error(500, f"internal server error: {e!r}")


def to_chat_messages(request: CountTokensRequest) -> list[ChatMessage]:
    """The system prompt and messages as chat messages: tool_result blocks become tool messages (before the
    user's text in the same turn), an assistant's tool_use blocks its tool calls; thinking blocks are left
    out (templates drop earlier thinking)."""
    messages = []
    system = request.system_text()
    if system:
        messages.append(ChatMessage(role="system", content=system))
    for i, m in enumerate(request.messages):
        if isinstance(m.content, str):
            messages.append(ChatMessage(role=m.role, content=m.content))
            continue
        texts, calls, results = [], [], []
        for j, block in enumerate(m.content):
            if isinstance(block, TextBlock):
                texts.append(block.text)
            elif isinstance(block, ToolUseBlock) and m.role == "assistant":
                arguments = json.dumps(block.input, ensure_ascii=False)
                calls.append(ToolCall(id=block.id, function=FunctionCall(name=block.name, arguments=arguments)))
            elif isinstance(block, ToolResultBlock) and m.role == "user":
                content = block.content or ""
                if not isinstance(content, str):
                    content = "".join(part.text for part in content)
                results.append(ChatMessage(role="tool", content=content, tool_call_id=block.tool_use_id))
            elif isinstance(block, ThinkingBlock | RedactedThinkingBlock):
                continue
            else:
                where = f"messages.{i}.content.{j}"
                raise InvalidParam(f"{where}.type", f"{where}: content block type {block.type!r} is not supported "
                                                    f"in a {m.role} message")
        messages.extend(results)
        if m.role == "assistant":
            messages.append(ChatMessage(role="assistant", content="".join(texts), tool_calls=calls or None))
        elif texts or not results:
            messages.append(ChatMessage(role="user", content="".join(texts)))
    return messages


def chat_request(request: CountTokensRequest) -> ChatCompletionRequest:
    tools = [ChatTool(type="function", function=FunctionDefinition(
        name=t.name, description=t.description, parameters=t.input_schema)) for t in request.tools or []]
    choice, parallel = None, None
    if request.tool_choice is not None:
        kind = request.tool_choice.type
        choice = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
        if kind == "tool":
            if not request.tool_choice.name:
                raise InvalidParam("tool_choice.name", "tool_choice of type tool needs a name")
            choice = NamedToolChoice(type="function", function=FunctionName(name=request.tool_choice.name))
        parallel = False if request.tool_choice.disable_parallel_tool_use else None
    fields = {}
    if isinstance(request, MessagesRequest):
        fields = dict(max_tokens=request.max_tokens, stop=request.stop_sequences or None,
                      temperature=request.temperature, top_p=request.top_p,
                      top_k=request.top_k if request.top_k else None)
    try:
        return ChatCompletionRequest(model=request.model, messages=to_chat_messages(request), tools=tools or None,
                                     tool_choice=choice, parallel_tool_calls=parallel, **fields)
    except ValidationError as e:
        first = e.errors()[0]
        raise InvalidParam(".".join(map(str, first.get("loc", ()))), f"invalid request: {first.get('msg')}") from None


def stop_reason(turn: Turn, request: MessagesRequest) -> tuple[str, str | None]:
    if turn.calls:
        return "tool_use", None
    if turn.status == "incomplete":
        return "max_tokens", None
    if isinstance(turn.stop_reason, str) and turn.stop_reason in (request.stop_sequences or []):
        return "stop_sequence", turn.stop_reason
    return "end_turn", None


def tool_use_block(tool_id: str, call: ParsedToolCall) -> dict:
    return {"type": "tool_use", "id": tool_id, "name": call.name, "input": json.loads(call.arguments)}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class AnthropicServingMessages:
    def __init__(self, chat: OpenAIServingChat):
        self.chat = chat

    async def count_tokens(self, request: CountTokensRequest) -> JSONResponse:
        prompt, *_ = await self.chat.prepare(chat_request(request))
        return JSONResponse({"input_tokens": len(prompt["prompt_token_ids"])})

    async def create(self, request: MessagesRequest, raw: Request):
        chat = chat_request(request)
        prompt, params, lora_request, _ = await self.chat.prepare(chat)
        message_id = new_id("msg")
        release = self.chat.admission.acquire(1, params.n, [len(prompt["prompt_token_ids"])])
        stream = self.chat.generate(prompt, params, message_id, lora_request, admitted=release)
        if request.stream:
            return EventStreamResponse(self._events(request, chat, message_id, prompt["prompt_token_ids"], stream,
                                                    release), release, framing=anthropic_events)
        try:
            final = await cancel_on_disconnect(raw, last_output(stream))
        finally:
            release()
        turn = split_turn(self.chat, chat, final)
        content = []
        if turn.reasoning:
            content.append({"type": "thinking", "thinking": turn.reasoning, "signature": ""})
        if turn.content:
            content.append({"type": "text", "text": turn.content})
        content += [tool_use_block(new_id("toolu"), call) for call in turn.calls]
        reason, sequence = stop_reason(turn, request)
        return JSONResponse(self._message(message_id, content, reason, sequence, turn.usage["input_tokens"],
                                          turn.usage["output_tokens"]))

    def _message(self, message_id: str, content: list, reason: str | None, sequence: str | None,
                 input_tokens: int, output_tokens: int) -> dict:
        return {"id": message_id, "type": "message", "role": "assistant", "model": self.chat.model_name,
                "content": content, "stop_reason": reason, "stop_sequence": sequence,
                "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}}

    async def _events(self, request: MessagesRequest, chat: ChatCompletionRequest, message_id: str,
                      prompt_token_ids: list[int], stream: AsyncIterator[RequestOutput], release) -> AsyncIterator[dict]:
        try:
            yield {"type": "message_start",
                   "message": self._message(message_id, [], None, None, len(prompt_token_ids), 0)}
            blocks = _Blocks()
            streamed = StreamedTurn(self.chat, chat, prompt_token_ids)
            async for kind, text in streamed.deltas(stream):
                for event in blocks.delta(_BLOCK_KINDS[kind], text, streamed.name):
                    yield event
            turn = split_turn(self.chat, chat, streamed.final)
            for event in blocks.delta("text", streamed.unsent_text(turn)):
                yield event
            for call in streamed.calls_to_send(turn):
                for event in blocks.delta("tool_use", call.arguments, call.name):
                    yield event
                for event in blocks.close():  # each call is its own block
                    yield event
            for event in blocks.close():
                yield event
            reason, sequence = stop_reason(turn, request)
            yield {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                   "usage": {"output_tokens": turn.usage["output_tokens"]}}
            yield {"type": "message_stop"}
        finally:
            release()


# a streamed turn's pieces -> the blocks they go in
_BLOCK_KINDS = {"reasoning": "thinking", "text": "text", "arguments": "tool_use"}


class _Blocks:
    """Content blocks as they grow: a delta of another kind closes the open block and starts one."""

    def __init__(self):
        self.index = -1
        self.open: str | None = None

    def close(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.index}]

    def delta(self, kind: str, text: str, tool_name: str | None = None) -> list[dict]:
        if not text:
            return []
        events = []
        if self.open != kind:
            events = self.close()
            self.index += 1
            self.open = kind
            block = {"thinking": {"type": "thinking", "thinking": "", "signature": ""},
                     "text": {"type": "text", "text": ""},
                     "tool_use": {"type": "tool_use", "id": new_id("toolu"), "name": tool_name, "input": {}}}[kind]
            events.append({"type": "content_block_start", "index": self.index, "content_block": block})
        delta = {"thinking": {"type": "thinking_delta", "thinking": text}, "text": {"type": "text_delta", "text": text},
                 "tool_use": {"type": "input_json_delta", "partial_json": text}}[kind]
        return events + [{"type": "content_block_delta", "index": self.index, "delta": delta}]


async def anthropic_events(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    """`event: TYPE` and `data: JSON` lines; an error after the stream started is an `error` event."""
    try:
        async for event in events:
            yield f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
    except APIError as e:
        body = json.loads(anthropic_error(e.status, e.message).body)
        yield f"event: error\ndata: {json.dumps(body)}\n\n"
