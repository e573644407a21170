"""What completions and chat share: model check, admission (the bounded queue), prompt validation before
anything is streamed, engine errors mapped to HTTP errors, metrics, and aborting on client disconnect."""

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from pagoda.engine import EngineDeadError
from pagoda.engine.input_processor import check_priority
from pagoda.engine.outputs import CompletionOutput, RequestOutput
from pagoda.entrypoints.openai.metrics import ServerMetrics
from pagoda.entrypoints.openai.protocol import PromptTokensDetails, UsageInfo
from pagoda.errors import RequestFailed
from pagoda.http.errors import APIError, invalid_request, sse_error
from pagoda.http.middleware import request_id_of
from pagoda.lora.request import LoRARequest
from pagoda.sampling_params import SamplingParams
from pagoda.worker.loader.generation_config import default_sampling_params

logger = logging.getLogger(__name__)
T = TypeVar("T")


class Admission:
    """Counts requests inside the engine. Beyond max_num_seqs + max_queued (--max-queued-requests) new ones
    get 429. vLLM's two limits, each off unless set, answer 503 instead, so that a client or a router retries
    on another instance: --max-num-queued-reqs bounds the sequences in flight (a request with n choices counts
    n, as vLLM's child requests do), --max-num-queued-tokens the prompt tokens of requests still in their
    prefill (a prompt's whole length until its first output token, as vLLM counts). A prompt is admitted while
    that backlog is under the limit, whatever its own length (as vLLM's): one longer than the limit waits for
    an idle server, never forever."""

    def __init__(self, max_running: int, max_queued: int, max_num_queued_reqs: int | None = None,
                 max_num_queued_tokens: int | None = None, on_busy: Callable[[str], None] | None = None):
        self.limit = max_running + max_queued
        self.max_num_queued_reqs = max_num_queued_reqs
        self.max_num_queued_tokens = max_num_queued_tokens
        self.in_flight = 0  # engine requests (one per prompt)
        self.sequences = 0  # their choices: what --max-num-queued-reqs bounds
        self.prefill_tokens = 0  # prompt tokens of admitted requests without an output token yet
        # told the limit's name at each 503 (vLLM's reasons: ADMISSION_REASONS), for vllm:admission_rejections
        self.on_busy = on_busy or (lambda reason: None)

    def acquire(self, count: int = 1, n: int = 1, prompt_tokens: Sequence[int] = ()) -> "Admitted":
        """Take places for `count` prompts of `n` choices each, or raise 429 / 503 (400 for a request larger
        than --max-num-queued-reqs could ever admit); returns the (idempotent) release. prompt_tokens: each
        prompt's length, its share of the prefill backlog until `Admitted.prefilled(i)`."""
        if self.in_flight + count > self.limit:
            raise APIError(429, f"server overloaded: {self.in_flight} requests in flight, limit {self.limit}; "
                                "retry later", code="too_many_requests", headers={"Retry-After": "1"})
        sequences = count * n
        max_reqs = self.max_num_queued_reqs
        if max_reqs is not None:
            if 0 < max_reqs < sequences:  # 503 would ask to retry something that can never fit
                raise invalid_request(f"this request runs {sequences} sequences (prompts x n), more than this "
                                      f"server admits at once (--max-num-queued-reqs {max_reqs}): split it",
                                      "n" if count == 1 else "prompt")
            if self.sequences + sequences > max_reqs:
                self.on_busy("max_num_queued_reqs")
                raise busy(f"{self.sequences} requests in flight, the limit is {max_reqs} "
                           "(--max-num-queued-reqs)")
        max_tokens = self.max_num_queued_tokens
        if max_tokens is not None and self.prefill_tokens >= max_tokens:
            self.on_busy("max_num_queued_tokens")
            raise busy(f"{self.prefill_tokens} prompt tokens wait for their prefill, the limit is {max_tokens} "
                       "(--max-num-queued-tokens; a prompt is admitted while the backlog is under it, whatever "
                       "its own length)")
        self.in_flight += count
        self.sequences += sequences
        self.prefill_tokens += sum(prompt_tokens)
        return Admitted(self, count, sequences, list(prompt_tokens))


def busy(why: str) -> APIError:
    """vLLM's answer to a full queue (503, its words), with why and a Retry-After as the 429 has."""
    return APIError(503, f"The engine is currently busy and cannot accept new requests: {why}. Please try "
                         "again later or on a different instance.", code="server_busy",
                    headers={"Retry-After": "1"})


