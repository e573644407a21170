"""`POST /v1/chat/completions`: messages through the model's chat template, n choices, streamed or not."""

import asyncio
import dataclasses
import functools
import inspect
import json
import time
from collections.abc import AsyncIterator

import jinja2
import jinja2.meta
from fastapi import Request

from pagoda.engine.outputs import Logprob, RequestOutput
from pagoda.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatStreamChoice,
    ChatTool,
    CompletionTokensDetails,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ResponseMessage,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    UsageInfo,
    random_id,
)
from pagoda.entrypoints.openai.reasoning_parsers import ReasoningParser
from pagoda.entrypoints.openai.reasoning_parsers import reasoning_parser as reasoning_parser_for
from pagoda.entrypoints.openai.serving_base import (
    EventStreamResponse,
    OpenAIServing,
    cancel_on_disconnect,
    last_output,
    sse,
    usage_of,
)
from pagoda.entrypoints.openai.serving_completion import finish_reason, prompt_logprobs_field
from pagoda.entrypoints.openai.tool_choice import output_tool_calls
from pagoda.entrypoints.openai.tool_parsers import TOOL_PARSERS, ParsedToolCall
from pagoda.http.errors import APIError, invalid_request
from pagoda.lora.request import LoRARequest
from pagoda.sampling_params import SamplingParams


