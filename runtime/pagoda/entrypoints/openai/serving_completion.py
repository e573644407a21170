"""`POST /v1/completions`: one engine request per prompt, n choices each, streamed or not."""

import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request

from pagoda.engine.outputs import CompletionOutput, Logprob, RequestOutput
from pagoda.entrypoints.openai.fill_in_the_middle import fill_in_the_middle
from pagoda.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    UsageInfo,
)
from pagoda.entrypoints.openai.serving_base import (
    EventStreamResponse,
    OpenAIServing,
    cancel_on_disconnect,
    collect_finals,
    merge,
    sse,
    usage_of,
)
from pagoda.http.errors import invalid_request


def split_prompts(prompt) -> list:
    """OpenAI's four prompt shapes -> a list of single prompts (text or token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise invalid_request("prompt must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


def finish_reason(c: CompletionOutput) -> str | None:
    # the engine's "abort" never reaches a client that is still listening except on shutdown: call it a stop
    return None if c.finish_reason is None else ("length" if c.finish_reason == "length" else "stop")


def prompt_logprobs_field(entries: list[dict[int, Logprob] | None] | None, token_ids: list[int],
                          top_k: int) -> PromptLogprobs | None:
    """The engine's prompt logprobs in vLLM's response shape, each token's entry cut to its top_k
    alternatives (the engine may have scored more, for echo)."""
    if entries is None:
        return None
    return [None if entry is None else
            {tid: PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
             for tid, lp in entry.items() if tid == token or (lp.rank is not None and lp.rank <= top_k)}
            for token, entry in zip(token_ids, entries, strict=True)]


def without_generation(c: CompletionOutput) -> CompletionOutput:
    """echo with max_tokens 0: the engine generated one token to finish the prompt's step; none is shown."""
    return dataclasses.replace(c, text="", token_ids=[], logprobs=None if c.logprobs is None else [],
                               cumulative_logprob=None if c.cumulative_logprob is None else 0.0,
                               finish_reason=None if c.finish_reason is None else "length", stop_reason=None)