class Admitted:
    """A request's places in `Admission`: calling it gives them all back (idempotent, whatever ended the
    request); `prefilled(i)` gives back prompt i's share of the prefill backlog once its first token is out."""

    def __init__(self, admission: Admission, count: int, sequences: int, shares: list[int]):
        self.admission = admission
        self.count, self.sequences, self.shares = count, sequences, shares
        self.released = False

    def prefilled(self, index: int = 0) -> None:
        if index < len(self.shares) and self.shares[index]:
            self.admission.prefill_tokens -= self.shares[index]
            self.shares[index] = 0

    def __call__(self) -> None:
        if self.released:
            return
        self.released = True
        for i in range(len(self.shares)):
            self.prefilled(i)
        self.admission.in_flight -= self.count
        self.admission.sequences -= self.sequences


class OpenAIServing:
    def __init__(self, engine, served_model_name: str, metrics: ServerMetrics, admission: Admission,
                 stream_interval: int = 1):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = served_model_name
        self.max_model_len = engine.config.model.max_model_len
        self.scheduling_policy = engine.config.scheduler.scheduling_policy
        self.metrics = metrics
        self.admission = admission
        self.sampling_defaults = default_sampling_params(engine.config.model)  # the model's generation config
        self.lora_modules: dict[str, LoRARequest] = {}  # --lora-modules: adapters clients name as `model`
        self.kv_transfer = engine.config.kv_transfer  # --kv-transfer-config (P/D), or None
        self.stream_interval = stream_interval  # --stream-interval: tokens per streamed chunk

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); 404 for a model not served."""
        if not model or model == self.model_name:
            return None
        if model in self.lora_modules:
            return self.lora_modules[model]
        served = ", ".join(f"`{m}`" for m in [self.model_name, *self.lora_modules])
        raise APIError(404, f"The model `{model}` does not exist; this server serves {served}.",
                       param="model", code="model_not_found")

    def response_model(self, model: str | None) -> str:
        """A response's `model`: the adapter a request named, else the base model's served name (as vLLM)."""
        return model if model in self.lora_modules else self.model_name

    def make_params(self, request, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
        try:
            check_priority(getattr(request, "priority", 0), self.scheduling_policy)
            params = request.sampling_params(max_tokens, logprobs, self.sampling_defaults, prompt_logprobs)
        except (ValueError, TypeError) as e:
            raise invalid_request(str(e), getattr(e, "param", None)) from None
        self.check_kv_transfer(params)
        return params

    def check_kv_transfer(self, params: SamplingParams) -> None:
        """P/D asked of a server without a KV connector, or of the wrong role, is a 400: answering it as a plain
        request would leave the caller (a P/D proxy) waiting for blocks that no one holds."""
        asked = params.kv_transfer_params
        if asked is None or not (asked.do_remote_decode or asked.do_remote_prefill):
            return
        what = "do_remote_decode" if asked.do_remote_decode else "do_remote_prefill"
        if self.kv_transfer is None:
            raise invalid_request(f"kv_transfer_params.{what}: this server has no KV connector; start it with "
                                  "--kv-transfer-config to serve prefill/decode disaggregation",
                                  f"kv_transfer_params.{what}")
        serves = self.kv_transfer.is_producer if asked.do_remote_decode else self.kv_transfer.is_consumer
        if not serves:
            raise invalid_request(f"kv_transfer_params.{what}: this server's kv_role is {self.kv_transfer.kv_role}; "
                                  f"{what} needs {'kv_producer' if asked.do_remote_decode else 'kv_consumer'} or "
                                  "kv_both", f"kv_transfer_params.{what}")

    async def validate_prompt(self, prompt, params: SamplingParams) -> dict:
        """Tokenize (off the event loop) and check the length now, so errors come before a stream starts."""
        try:
            text, token_ids = await self.engine.process_prompt(prompt, params)
        except ValueError as e:
            raise invalid_request(str(e), getattr(e, "param", None)) from None
        return {"prompt": text, "prompt_token_ids": token_ids}

    @staticmethod
    def request_id(raw: Request, prefix: str) -> str:
        """The engine's and the response's id: `prefix-` and the request's X-Request-Id (the client's, or one
        the middleware made up), so the client's id finds the request in the logs."""
        return f"{prefix}-{request_id_of(raw)}"

    async def generate(self, prompt: dict, params: SamplingParams, request_id: str,
                       lora_request: LoRARequest | None = None, priority: int = 0, admitted: Admitted | None = None,
                       index: int = 0) -> AsyncIterator[RequestOutput]:
        """The engine's cumulative outputs, with metrics observed and engine errors as APIError, paced to
        --stream-interval tokens (or the request's stream_interval, the larger). admitted: the request's
        places; this prompt (`index` in it) gives back its share of the prefill backlog at its first token,
        or when it ends without one."""
        tracker = self.metrics.tracker(params)
        interval = max(self.stream_interval, getattr(params, "stream_interval", None) or 1)
        pace = StreamPacer(interval) if interval > 1 else None
        prefilling = admitted is not None  # until this prompt's first token
        try:
            async for out in self.engine.generate(prompt, params, request_id, lora_request=lora_request,
                                                  priority=priority):
                tracker.observe(out)
                if prefilling and (out.finished or any(c.token_ids for c in out.outputs)):
                    admitted.prefilled(index)
                    prefilling = False
                if pace is not None and (out := pace(out)) is None:
                    continue
                yield out
        except EngineDeadError as e:
            raise APIError(500, f"the engine failed: {e}", code="engine_dead") from None
        except RequestFailed as e:  # this request alone: the engine goes on serving
            raise APIError(500, f"the request failed inside the engine: {e}", code="request_failed") from None
        except ValueError as e:
            raise invalid_request(str(e), getattr(e, "param", None)) from None
        finally:
            if admitted is not None:  # ended before its first token: aborted, failed, or the client left
                admitted.prefilled(index)