def render_chat(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool = True,
                extra: dict | None = None, chat_template: str | None = None,
                tools: list[ChatTool] | None = None, continue_final_message: bool = False) -> tuple[str, list[int]]:
    """Blocking (the template engine and the tokenizer): call it in a worker thread. `extra` is filtered
    to the variables the template reads; `chat_template` must already be allowed by the caller.
    continue_final_message: the prompt ends inside the last message (an assistant prefill), unclosed."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise invalid_request("this model has no chat template: start the server with --chat-template, or use "
                              "/v1/completions", "messages")
    conversation = [_template_message(m) for m in messages]
    extra = template_kwargs(tokenizer, template, extra) if extra else {}
    if tools:
        extra["tools"] = [t.model_dump(exclude_none=True) for t in tools]
    try:
        text = tokenizer.apply_chat_template(conversation, chat_template=chat_template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, **extra)
    except Exception as e:  # jinja raises its own errors (e.g. raise_exception for an unsupported role order)
        raise invalid_request(f"the chat template rejected the messages: {e}", "messages") from None
    # the template already wrote the special tokens (BOS included): don't add them twice
    return text, tokenizer.encode(text, add_special_tokens=False)


def _template_message(m: ChatMessage) -> dict:
    message = {"role": m.role, "content": m.text()}
    if m.name is not None:
        message["name"] = m.name
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    reasoning = m.reasoning if m.reasoning is not None else m.reasoning_content
    if reasoning is not None:
        message["thinking"] = reasoning  # gpt-oss's template keeps it before a pending tool call
    if m.tool_calls:
        # templates (Qwen's, Llama's) write the arguments with `tojson`: they expect an object, not its text
        message["tool_calls"] = [{"id": c.id, "type": c.type,
                                  "function": {"name": c.function.name, "arguments": _arguments(c.function)}}
                                 for c in m.tool_calls]
    return message


def _arguments(function: FunctionCall):
    try:
        return json.loads(function.arguments)
    except json.JSONDecodeError:
        return function.arguments


def template_kwargs(tokenizer, template, kwargs: dict) -> dict:
    """chat_template_kwargs reduced to the variables the template reads, never apply_chat_template's own
    parameters (a client must not pick the template, or tokenization, through them)."""
    if isinstance(template, dict):  # several named templates: the default one is used
        template = template.get("default") or next(iter(template.values()), "")
    allowed = _template_variables(template) - _reserved_names(type(tokenizer))
    return {k: v for k, v in kwargs.items() if k in allowed}


@functools.lru_cache(maxsize=32)
def _template_variables(template: str) -> frozenset[str]:
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template)))
    except jinja2.TemplateSyntaxError as e:
        raise invalid_request(f"the chat template does not parse: {e}", "chat_template") from None


@functools.lru_cache(maxsize=8)
def _reserved_names(tokenizer_class) -> frozenset[str]:
    own = set(inspect.signature(tokenizer_class.apply_chat_template).parameters) - {"self", "kwargs"}
    return frozenset(own | {"messages", "conversation", "chat_template", "tools", "documents",
                            "add_generation_prompt", "continue_final_message"})


def _top(lp: Logprob) -> TopLogprob:
    token = lp.decoded_token or ""
    return TopLogprob(token=token, logprob=lp.logprob, bytes=list(token.encode()))


def chat_logprobs(entries: list[dict[int, Logprob]], token_ids: list[int], top_k: int) -> ChatLogprobs:
    content = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        chosen = _top(entry[token_id])
        alternatives = sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= top_k),
                              key=lambda lp: lp.rank)
        content.append(TokenLogprob(**chosen.model_dump(), top_logprobs=[_top(lp) for lp in alternatives]))
    return ChatLogprobs(content=content)


class OpenAIServingChat(OpenAIServing):
    def __init__(self, *args, trust_request_chat_template: bool = False, tool_call_parser: str | None = None,
                 chat_template: str | None = None, reasoning_parser: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.reasoning_parser = reasoning_parser_for(reasoning_parser, self.tokenizer) if reasoning_parser else None
        self.trust_request_chat_template = trust_request_chat_template
        self.chat_template = chat_template  # --chat-template: used instead of the model's
        self.tool_parser = TOOL_PARSERS[tool_call_parser]() if tool_call_parser else None

    async def create(self, request: ChatCompletionRequest, raw: Request):
        prompt, params, lora_request, top_k = await self.prepare(request)
        request_id = self.request_id(raw, "chatcmpl")
        release = self.admission.acquire(1, params.n, [len(prompt["prompt_token_ids"])])
        stream = self.generate(prompt, params, request_id, lora_request, request.priority, release)
        if request.stream:
            return EventStreamResponse(self._stream(request, request_id, stream, top_k, release,
                                                    prompt["prompt_token_ids"]), release)
        try:
            final = await cancel_on_disconnect(raw, last_output(stream))
        finally:
            release()
        return self._response(request, request_id, final, top_k)

    async def prepare(self, request: ChatCompletionRequest) -> tuple[dict, SamplingParams, LoRARequest | None,
                                                                       int | None]:
        """A chat request checked and rendered: (the engine's prompt, sampling params, adapter, top
        logprobs). Errors are APIErrors naming the field, raised before anything runs (the Responses and
        Messages APIs render through here too)."""
        lora_request = self.check_model(request.model)
        if request.top_logprobs is not None and not request.logprobs:
            raise invalid_request("top_logprobs needs logprobs set to true", "top_logprobs")
        top_k = (request.top_logprobs or 0) if request.logprobs else None
        if request.tool_mode[0] == "auto" and self.tool_parser is None:
            raise invalid_request('tool_choice "auto" needs a server started with --enable-auto-tool-choice and '
                                  '--tool-call-parser; send tool_choice "required" or a named function',
                                  "tool_choice")
        try:
            params = self.make_params(request, request.requested_max_tokens, top_k)
        except APIError as e:  # the engine's names are the completions API's: say what chat calls them
            renamed = {"logprobs": "top_logprobs"}
            if request.max_completion_tokens is not None:
                renamed["max_tokens"] = "max_completion_tokens"
            e.param = renamed.get(e.param, e.param)
            raise
        text, token_ids = await self.render(request)
        default_max = self.sampling_defaults.get("max_tokens")
        if request.requested_max_tokens is None and default_max is not None:
            # the model's max_new_tokens, as far as the context leaves room (vLLM's)
            params = dataclasses.replace(params, max_tokens=max(1, min(default_max, self.max_model_len - len(token_ids))))
        prompt = await self.validate_prompt({"prompt": text, "prompt_token_ids": token_ids}, params)
        params = grammar_after_reasoning(params, self.reasoning_parser, prompt["prompt_token_ids"],
                                         request.chat_template_kwargs)
        if self.reasoning_parser is not None:  # gpt-oss's channel markers are special tokens the split reads
            params = self.reasoning_parser.output_params(params)
        return prompt, params, lora_request, top_k

    async def render(self, request: ChatCompletionRequest) -> tuple[str, list[int]]:
        """The prompt a chat request makes, as text and token ids: what prepare hands the engine, and what
        /tokenize answers for every door (the precise router hashes these, so they must be the engine's)."""
        if request.chat_template is not None and not self.trust_request_chat_template:
            raise invalid_request("a chat_template in the request is refused: the server runs the model's own "
                                  "template unless started with --trust-request-chat-template", "chat_template")
        if request.continue_final_message and request.add_generation_prompt:
            raise invalid_request("continue_final_message and add_generation_prompt cannot both be true: send "
                                  "add_generation_prompt false to continue the last message", "continue_final_message")
        kwargs = request.chat_template_kwargs
        if request.reasoning_effort is not None:  # as vLLM: a template variable (gpt-oss's "Reasoning: low")
            kwargs = {"reasoning_effort": request.reasoning_effort, **(kwargs or {})}
        return await asyncio.to_thread(render_chat, self.tokenizer, request.messages, request.add_generation_prompt,
                                       kwargs, request.chat_template or self.chat_template,
                                       request.tools if request.tool_mode[0] != "none" else None,
                                       request.continue_final_message)

    def _response(self, request: ChatCompletionRequest, request_id: str, final: RequestOutput,
                  top_k: int | None) -> ChatCompletionResponse:
        choices = []
        for c in final.outputs:
            logprobs = None
            if top_k is not None and c.logprobs is not None:
                logprobs = chat_logprobs(c.logprobs, c.token_ids, top_k)
            reason = finish_reason(c)
            reasoning, text = None, c.text
            if self.reasoning_parser is not None:
                reasoning, text = self.reasoning_parser.split(c.text, final.prompt_token_ids,
                                                              request.chat_template_kwargs)
                text = text or ""
            content, calls = (output_tool_calls(text, *request.tool_mode, self.tool_parser) if reason == "stop"
                              else (text, []))
            if reasoning is not None and not content:
                content = None  # vLLM's: an answer that is all thinking has null content
            message = ResponseMessage(content=content, tool_calls=[_tool_call(call) for call in calls] or None,
                                      **_reasoning_fields(request, reasoning))
            choices.append(ChatChoice(index=c.index, message=message, logprobs=logprobs,
                                      finish_reason="tool_calls" if calls else reason, stop_reason=c.stop_reason))
        return ChatCompletionResponse(id=request_id, model=self.response_model(request.model), choices=choices,
                                      usage=self._usage(request, final),
                                      prompt_logprobs=_prompt_logprobs(request, final),
                                      kv_transfer_params=final.kv_transfer_params)

    def _usage(self, request: ChatCompletionRequest, final: RequestOutput) -> UsageInfo:
        usage = usage_of([final])
        if self.reasoning_parser is not None:
            usage.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=sum(
                reasoning_tokens(self.reasoning_parser, c, final.prompt_token_ids, request.chat_template_kwargs)
                for c in final.outputs))
        return usage

    async def _stream(self, request: ChatCompletionRequest, request_id: str, stream: AsyncIterator[RequestOutput],
                      top_k: int | None, release, prompt_token_ids: list[int]) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None,
                  kv_transfer_params: dict | None = None) -> str:
            return sse(ChatCompletionChunk(id=request_id, created=created, model=self.response_model(request.model),
                                           choices=choices, usage=usage, kv_transfer_params=kv_transfer_params))

        try:
            # the role first, before any token: clients show the assistant turn as soon as it exists
            yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                         for i in range(request.n)])
            sent_text = [0] * request.n
            sent_tokens = [0] * request.n
            finished = [False] * request.n
            mode, name = request.tool_mode
            call_ids: dict[int, str] = {}  # choice -> its call's id (a named function: streamed as it grows)
            splitters = ([self.reasoning_parser.splitter(prompt_token_ids, request.chat_template_kwargs)
                          for _ in range(request.n)] if self.reasoning_parser is not None else None)
            final = None
            scored_sent = False
            async for out in stream:
                final = out
                if not scored_sent and request.prompt_logprobs is not None and out.prompt_logprobs is not None:
                    scored_sent = True
                    yield sse(ChatCompletionChunk(id=request_id, created=created, model=self.response_model(request.model), choices=[],
                                                  prompt_logprobs=_prompt_logprobs(request, out)))
                choices = []
                for c in out.outputs:
                    if finished[c.index]:
                        continue
                    if splitters is not None:  # the thinking goes out as it comes; the rest sees the content
                        reasoning = splitters[c.index].feed(c.text, final=c.finish_reason is not None)
                        if reasoning and request.include_reasoning:
                            yield chunk([ChatStreamChoice(index=c.index, delta=DeltaMessage(
                                reasoning=reasoning, reasoning_content=reasoning))])
                        c = dataclasses.replace(c, text=splitters[c.index].content)
                    already = sent_text[c.index]
                    text = c.text[already:]
                    reason = finish_reason(c)
                    if mode in ("required", "auto") and reason is None:
                        # the calls are known when the output is whole; "auto" streams the text before any
                        # call could start (its logprobs go with the last chunk)
                        safe = self.tool_parser.content_prefix(c.text) if mode == "auto" else 0
                        if safe > already:
                            sent_text[c.index] = safe
                            yield chunk([ChatStreamChoice(index=c.index,
                                                          delta=DeltaMessage(content=c.text[already:safe]))])
                        continue
                    # a token whose text is held back (half a character, a possible stop string) still gets its
                    # chunk, empty, as vLLM's: a client counts tokens and their pace by chunks (a reasoning split
                    # holds a tag back whole instead)
                    new_token = mode == "none" and splitters is None and len(c.token_ids) > sent_tokens[c.index]
                    if not text and reason is None and not new_token:
                        continue  # nothing to show yet: its tokens' logprobs go with the next chunk
                    start = sent_tokens[c.index]
                    logprobs = None
                    if top_k is not None and c.logprobs is not None:
                        logprobs = chat_logprobs(c.logprobs[start:], c.token_ids[start:], top_k)
                    sent_text[c.index], sent_tokens[c.index] = len(c.text), len(c.token_ids)
                    finished[c.index] = reason is not None
                    stop_reason = c.stop_reason if reason else None
                    if mode == "none":
                        delta = DeltaMessage(content=text if text or reason is None else None)
                    elif mode == "named":  # the output is the arguments: stream them as they come
                        call = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=text))
                        if c.index not in call_ids:
                            call_ids[c.index] = call.id = random_id("call")
                            call.type, call.function.name = "function", name
                        delta = DeltaMessage(tool_calls=[call])
                        reason = "tool_calls" if reason == "stop" else reason
                    else:  # required, auto: the output is whole
                        _, calls = (output_tool_calls(c.text, mode, name, self.tool_parser) if reason == "stop"
                                    else (None, []))
                        end = len(c.text)
                        if calls:  # the content is what comes before the first call
                            end = self.tool_parser.content_prefix(c.text) if mode == "auto" else 0
                        if end > already:
                            yield chunk([ChatStreamChoice(index=c.index,
                                                          delta=DeltaMessage(content=c.text[already:end]))])
                        for i, call in enumerate(calls):
                            for delta_call in _streamed_tool_call(i, call):
                                yield chunk([ChatStreamChoice(index=c.index,
                                                              delta=DeltaMessage(tool_calls=[delta_call]))])
                        delta, reason = DeltaMessage(), "tool_calls" if calls else reason
                    choices.append(ChatStreamChoice(index=c.index, delta=delta, logprobs=logprobs,
                                                    finish_reason=reason, stop_reason=stop_reason))
                if choices:
                    yield chunk(choices, kv_transfer_params=out.kv_transfer_params if out.finished else None)
            if request.include_usage_in_stream and final is not None:
                yield chunk([], self._usage(request, final))
        finally:
            release()


