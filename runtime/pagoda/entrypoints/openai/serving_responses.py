"""`POST /v1/responses`, `GET /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`: OpenAI's Responses API
over the chat machinery (template, tools, structured outputs, reasoning), as vLLM serves it.

A request becomes a chat request (instructions as the system message, the stored conversation of
`previous_response_id`, then the input items), runs through the engine once, and its output becomes output
items: `reasoning` (with --reasoning-parser), `message`, `function_call`. Streaming sends OpenAI's typed
events (`event:` and `data:` lines, a `sequence_number` on each, no `[DONE]`).

Stored responses (`store`, on by default as OpenAI's) live in memory, bounded: at most `max_entries`; when
full, the least recently used one (created, read, continued or cancelled the longest ago) is dropped.
"""

import asyncio
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

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
from pagoda.entrypoints.openai.protocol_responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ResponsesRequest,
    content_text,
)
from pagoda.entrypoints.openai.serving_base import EventStreamResponse, cancel_on_disconnect, last_output
from pagoda.entrypoints.openai.serving_chat import OpenAIServingChat
from pagoda.entrypoints.openai.tool_parsers import ParsedToolCall
from pagoda.errors import InvalidParam
from pagoda.http.errors import APIError, invalid_request

DEFAULT_MAX_STORED = 1024

# chat's names for the fields an error may name -> the Responses API's
_PARAM_NAMES = {"messages": "input", "response_format": "text.format", "max_completion_tokens": "max_output_tokens",
                "max_tokens": "max_output_tokens"}


@dataclass
class StoredResponse:
    response: dict  # the Response object, as served (status in_progress while it runs)
    conversation: list[ChatMessage]  # its input and output, without instructions: what a follow-up continues
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)


class ResponseStore:
    """Responses by id, at most max_entries; the least recently used one goes first."""

    def __init__(self, max_entries: int = DEFAULT_MAX_STORED):
        self.max_entries = max_entries
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self._items[response_id] = stored
        self._items.move_to_end(response_id)
        while len(self._items) > self.max_entries:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def __len__(self) -> int:
        return len(self._items)


def not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param=param, code="response_not_found")


