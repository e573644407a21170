"""The OpenAI Responses API's request (`POST /v1/responses`), the subset Pagoda serves, as the `openai` SDK's
`client.responses.create` sends it. Fields that would change the answer and are not implemented are refused
by name (400), never ignored; bookkeeping fields (`metadata`, `user`, `include`, ...) are accepted."""

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from pagoda.entrypoints.openai.protocol import (
    JsonSchemaFormat,
    OpenAIModel,
    PositiveInt64,
    ResponseFormat,
    Unsupported,
)
from pagoda.errors import InvalidParam


class MessageItem(OpenAIModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(OpenAIModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(OpenAIModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[dict[str, Any]]
    id: str | None = None
    status: str | None = None


class ReasoningItem(OpenAIModel):
    """An earlier turn's reasoning, sent back by agents: accepted and left out of the prompt (chat
    templates drop earlier thinking too)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: str | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class FunctionTool(OpenAIModel):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(OpenAIModel):
    type: Literal["function"]
    name: str


class TextFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(max_length=64)] = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(OpenAIModel):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(OpenAIModel):
    effort: str | None = None  # accepted: the thinking is the model's own (--reasoning-parser shows it)
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(OpenAIModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: PositiveInt64 | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    # dicts first: a tool of another type (web_search, ...) is refused by name, not as a validation error
    tools: Annotated[list[dict[str, Any]], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None
    service_tier: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    # not implemented: refused when they ask for something
    background: Unsupported = None
    top_logprobs: Unsupported = None
    max_tool_calls: Unsupported = None
    prompt: Unsupported = None
    conversation: Unsupported = None

    UNSUPPORTED: ClassVar[tuple[str, ...]] = ("background", "top_logprobs", "max_tool_calls", "prompt",
                                              "conversation")

    def check_supported(self) -> None:
        for name in self.UNSUPPORTED:
            value = getattr(self, name)
            if value is None or value is False or value == 0 or value == {} or value == []:
                continue
            raise InvalidParam(name, f"{name} is not supported by this server")
        if self.truncation == "auto":
            raise InvalidParam("truncation", 'truncation "auto" is not supported: prompts longer than the '
                                             "context are refused")

    def function_tools(self) -> list[FunctionTool]:
        """tools, each a function; anything else (web_search, file_search, mcp, ...) refused naming it."""
        tools = []
        for i, tool in enumerate(self.tools or []):
            kind = tool.get("type")
            if kind != "function":
                raise InvalidParam(f"tools[{i}].type", f"tool type {kind!r} is not supported: this server runs "
                                                       "function tools only")
            try:
                tools.append(FunctionTool.model_validate(tool))
            except ValueError as e:
                raise InvalidParam(f"tools[{i}]", f"invalid function tool: {_first_error(e)}") from None
        return tools

    def input_items(self) -> list[InputItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        items = []
        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            model = {"message": MessageItem, "function_call": FunctionCallItem,
                     "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}.get(kind)
            if model is None:
                raise InvalidParam(f"input[{i}].type", f"input item type {kind!r} is not supported")
            try:
                items.append(model.model_validate(item))
            except ValueError as e:
                raise InvalidParam(f"input[{i}]", f"invalid {kind} item: {_first_error(e)}") from None
        return items

    def response_format(self) -> ResponseFormat | None:
        """text.format as chat's response_format."""
        fmt = self.text.format if self.text else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return ResponseFormat(type="json_object")
        if fmt.schema_ is None:
            raise InvalidParam("text.format.schema", "text.format of type json_schema needs a schema")
        return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
            name=fmt.name, description=fmt.description, schema=fmt.schema_, strict=fmt.strict))


def _first_error(e: ValueError) -> str:
    errors = getattr(e, "errors", None)
    if callable(errors) and errors():
        first = errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        return f"{where}: {first.get('msg')}" if where else str(first.get("msg"))
    return str(e)


def content_text(content: str | list[dict[str, Any]], param: str) -> str:
    """A message's content (a string, or input_text / output_text parts) as text; other parts refused."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            raise InvalidParam(f"{param}.content[{j}].type", f"content part type {kind!r} is not supported "
                                                             "(text only)")
    return "".join(texts)


__all__ = ["FunctionCallItem", "FunctionCallOutputItem", "FunctionTool", "InputItem",
           "MessageItem", "ReasoningItem", "ResponsesRequest", "content_text"]