def _tool_call(call: ParsedToolCall) -> ToolCall:
    return ToolCall(function=FunctionCall(name=call.name, arguments=call.arguments))


def _streamed_tool_call(index: int, call: ParsedToolCall) -> list[DeltaToolCall]:
    """As OpenAI streams a call: its id, type and name first (arguments empty), then the arguments."""
    return [DeltaToolCall(index=index, id=random_id("call"), type="function",
                          function=DeltaFunctionCall(name=call.name, arguments="")),
            DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=call.arguments))]


def _prompt_logprobs(request: ChatCompletionRequest, out: RequestOutput):
    if request.prompt_logprobs is None:
        return None
    return prompt_logprobs_field(out.prompt_logprobs, out.prompt_token_ids, request.prompt_logprobs)


def _reasoning_fields(request: ChatCompletionRequest, reasoning: str | None) -> dict:
    """The message's thinking under both of vLLM's names, unless the request asked it left out."""
    if not request.include_reasoning:
        reasoning = None
    return {"reasoning": reasoning, "reasoning_content": reasoning}


def grammar_after_reasoning(params, parser: ReasoningParser | None, prompt_token_ids: list[int],
                            chat_template_kwargs: dict | None = None):
    """A structured output (or forced tool call) of a thinking model starts after its thinking: the grammar
    waits for the end tag's token, as vLLM's structured outputs with a reasoning parser."""
    spec = params.structured_outputs
    if parser is None or spec is None or not parser.grammar_waits(prompt_token_ids, chat_template_kwargs):
        return params
    return dataclasses.replace(params, structured_outputs=dataclasses.replace(
        spec, reasoning_end_token_id=parser.end_token_id))


def reasoning_tokens(parser: ReasoningParser, output, prompt_token_ids: list[int],
                     chat_template_kwargs: dict | None = None) -> int:
    """One output's thinking tokens (0 when the split found no thinking)."""
    if parser.split(output.text, prompt_token_ids, chat_template_kwargs)[0] is None:
        return 0
    return parser.count_reasoning_tokens(output.token_ids, prompt_token_ids)