class ItemIds:
    """The output items' ids, made once, so streamed events and the final object agree."""

    def __init__(self):
        self._ids: dict[str, str] = {}

    def get(self, key: str, prefix: str) -> str:
        if key not in self._ids:
            self._ids[key] = f"{prefix}_{uuid.uuid4().hex}"
        return self._ids[key]

    def reasoning(self) -> str:
        return self.get("reasoning", "rs")

    def message(self) -> str:
        return self.get("message", "msg")

    def call(self, i: int) -> tuple[str, str]:
        return self.get(f"fc{i}", "fc"), self.get(f"call{i}", "call")


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, max_stored: int = DEFAULT_MAX_STORED):
        self.chat = chat
        self.store = ResponseStore(max_stored)

    # --- requests ----------------------------------------------------------------------------------

    def retrieve(self, response_id: str) -> dict:
        stored = self.store.get(response_id)
        if stored is None:
            raise not_found(response_id)
        return stored.response

    def cancel(self, response_id: str) -> dict:
        """A running stored response stops (status cancelled); a finished one cannot be cancelled (vLLM's)."""
        stored = self.store.get(response_id)
        if stored is None:
            raise not_found(response_id)
        if stored.response["status"] not in ("queued", "in_progress"):
            raise invalid_request(f"Cannot cancel a response with status '{stored.response['status']}'.")
        stored.cancelled.set()
        stored.response = {**stored.response, "status": "cancelled"}
        return stored.response

    def chat_request(self, request: ResponsesRequest) -> tuple[ChatCompletionRequest, list[ChatMessage]]:
        """The chat request a Responses request makes (instructions, the stored conversation of
        previous_response_id, the input items), and the conversation a follow-up continues. /tokenize builds
        it here too: the stored history is on this server, so the precise router asks it for the tokens."""
        try:
            request.check_supported()
            tools = request.function_tools()
            history: list[ChatMessage] = []
            if request.previous_response_id is not None:
                previous = self.store.get(request.previous_response_id)
                if previous is None:
                    raise not_found(request.previous_response_id, "previous_response_id")
                history = list(previous.conversation)
            conversation = history + to_chat_messages(request)
            return self._chat_request(request, tools, conversation), conversation
        except InvalidParam as e:
            raise invalid_request(str(e), e.param) from None

    async def create(self, request: ResponsesRequest, raw: Request):
        chat_request, conversation = self.chat_request(request)
        try:
            prompt, params, lora_request, _ = await self.chat.prepare(chat_request)
        except APIError as e:
            e.param = _PARAM_NAMES.get(e.param, e.param)
            raise
        response_id = f"resp_{uuid.uuid4().hex}"
        ids = ItemIds()
        base = self._base_object(request, response_id)
        stored = StoredResponse(base, conversation)
        release = self.chat.admission.acquire(1, params.n, [len(prompt["prompt_token_ids"])])
        if request.store:
            self.store.put(response_id, stored)
        stream = until(self.chat.generate(prompt, params, response_id, lora_request, admitted=release),
                       stored.cancelled)
        finish = _Finisher(self, chat_request, stored, ids, prompt["prompt_token_ids"])
        if request.stream:
            return EventStreamResponse(self._events(base, finish, stream, release), release, framing=typed_events)
        try:
            final = await cancel_on_disconnect(raw, last_output(stream))
        except BaseException:
            finish.failed()
            raise
        finally:
            release()
        return JSONResponse(finish(final))

    # --- building ----------------------------------------------------------------------------------

    @staticmethod
    def _chat_request(request: ResponsesRequest, tools, messages: list[ChatMessage]) -> ChatCompletionRequest:
        choice = request.tool_choice
        if choice is not None and not isinstance(choice, str):
            choice = NamedToolChoice(type="function", function=FunctionName(name=choice.name))
        chat_tools = [ChatTool(type="function", function=FunctionDefinition(
            name=t.name, description=t.description, parameters=t.parameters, strict=t.strict)) for t in tools]
        if not messages:
            raise InvalidParam("input", "input is empty")
        try:
            return ChatCompletionRequest(
                model=request.model, messages=messages, max_completion_tokens=request.max_output_tokens,
                temperature=request.temperature, top_p=request.top_p, tools=chat_tools or None, tool_choice=choice,
                parallel_tool_calls=request.parallel_tool_calls, response_format=request.response_format())
        except ValidationError as e:
            first = e.errors()[0]
            raise InvalidParam("input", f"invalid request: {first.get('msg')}") from None

    def _base_object(self, request: ResponsesRequest, response_id: str) -> dict:
        """The Response object before any output: what response.created carries."""
        fmt = request.text.format if request.text and request.text.format else None
        return {
            "id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "background": False, "error": None, "incomplete_details": None, "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens, "model": self.chat.model_name, "output": [],
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": request.previous_response_id,
            "reasoning": request.reasoning.model_dump() if request.reasoning else None,
            "store": bool(request.store), "temperature": request.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": (request.tool_choice.model_dump() if request.tool_choice is not None
                            and not isinstance(request.tool_choice, str) else request.tool_choice or "auto"),
            "tools": request.tools or [], "top_p": request.top_p, "truncation": request.truncation or "disabled",
            "usage": None, "user": request.user, "metadata": request.metadata or {},
        }

    # --- streaming ---------------------------------------------------------------------------------

    async def _events(self, base: dict, finish: "_Finisher", stream: AsyncIterator[RequestOutput],
                      release) -> AsyncIterator[dict]:
        try:
            yield {"type": "response.created", "response": base}
            yield {"type": "response.in_progress", "response": base}
            emitter = _StreamedItems(finish.ids)
            streamed = StreamedTurn(self.chat, finish.chat_request, finish.prompt_token_ids)
            async for kind, text in streamed.deltas(stream):
                events = {"reasoning": emitter.reasoning, "text": emitter.text,
                          "arguments": lambda delta: emitter.arguments(streamed.name, delta)}[kind](text)
                for event in events:
                    yield event
            response = finish(streamed.final)
            turn = finish.last_turn
            for event in emitter.text(streamed.unsent_text(turn)) + emitter.close_open():
                yield event
            for i, call in enumerate(streamed.calls_to_send(turn)):
                for event in emitter.call(i, call):
                    yield event
            kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
                response["status"], "response.incomplete")
            yield {"type": kind, "response": response}
        except BaseException:
            finish.failed()
            raise
        finally:
            release()


