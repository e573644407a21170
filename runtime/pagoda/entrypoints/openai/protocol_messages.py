"""Anthropic's Messages API request (`POST /v1/messages`, `/v1/messages/count_tokens`), the subset Pagoda
serves, as the `anthropic` SDK sends it; and its error shape."""

from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, model_validator
from pydantic_core import PydanticCustomError

# status -> Anthropic's error type
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                529: "overloaded_error"}


ERROR_SCHEMA = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"},
    "error": {"type": "object", "required": ["type", "message"],
              "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}}


def openapi_extra(request_model: type[BaseModel], streams: bool) -> dict:
    """What the OpenAPI document says of an Anthropic route (its body is parsed in the handler, so that
    errors keep Anthropic's shape): the body's schema, and every status in Anthropic's error shape."""
    schema = request_model.model_json_schema()
    schema = _inline(schema, schema.pop("$defs", {}))
    error = {"content": {"application/json": {"schema": ERROR_SCHEMA}}}
    ok = {"application/json": {"schema": {"type": "object"}}}
    if streams:
        ok["text/event-stream"] = {"schema": {"type": "string"}}
    responses = {"200": {"description": "OK", "content": ok}}
    for status, phrase in ((400, "Bad Request"), (401, "Unauthorized"), (404, "Not Found"),
                           (429, "Too Many Requests"), (500, "Internal Server Error"), (503, "Service Unavailable")):
        responses[str(status)] = {"description": phrase, **error}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
            "responses": responses}


def _inline(schema, defs: dict):
    """The schema with its `$defs` references replaced by the definitions (these models nest, never recur).
    A `discriminator` goes: its mapping names the `$defs`, and each branch's `type` const says the same."""
    if isinstance(schema, list):
        return [_inline(s, defs) for s in schema]
    if not isinstance(schema, dict):
        return schema
    if "$ref" in schema:
        return _inline(defs[schema["$ref"].rsplit("/", 1)[-1]], defs)
    return {k: _inline(v, defs) for k, v in schema.items() if k != "discriminator"}


def anthropic_error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """`{"type": "error", "error": {"type", "message"}}`, Anthropic's shape."""
    body = {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}
    return JSONResponse(body, status_code=status, headers=headers)


class AnthropicModel(BaseModel):
    # unknown fields are refused by name, as Anthropic's API refuses them (`extra inputs are not permitted`)
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


# a `cache_control` breakpoint is a hint: the prefix cache caches every prompt anyway
CacheControl = dict[str, Any] | None


class TextBlock(AnthropicModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl = None
    citations: list[dict[str, Any]] | None = None


def _str_or_list(value) -> str:
    return "str" if isinstance(value, str) else "list"


# where a union picks its branch: left out of the field an error names (`messages.0.content`, not
# `messages.0.content.list`)
_BRANCH_TAGS = frozenset({"str", "list"})


def text_or_blocks(block):
    """A string, or a list of `block`s. The branch is chosen by the value's JSON type, so an error names
    the one that applies (`Input should be a valid list`), not both."""
    return Annotated[Annotated[str, Tag("str")] | Annotated[list[block], Tag("list")], Discriminator(_str_or_list)]


class ToolUseBlock(AnthropicModel):
    """An assistant's tool call (assistant messages only)."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl = None
    caller: dict[str, Any] | None = None  # the SDK sends back what it got: accepted, not used
    toolset_name: str | None = None


class ToolResultBlock(AnthropicModel):
    """A tool's answer (user messages only): its content a string or text blocks."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: text_or_blocks(TextBlock) | None = None
    is_error: bool | None = None
    cache_control: CacheControl = None
    toolset_name: str | None = None


class ThinkingBlock(AnthropicModel):
    type: Literal["thinking"]
    thinking: str
    signature: str


class RedactedThinkingBlock(AnthropicModel):
    type: Literal["redacted_thinking"]
    data: str


# a block of another type (image, document, ...) is refused naming its place and the types served
ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                         Field(discriminator="type")]


class Tool(AnthropicModel):
    """A client tool; a server tool (`web_search_...`, any other `type`) is refused by its type."""

    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl = None

    @model_validator(mode="before")
    @classmethod
    def _client_tools_only(cls, value):
        if isinstance(value, dict) and value.get("type") not in (None, "custom"):
            raise PydanticCustomError("server_tool", "server tool type {kind} is not supported: this server runs "
                                                     "client tools only", {"kind": repr(value.get("type"))})
        return value


class ToolChoice(AnthropicModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(AnthropicModel):
    user_id: str | None = None


class Message(AnthropicModel):
    role: Literal["user", "assistant"]
    content: text_or_blocks(ContentBlock)


class CountTokensRequest(AnthropicModel):
    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: text_or_blocks(TextBlock) | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None  # accepted: a thinking model thinks anyway (--reasoning-parser shows it)
    cache_control: CacheControl = None

    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system
        return "".join(block.text for block in self.system)


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    stream: bool = False
    metadata: Metadata | None = None
    service_tier: str | None = None


def validation_message(error: ValidationError) -> str:
    """The first error as Anthropic words it: `messages.0.content.1.tool_result.content.0: Input should be
    ...` (a block's type is part of its place, as in Anthropic's messages)."""
    first = error.errors(include_url=False)[0]
    where = ".".join(str(part) for part in first.get("loc", ()) if part not in _BRANCH_TAGS)
    return f"{where}: {first['msg']}" if where else first["msg"]