def completion_logprobs(entries: list[dict[int, Logprob]], token_ids: list[int], top_k: int,
                        text_offset: int) -> CompletionLogprobs:
    """text_offset: where the first token's text starts in the choice's whole text (echoed prompt included)."""
    """The legacy completions layout: parallel lists of tokens, their logprobs and top alternatives."""
    result = CompletionLogprobs()
    for token_id, entry in zip(token_ids, entries, strict=True):
        chosen = entry[token_id]
        token = chosen.decoded_token or ""
        result.tokens.append(token)
        result.token_logprobs.append(chosen.logprob)
        result.top_logprobs.append({
            (lp.decoded_token or ""): lp.logprob
            for tid, lp in entry.items() if tid == token_id or (lp.rank is not None and lp.rank <= top_k)})
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, request: CompletionRequest, raw: Request):
        lora_request = self.check_model(request.model)
        max_tokens = 16 if request.max_tokens is None else request.max_tokens
        if max_tokens == 0 and not request.echo:
            raise invalid_request("max_tokens must be at least 1 (0 only with echo, to score the prompt)",
                                  "max_tokens")
        # echo with logprobs scores the prompt too, as OpenAI's (lm-eval-harness's loglikelihood requests)
        params = self.make_params(request, max(max_tokens, 1), request.logprobs,
                                  request.logprobs if request.echo else None)
        raw_prompts = split_prompts(request.prompt)
        if request.suffix:
            raw_prompts = [fill_in_the_middle(self.tokenizer, p, request.suffix) for p in raw_prompts]
        if len(raw_prompts) > self.admission.limit:  # 429 would ask to retry something that can never fit
            raise invalid_request(f"{len(raw_prompts)} prompts in one request, more than this server admits at "
                                  f"once ({self.admission.limit}): split the batch", "prompt")
        if params.kv_transfer_params is not None and len(raw_prompts) > 1:  # one answer carries one prefill's
            raise invalid_request("kv_transfer_params needs a single prompt", "kv_transfer_params")
        prompts = [await self.validate_prompt(p, params) for p in raw_prompts]
        request_id = self.request_id(raw, "cmpl")
        release = self.admission.acquire(len(prompts), params.n, [len(p["prompt_token_ids"]) for p in prompts])
        streams = [self.generate(p, params, f"{request_id}-{i}", lora_request, request.priority, release, i)
                   for i, p in enumerate(prompts)]
        if request.stream:
            events = self._stream(request, request_id, prompts, streams, release)
            return EventStreamResponse(events, release)
        try:
            finals = await cancel_on_disconnect(raw, collect_finals(streams))
        finally:
            release()
        return self._response(request, request_id, prompts, finals)

    def _echo_text(self, prompt: dict) -> str:
        return prompt["prompt"] if prompt["prompt"] is not None else self.tokenizer.decode(prompt["prompt_token_ids"])

    def _prompt_logprobs(self, prompt: dict, out: RequestOutput, top_k: int) -> CompletionLogprobs:
        """The echoed prompt's tokens with their logprobs (the first has none: nothing predicts it)."""
        ids = prompt["prompt_token_ids"]
        first = self.tokenizer.decode(ids[:1])
        head = CompletionLogprobs(tokens=[first], token_logprobs=[None], top_logprobs=[None], text_offset=[0])
        if out.prompt_logprobs is None:  # not scored (cannot happen with logprobs set): tokens only
            rest = [self.tokenizer.decode([t]) for t in ids[1:]]
            offsets = [len(first) + sum(len(t) for t in rest[:i]) for i in range(len(rest))]
            return _concat(head, CompletionLogprobs(tokens=rest, token_logprobs=[None] * len(rest),
                                                    top_logprobs=[None] * len(rest), text_offset=offsets))
        return _concat(head, completion_logprobs(out.prompt_logprobs[1:], ids[1:], top_k, len(first)))

    @staticmethod
    def _prompt_logprobs_field(request: CompletionRequest, out: RequestOutput) -> PromptLogprobs | None:
        if request.prompt_logprobs is None:
            return None
        return prompt_logprobs_field(out.prompt_logprobs, out.prompt_token_ids, request.prompt_logprobs)

    def _response(self, request: CompletionRequest, request_id: str, prompts: list[dict],
                  finals: list[RequestOutput]) -> CompletionResponse:
        choices = []
        usage = UsageInfo()
        for i, (prompt, final) in enumerate(zip(prompts, finals, strict=True)):
            usage.prompt_tokens += len(final.prompt_token_ids)
            prefix = self._echo_text(prompt) if request.echo else ""
            scored = self._prompt_logprobs_field(request, final)
            for c in final.outputs:
                if request.max_tokens == 0:
                    c = without_generation(c)
                usage.completion_tokens += len(c.token_ids)
                logprobs = None
                if request.logprobs is not None and c.logprobs is not None:
                    logprobs = completion_logprobs(c.logprobs, c.token_ids, request.logprobs, len(prefix))
                    if request.echo:
                        logprobs = _concat(self._prompt_logprobs(prompt, final, request.logprobs), logprobs)
                choices.append(CompletionChoice(index=i * request.n + c.index, text=prefix + c.text,
                                                logprobs=logprobs, finish_reason=finish_reason(c),
                                                stop_reason=c.stop_reason, prompt_logprobs=scored))
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        usage.prompt_tokens_details = usage_of(finals).prompt_tokens_details
        return CompletionResponse(id=request_id, model=self.response_model(request.model), choices=choices, usage=usage,
                                  kv_transfer_params=finals[0].kv_transfer_params if len(finals) == 1 else None)

    async def _stream(self, request: CompletionRequest, request_id: str, prompts: list[dict],
                      streams, release) -> AsyncIterator[str]:
        created = int(time.time())
        sent: dict[tuple[int, int], _SentSoFar] = {}
        prompt_tokens: dict[int, int] = {}
        cached_tokens: dict[int, int] = {}
        completion_tokens: dict[tuple[int, int], int] = {}

        def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None,
                  kv_transfer_params: dict | None = None) -> str:
            return sse(CompletionResponse(id=request_id, created=created, model=self.response_model(request.model), choices=choices,
                                          usage=usage, kv_transfer_params=kv_transfer_params))

        try:
            async for i, out in merge(streams):
                prompt_tokens[i] = len(out.prompt_token_ids)
                cached_tokens[i] = out.num_cached_tokens
                choices = []
                for c in out.outputs:
                    if request.max_tokens == 0:
                        c = without_generation(c)
                    key = (i, c.index)
                    completion_tokens[key] = len(c.token_ids)
                    first = key not in sent
                    so_far = sent.setdefault(key, _SentSoFar())
                    if so_far.finished:
                        continue
                    prefix = self._echo_text(prompts[i]) if request.echo and first else ""
                    if first:
                        so_far.offset = len(prefix)
                    text = c.text[so_far.text :]
                    reason = finish_reason(c)
                    # a token whose text is held back (half a character, a possible stop string) still gets its
                    # chunk, empty, as vLLM's: a client counts tokens and their pace by chunks
                    if not (prefix or text or reason is not None or len(c.token_ids) > so_far.tokens):
                        continue
                    logprobs = None
                    if request.logprobs is not None and c.logprobs is not None:
                        start = so_far.tokens
                        logprobs = completion_logprobs(c.logprobs[start:], c.token_ids[start:], request.logprobs,
                                                       so_far.offset)
                        if logprobs.tokens:
                            so_far.offset = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
                        if prefix:
                            logprobs = _concat(self._prompt_logprobs(prompts[i], out, request.logprobs), logprobs)
                    so_far.text, so_far.tokens = len(c.text), len(c.token_ids)
                    so_far.finished = reason is not None
                    choices.append(CompletionChoice(index=i * request.n + c.index, text=prefix + text,
                                                    logprobs=logprobs, finish_reason=reason,
                                                    stop_reason=c.stop_reason if reason else None,
                                                    prompt_logprobs=None if so_far.scored_sent else
                                                    self._prompt_logprobs_field(request, out)))
                    so_far.scored_sent = True
                if choices:
                    yield chunk(choices, kv_transfer_params=out.kv_transfer_params if out.finished else None)
            if request.include_usage_in_stream:
                used = sum(completion_tokens.values())
                total = sum(prompt_tokens.values())
                details = PromptTokensDetails(cached_tokens=sum(cached_tokens.values()))
                yield chunk([], UsageInfo(prompt_tokens=total, completion_tokens=used, total_tokens=total + used,
                                          prompt_tokens_details=details))
        finally:
            release()


@dataclass
class _SentSoFar:
    """What one choice's stream has sent: characters, tokens, and where the next token's text starts."""

    text: int = 0
    tokens: int = 0
    offset: int = 0
    finished: bool = False
    scored_sent: bool = False  # prompt_logprobs go with the choice's first chunk


def _concat(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    # b's offsets already count the echoed prompt's characters
    return CompletionLogprobs(tokens=a.tokens + b.tokens, token_logprobs=a.token_logprobs + b.token_logprobs,
                              top_logprobs=a.top_logprobs + b.top_logprobs, text_offset=a.text_offset + b.text_offset)