class StreamPacer:
    """Streams in chunks of `interval` tokens, as vLLM's output processor with --stream-interval: a choice's
    first token goes out at once, then its tokens once `interval` of them are new, and the rest when it
    finishes. Works on cumulative outputs: an output none of whose choices is due is held back (None); in one
    that is due, a choice not due stands as it was last sent, so its new tokens go out with a later output."""

    def __init__(self, interval: int):
        self.interval = interval
        self.sent: dict[int, CompletionOutput] = {}  # by choice index: what went out last

    def __call__(self, out: RequestOutput) -> RequestOutput | None:
        if out.finished:
            return out
        choices, due = [], False
        for c in out.outputs:
            last = self.sent.get(c.index)
            sent = len(last.token_ids) if last is not None else 0
            new = len(c.token_ids) - sent
            finishing = c.finish_reason is not None and (last is None or last.finish_reason is None)
            if finishing or (new > 0 and (sent == 0 or new >= self.interval)):
                self.sent[c.index] = c
                due = True
                choices.append(c)
            else:
                choices.append(last if last is not None else c)  # never sent: it has no token yet
        return dataclasses.replace(out, outputs=choices) if due else None


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators as items arrive; closing the merge cancels (aborts) them all."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
            await queue.put((i, done))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, who re-raises it
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect_finals(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """Run several requests' streams together; their final outputs, in the streams' order."""
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for i, out in merge(streams):
        finals[i] = out
    return finals


async def last_output(stream: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    """A stream's final output (None if it ended before any): what a non-streamed answer is made of."""
    last = None
    async for out in stream:
        last = out
    return last


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run a non-streaming handler's work, cancelling it (so the engine aborts) if the client goes away."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        logger.info("client disconnected: request aborted")
        raise APIError(499, "client disconnected")
    return task.result()


def usage_of(finals: Iterable[RequestOutput]) -> UsageInfo:
    """Tokens of one request's prompts and outputs; `cached_tokens`: prompt tokens the prefix cache served."""
    prompt = completion = cached = 0
    for final in finals:
        prompt += len(final.prompt_token_ids)
        completion += sum(len(c.token_ids) for c in final.outputs)
        cached += final.num_cached_tokens
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json(exclude_none=True)}\n\n"


class EventStreamResponse(StreamingResponse):
    """Server-sent events that give back their admission slot however the response ends. The events'
    generator releases it in its `finally`, but a client that disconnects before the body starts can get
    the generator cancelled before it ever ran, and then its `finally` never runs: release here too."""

    def __init__(self, events: AsyncIterator, release: Callable[[], None],
                 framing: Callable[[AsyncIterator], AsyncIterator[str]] | None = None):
        """framing: events -> the body's text (default: chat's `data:` lines ending in [DONE])."""
        super().__init__((framing or sse_stream)(events), media_type="text/event-stream")
        self.release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.release()


async def sse_stream(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Server-sent events ending in [DONE]; an error after the stream started becomes an error event."""
    try:
        async for event in events:
            yield event
    except APIError as e:
        yield sse_error(e)
    except Exception as e:  # noqa: BLE001 - the status line is gone: report in-band
        logger.exception("error while streaming")
        yield sse_error(APIError(500, f"internal server error: {e!r}"))
    yield "data: [DONE]\n\n"

