"""Anthropic's Messages API request (`POST /v1/messages`, `/v1/messages/count_tokens`), the subset Pagoda
serves, as the `anthropic` SDK sends it; and its error shape."""

from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from pagoda.errors import InvalidParam

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
    """The schema with its `$defs` references replaced by the definitions (these models nest, never recur)."""
    if isinstance(schema, list):
        return [_inline(s, defs) for s in schema]
    if not isinstance(schema, dict):
        return schema
    if "$ref" in schema:
        return _inline(defs[schema["$ref"].rsplit("/", 1)[-1]], defs)
    return {k: _inline(v, defs) for k, v in schema.items()}


def anthropic_error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """`{"type": "error", "error": {"type", "message"}}`, Anthropic's shape."""
    body = {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}
    return JSONResponse(body, status_code=status, headers=headers)


class AnthropicModel(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


class Tool(AnthropicModel):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None  # "custom" or absent: a client tool; server tools (web_search_...) are refused


class ToolChoice(AnthropicModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Message(AnthropicModel):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class CountTokensRequest(AnthropicModel):
    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None

    def client_tools(self) -> list[Tool]:
        tools = []
        for i, tool in enumerate(self.tools or []):
            if tool.get("type") not in (None, "custom"):
                raise InvalidParam(f"tools.{i}.type", f"tools.{i}: server tool type {tool.get('type')!r} is not "
                                                      "supported: this server runs client tools only")
            try:
                tools.append(Tool.model_validate(tool))
            except ValueError as e:
                raise InvalidParam(f"tools.{i}", f"tools.{i}: {e}") from None
        return tools

    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system
        return "".join(block_text(block, f"system.{i}") for i, block in enumerate(self.system))


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None  # accepted: a thinking model thinks anyway (--reasoning-parser shows it)
    service_tier: str | None = None


def block_text(block, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        raise InvalidParam(f"{where}.type", f"{where}: content block type {block.get('type')!r} is not supported "
                                            "here (text only)")
    return block["text"]
