"""`POST /tokenize`: a request's prompt tokens, rendered by the code its door runs before the engine does.

vLLM's shapes: `{"prompt"}` through the tokenizer, `{"messages"}` (with `tools`, `chat_template_kwargs`,
`add_generation_prompt`, `continue_final_message`) through the chat template. And a door's own body:
`{"endpoint": "/v1/responses", "request": BODY}` (or /v1/chat/completions, /v1/messages) becomes its chat
request by the door's own code (Responses: instructions, items and the conversation stored under
`previous_response_id`, which lives on this server; Messages: the system prompt, blocks and tools), then
`OpenAIServingChat.render` makes the prompt, as the door's `prepare` does. The precise router sends these,
so its block hashes are the engine's whatever the door."""

import asyncio
import json

from pydantic import BaseModel, ValidationError

from pagoda.entrypoints.openai.protocol import ChatCompletionRequest, TokenizeRequest
from pagoda.entrypoints.openai.protocol_messages import MessagesRequest
from pagoda.entrypoints.openai.protocol_responses import ResponsesRequest
from pagoda.entrypoints.openai.serving_chat import OpenAIServingChat
from pagoda.entrypoints.openai.serving_messages import chat_request as messages_chat_request
from pagoda.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagoda.errors import InvalidParam
from pagoda.http.errors import APIError, invalid_request


class OpenAIServingTokenize:
    def __init__(self, chat: OpenAIServingChat, responses: OpenAIServingResponses):
        self.chat = chat
        self.responses = responses

    async def tokenize(self, body: TokenizeRequest) -> list[int]:
        self.chat.check_model(body.model)
        given = [name for name in ("prompt", "messages", "endpoint") if getattr(body, name) is not None]
        if len(given) != 1:
            raise invalid_request("send exactly one of prompt, messages and endpoint (with request)",
                                  given[1] if len(given) > 1 else "prompt")
        if (body.request is None) != (body.endpoint is None):
            raise invalid_request("endpoint and request go together: the door's path and its body", "request")
        if body.prompt is not None:
            return await asyncio.to_thread(self.chat.tokenizer.encode, body.prompt,
                                           add_special_tokens=body.add_special_tokens)
        if body.messages is not None:
            fields = ("model", "messages", "tools", "chat_template", "chat_template_kwargs", "add_generation_prompt",
                      "continue_final_message")
            try:
                request = ChatCompletionRequest(**{name: getattr(body, name) for name in fields})
            except ValidationError as e:
                first = e.errors()[0]
                where = ".".join(str(p) for p in first.get("loc", ())) or None
                raise invalid_request(f"invalid request: {first.get('msg')}", where) from None
        else:
            request = self.door_chat_request(body.endpoint, body.request)
        try:
            return (await self.chat.render(request))[1]
        except APIError as e:
            e.param = f"request.{e.param}" if body.endpoint and e.param else e.param
            raise

    def door_chat_request(self, endpoint: str, body: dict) -> ChatCompletionRequest:
        """The chat request the door at `endpoint` makes of `body`, by the door's own code."""
        if endpoint == "/v1/responses":
            return self.responses.chat_request(parse(ResponsesRequest, body))[0]
        if endpoint == "/v1/messages":
            try:
                return messages_chat_request(parse(MessagesRequest, body, from_json=True))
            except InvalidParam as e:
                raise invalid_request(str(e), f"request.{e.param}") from None
        return parse(ChatCompletionRequest, body)


def parse(model: type[BaseModel], body: dict, from_json: bool = False) -> BaseModel:
    """The door's body read as the door reads it (FastAPI's doors validate the decoded body, the Messages
    door its bytes); a bad one is a 400 naming the field under `request`."""
    try:
        return model.model_validate_json(json.dumps(body)) if from_json else model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(["request", *(str(p) for p in first.get("loc", ()))])
        raise invalid_request(f"invalid value for {where!r}: {first.get('msg')}", where) from None
