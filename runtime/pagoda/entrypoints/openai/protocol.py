"""The OpenAI wire format (the subset Pagoda serves), with vLLM's sampling extras.

The field constraints here are the published OpenAPI document's, so they say what the server accepts;
SamplingParams checks the same ranges again for the Python API (and what a schema cannot say).
"""

import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from pagoda.entrypoints.openai.tool_choice import forced_tool_constraint
from pagoda.errors import InvalidParam
from pagoda.http.doors import TOKENIZE_ENDPOINTS
from pagoda.sampling_params import (
    INT64_MAX,
    INT64_MIN,
    MAX_LOGPROBS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    SamplingParams,
    StructuredOutputsParams,
)

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
NonNegativeInt64 = Annotated[int, Field(ge=0, le=INT64_MAX)]
PositiveInt64 = Annotated[int, Field(ge=1, le=INT64_MAX)]
NonEmptyStr = Annotated[str, Field(min_length=1)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
TokenIds = Annotated[list[NonNegativeInt64], Field(min_length=1)]
# A field Pagoda does not implement yet: validation takes any value (so check_supported can refuse it by
# name), the published schema allows only null (so clients and fuzzers see what is accepted).
Unsupported = Annotated[Any, WithJsonSchema({"type": "null"})]
MAX_PROMPTS = 4096  # prompts in one completions request (the admission limit usually binds first)


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIModel(BaseModel):
    # clients send bookkeeping fields we don't know (`user`, `metadata`, `store`): accept and ignore them,
    # as OpenAI and vLLM do; fields that would change the answer are listed in UNSUPPORTED instead
    # strict: `"echo": 0` or `"n": "2"` is a type error, as the schema says, not silently coerced
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


# --- shared request fields -----------------------------------------------------------------------

class StreamOptions(OpenAIModel):
    include_usage: bool = False


class JsonSchemaFormat(OpenAIModel):
    name: Annotated[str, Field(max_length=64)] = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(OpenAIModel):
    """vLLM's `structured_outputs` extra: exactly one constraint."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingFields(OpenAIModel):
    """Fields shared by completions and chat, including vLLM's extras."""

    model: str | None = None
    n: PositiveInt64 = 1
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: Int64 | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = 0.0
    user: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # vLLM extras
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    ignore_eos: bool = False
    priority: int = 0  # --scheduling-policy priority: lower runs first (vLLM's)
    min_tokens: NonNegativeInt64 = 0
    stop_token_ids: list[NonNegativeInt64] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_* extras (one of them)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # token id (as a string, OpenAI's shape) -> added to its logit; ids are checked against the vocabulary
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    # vLLM extras: score the prompt; restrict or ban tokens
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    allowed_token_ids: list[NonNegativeInt64] | None = None
    bad_words: list[str] | None = None
    # P/D disaggregation (vLLM's): checked by SamplingParams, a malformed field is a 400 naming it
    kv_transfer_params: Any = None
    # vLLM's: a streamed answer's tokens per chunk (the server's --stream-interval or this, the larger)
    stream_interval: PositiveInt64 | None = None
    # Fields OpenAI or vLLM define that Pagoda does not implement yet. A value that asks for something
    # (anything but null, empty or the neutral value) is refused with a 400 naming the field: a client
    # must never get an answer that silently ignored what it asked for.
    best_of: Unsupported = None
    logits_processors: Unsupported = None
    use_beam_search: Unsupported = None

    UNSUPPORTED: ClassVar[tuple[str, ...]] = ("best_of", "logits_processors", "use_beam_search")

    def check_supported(self) -> None:
        """Raise InvalidParam for the first field that asks for something Pagoda cannot do yet."""
        for name in self.UNSUPPORTED:
            value = getattr(self, name)
            if value is None or value is False or value == {} or value == [] or self._neutral(name, value):
                continue
            raise InvalidParam(name, f"{name} is not supported by this server")

    def _neutral(self, name: str, value) -> bool:
        return name == "best_of" and value == self.n

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one output constraint the request asks for (None: free text); InvalidParam naming the field
        if it asks for two, or for one that is malformed."""
        asked = []
        if self.response_format is not None and self.response_format.type != "text":
            fmt = self.response_format
            if fmt.type == "json_object":
                asked.append(StructuredOutputsParams(json_object=True, field="response_format"))
            elif fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise InvalidParam("response_format", "response_format of type json_schema needs "
                                                      "json_schema.schema")
            else:
                asked.append(StructuredOutputsParams(json=fmt.json_schema.schema_, field="response_format"))
        if self.structured_outputs is not None:
            so = self.structured_outputs
            asked.append(StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice,
                                                 grammar=so.grammar, json_object=so.json_object,
                                                 field="structured_outputs"))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                asked.append(StructuredOutputsParams(**{kind: value}, field=name))
        if len(asked) > 1:
            raise InvalidParam(asked[1].field, f"{asked[0].field} and {asked[1].field} both constrain the "
                                               "output: send one")
        return asked[0] if asked else None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, defaults: dict | None = None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """Raises ValueError naming the field when a value is out of range. `defaults`: the server's default
        sampling values (the model's generation config) for the fields the request leaves unset.
        `prompt_logprobs`: at least this many prompt alternatives (completions' echo)."""
        self.check_supported()
        defaults = defaults or {}

        def value(name: str, neutral):
            own = getattr(self, name)
            return own if own is not None else defaults.get(name, neutral)

        if self.prompt_logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, self.prompt_logprobs)
        return SamplingParams(
            n=self.n,
            temperature=value("temperature", 1.0),
            top_p=value("top_p", 1.0),
            top_k=value("top_k", -1),
            min_p=value("min_p", 0.0),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=value("repetition_penalty", 1.0),
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self.structured_outputs_params(),
            prompt_logprobs=prompt_logprobs,
            logit_bias=self._logit_bias(),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            kv_transfer_params=self.kv_transfer_params,
            stream_interval=self.stream_interval,
        )

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                token = -1
            if token < 0:
                raise InvalidParam("logit_bias", f"logit_bias keys must be token ids (non-negative integers as "
                                                 f"strings), got {key!r}")
            bias[token] = value
        return bias

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class PromptTokensDetails(OpenAIModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class CompletionTokensDetails(OpenAIModel):
    reasoning_tokens: int = 0  # output tokens inside the thinking (with --reasoning-parser)


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


# --- completions ---------------------------------------------------------------------------------

# OpenAI's four shapes of completions' `prompt` and embeddings' `input`: text, texts, token ids, lists of them
PromptInput = (NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1, max_length=MAX_PROMPTS)] | TokenIds
               | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)])