class _Finisher:
    """Turns the final output into the Response object and stores it with its conversation."""

    def __init__(self, serving: OpenAIServingResponses, chat_request: ChatCompletionRequest,
                 stored: StoredResponse, ids: ItemIds, prompt_token_ids: list[int]):
        self.serving, self.chat_request, self.stored, self.ids = serving, chat_request, stored, ids
        self.prompt_token_ids = prompt_token_ids
        self.last_turn: Turn | None = None

    def __call__(self, final: RequestOutput | None) -> dict:
        cancelled = self.stored.cancelled.is_set()
        if final is None:  # cancelled before any output
            turn = Turn(None, None, [], "cancelled", None)
        else:
            turn = split_turn(self.serving.chat, self.chat_request, final, cancelled)
        self.last_turn = turn
        response = {**self.stored.response, "status": turn.status, "output": output_items(turn, self.ids),
                    "usage": turn.usage}
        if turn.status == "incomplete":
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        self.stored.response = response
        self.stored.conversation = self.stored.conversation + [assistant_message(turn, self.ids)]
        return response

    def failed(self) -> None:
        if self.stored.response["status"] == "in_progress":
            self.stored.response = {**self.stored.response, "status": "failed"}


class _StreamedItems:
    """The typed events of output items as they grow: opens an item when its first text comes, closes the
    one before it."""

    def __init__(self, ids: ItemIds):
        self.ids = ids
        self.index = -1  # output_index of the open item
        self.open: str | None = None  # reasoning | message | call
        self.texts = {"reasoning": "", "message": "", "call": ""}
        self.call_name: str | None = None

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        kind, text, index = self.open, self.texts[self.open], self.index
        self.open = None
        if kind == "reasoning":
            item_id = self.ids.reasoning()
            part = {"type": "reasoning_text", "text": text}
            return [{"type": "response.reasoning_text.done", "item_id": item_id, "output_index": index,
                     "content_index": 0, "text": text},
                    {"type": "response.content_part.done", "item_id": item_id, "output_index": index,
                     "content_index": 0, "part": part},
                    {"type": "response.output_item.done", "output_index": index,
                     "item": reasoning_item(item_id, text)}]
        if kind == "message":
            item_id = self.ids.message()
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            return [{"type": "response.output_text.done", "item_id": item_id, "output_index": index,
                     "content_index": 0, "text": text, "logprobs": []},
                    {"type": "response.content_part.done", "item_id": item_id, "output_index": index,
                     "content_index": 0, "part": part},
                    {"type": "response.output_item.done", "output_index": index, "item": message_item(item_id, text)}]
        item_id, call_id = self.ids.call(0)
        item = call_item(item_id, call_id, ParsedToolCall(self.call_name, text))
        return [{"type": "response.function_call_arguments.done", "item_id": item_id, "output_index": index,
                 "name": self.call_name, "arguments": text},
                {"type": "response.output_item.done", "output_index": index, "item": item}]

    def _open(self, kind: str) -> list[dict]:
        if self.open == kind:
            return []
        events = self._close()
        self.index += 1
        self.open = kind
        if kind == "reasoning":
            item_id = self.ids.reasoning()
            item = {**reasoning_item(item_id, ""), "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item_id = self.ids.message()
            item = {**message_item(item_id, ""), "content": [], "status": "in_progress"}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return events + [{"type": "response.output_item.added", "output_index": self.index, "item": item},
                         {"type": "response.content_part.added", "item_id": item_id, "output_index": self.index,
                          "content_index": 0, "part": part}]

    def reasoning(self, delta: str) -> list[dict]:
        if not delta:
            return []
        events = self._open("reasoning")
        self.texts["reasoning"] += delta
        return events + [{"type": "response.reasoning_text.delta", "item_id": self.ids.reasoning(),
                          "output_index": self.index, "content_index": 0, "delta": delta}]

    def text(self, delta: str) -> list[dict]:
        if not delta:
            return []
        events = self._open("message")
        self.texts["message"] += delta
        return events + [{"type": "response.output_text.delta", "item_id": self.ids.message(),
                          "output_index": self.index, "content_index": 0, "delta": delta, "logprobs": []}]

    def arguments(self, name: str, delta: str) -> list[dict]:
        """A named function's arguments, streamed as the model writes them (its output is the arguments)."""
        events = []
        if self.open != "call":
            events = self._close()
            self.index += 1
            self.open, self.call_name = "call", name
            item_id, call_id = self.ids.call(0)
            item = {**call_item(item_id, call_id, ParsedToolCall(name, "")), "status": "in_progress"}
            events.append({"type": "response.output_item.added", "output_index": self.index, "item": item})
        self.texts["call"] += delta
        return events + [{"type": "response.function_call_arguments.delta", "item_id": self.ids.call(0)[0],
                          "output_index": self.index, "delta": delta}]

    def close_open(self) -> list[dict]:
        return self._close()

    def call(self, i: int, call: ParsedToolCall) -> list[dict]:
        """A whole call (required, auto): added with empty arguments, the arguments in one delta, done."""
        self.index += 1
        item_id, call_id = self.ids.call(i)
        item = call_item(item_id, call_id, call)
        return [{"type": "response.output_item.added", "output_index": self.index,
                 "item": {**item, "arguments": "", "status": "in_progress"}},
                {"type": "response.function_call_arguments.delta", "item_id": item_id, "output_index": self.index,
                 "delta": call.arguments},
                {"type": "response.function_call_arguments.done", "item_id": item_id, "output_index": self.index,
                 "name": call.name, "arguments": call.arguments},
                {"type": "response.output_item.done", "output_index": self.index, "item": item}]


# --- items -----------------------------------------------------------------------------------------

def reasoning_item(item_id: str, text: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def message_item(item_id: str, text: str) -> dict:
    return {"type": "message", "id": item_id, "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(item_id: str, call_id: str, call: ParsedToolCall) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": call.name,
            "arguments": call.arguments, "status": "completed"}


def output_items(turn: Turn, ids: ItemIds) -> list[dict]:
    items = []
    if turn.reasoning:
        items.append(reasoning_item(ids.reasoning(), turn.reasoning))
    if turn.content:
        items.append(message_item(ids.message(), turn.content))
    for i, call in enumerate(turn.calls):
        items.append(call_item(*ids.call(i), call))
    return items


def assistant_message(turn: Turn, ids: ItemIds) -> ChatMessage:
    calls = [ToolCall(id=ids.call(i)[1], function=FunctionCall(name=call.name, arguments=call.arguments))
             for i, call in enumerate(turn.calls)]
    return ChatMessage(role="assistant", content=turn.content or "", tool_calls=calls or None)


def to_chat_messages(request: ResponsesRequest) -> list[ChatMessage]:
    """instructions and input items as chat messages: consecutive function_call items are one assistant turn
    (parallel calls); a function_call_output is a tool message."""
    messages: list[ChatMessage] = []
    if request.instructions:
        messages.append(ChatMessage(role="system", content=request.instructions))
    for i, item in enumerate(request.input_items()):
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append(ChatMessage(role=role, content=content_text(item.content, f"input[{i}]")))
        elif isinstance(item, FunctionCallItem):
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant" and (last.tool_calls or not last.text()):
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", content="", tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            output = item.output if isinstance(item.output, str) else content_text(item.output, f"input[{i}].output")
            messages.append(ChatMessage(role="tool", content=output, tool_call_id=item.call_id))
        # reasoning items: an earlier turn's thinking stays out of the prompt
    return messages


async def until(stream: AsyncIterator[RequestOutput], cancelled: asyncio.Event) -> AsyncIterator[RequestOutput]:
    """The engine's outputs until `cancelled` is set; then the stream is closed (the engine aborts it)."""
    waiter = asyncio.ensure_future(cancelled.wait())
    try:
        while True:
            step = asyncio.ensure_future(anext(stream))
            await asyncio.wait([step, waiter], return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                step.cancel()
                await asyncio.gather(step, return_exceptions=True)
                return
            try:
                out = step.result()
            except StopAsyncIteration:
                return
            yield out
    finally:
        waiter.cancel()
        await stream.aclose()


async def typed_events(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    """OpenAI's Responses stream: `event: TYPE` and `data: JSON` with a sequence_number from 0; an error
    after the stream started is an `error` event."""
    sequence = 0
    try:
        async for event in events:
            event["sequence_number"] = sequence
            sequence += 1
            yield f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
    except APIError as e:
        error = {"type": "error", "code": e.code or str(e.status), "message": e.message, "param": e.param,
                 "sequence_number": sequence}
        yield f"event: error\ndata: {json.dumps(error)}\n\n"