class CompletionRequest(SamplingFields):
    prompt: PromptInput
    # null too means OpenAI's default, 16; 0 only with echo (score the prompt, generate nothing)
    max_tokens: NonNegativeInt64 | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool | None = False
    suffix: str | None = None  # fill-in-the-middle, for tokenizers with FIM tokens


class CompletionLogprobs(OpenAIModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(OpenAIModel):
    """vLLM's prompt_logprobs entry: one candidate token's logprob, its rank and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: null for the first prompt token, then token id -> PromptLogprob per token
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    # P/D (vLLM's): a prefill's answer to do_remote_decode, what the decode request sends (the last chunk's)
    kv_transfer_params: dict[str, Any] | None = None


# --- chat ----------------------------------------------------------------------------------------

class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class FunctionCall(OpenAIModel):
    name: str
    arguments: str  # a JSON object's text


class ToolCall(OpenAIModel):
    id: str = Field(default_factory=lambda: random_id("call"))
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(OpenAIModel):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    function: FunctionName


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    # an assistant's earlier thinking sent back (vLLM's names); templates read it as `thinking` (gpt-oss's)
    reasoning: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: PositiveInt64 | None = None
    max_completion_tokens: PositiveInt64 | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None  # refused unless the server runs with --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None  # OpenAI's; the template's `reasoning_effort`
    include_reasoning: bool = True  # vLLM's extra: false leaves the thinking out (it still leaves `content`)
    tools: Annotated[list[ChatTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call (enforced for "required")
    # not implemented yet: refused when they ask for something (see SamplingFields.check_supported)
    functions: Unsupported = None
    function_call: Unsupported = None
    # the output continues the last message (an assistant prefill); needs add_generation_prompt false
    continue_final_message: bool = False
    echo: Unsupported = None
    documents: Unsupported = None

    UNSUPPORTED: ClassVar[tuple[str, ...]] = SamplingFields.UNSUPPORTED + (
        "functions", "function_call", "echo", "documents")

    @property
    def tool_mode(self) -> tuple[str, str | None]:
        """(none | auto | required | named, the named function); OpenAI's default is auto with tools."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named", self.tool_choice.function.name
        return self.tool_choice or ("auto" if self.tools else "none"), None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        # a forced tool choice is a constraint too: it cannot be combined with another one
        tools = [(t.function.name, t.function.parameters) for t in self.tools or []]
        forced = forced_tool_constraint(tools, *self.tool_mode, self.parallel_tool_calls)
        other = super().structured_outputs_params()
        if forced is not None and other is not None:
            raise InvalidParam(other.field, f"{other.field} cannot be combined with a forced tool_choice")
        return forced or other

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIModel):
    content: list[TokenLogprob] | None = None


class ResponseMessage(OpenAIModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None
    # --reasoning-parser: the thinking; vLLM sends it under both names (reasoning_content before v0.11)
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatChoice(OpenAIModel):
    index: int
    message: ResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None
    kv_transfer_params: dict[str, Any] | None = None  # P/D (vLLM's): as CompletionResponse's


class DeltaFunctionCall(OpenAIModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(OpenAIModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatStreamChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None  # on the first chunk after the prompt was scored
    kv_transfer_params: dict[str, Any] | None = None  # P/D: on the chunk that finishes the choice


# --- models, tokenizer, version ------------------------------------------------------------------

class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagoda"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(OpenAIModel):
    """vLLM's shapes: `prompt`, or `messages` (with the chat request's template fields); or a door's own body
    as `request`, with the door's path as `endpoint` (what the precise router sends)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[ChatTool] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    endpoint: Literal[TOKENIZE_ENDPOINTS] | None = None
    request: dict[str, Any] | None = None


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[NonNegativeInt64]


class DetokenizeResponse(OpenAIModel):
    prompt: str
