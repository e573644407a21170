"""Forwarding one request: pick a backend, send, pass the answer back chunk by chunk.

A backend that fails before the client got any byte (refused connection, reset, a 429/502/503/504) is
replaced once by another; one that fails mid-stream ends an event stream with an OpenAI error event
(then `data: [DONE]`). A client that disconnects cancels the forwarding, which closes the connection to
the backend, so the backend aborts the request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

import aiohttp
import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from pagoda.http.errors import APIError, error_body
from pagoda.router.answers import AnswerTap
from pagoda.router.backends import Backend, BackendPool
from pagoda.router.metrics import RouterMetrics
from pagoda.router.policies import Decision, Policy, RoutingRequest

logger = logging.getLogger(__name__)

BACKEND_HEADER = "x-pagoda-backend"  # on every forwarded response: which backend answered
RETRY_STATUSES = frozenset({429, 502, 503, 504})
RETRY_AFTER_SECONDS = "1"
CONNECT_TIMEOUT = 2.0
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                         "transfer-encoding", "upgrade", "host", "content-length"})
# uvicorn writes its own `date` and `server`; the middleware its own X-Request-Id
_NOT_PASSED_BACK = (_HOP_BY_HOP - {"content-length"}) | {"date", "server", "x-request-id"}


@dataclass
class RouterConfig:
    policy: str = "round-robin"
    max_in_flight_per_backend: int = 256  # past this a backend counts as saturated
    session_header: str = "x-session-id"


class BackendFailed(Exception):
    """Nothing was sent to the client yet: another backend may take the request."""

    def __init__(self, backend: Backend, kind: str, reason: str):
        super().__init__(reason)
        self.backend = backend
        self.kind = kind  # the label of pagoda_router:retries_total
        self.reason = reason


def routing_request(body: bytes, headers: dict[str, str], session_header: str,
                    path: str | None = None) -> RoutingRequest:
    """The fields policies read, from a JSON body and the path it was sent to (`path`, else the `:path`
    header the EPP gets from Envoy); a body that is not JSON routes on nothing (the backend will answer it
    with its own 400)."""
    try:
        data = json.loads(body) if body else None
    except ValueError:
        data = None
    if not isinstance(data, dict):
        return RoutingRequest(session_key=headers.get(session_header))
    model = data.get("model") if isinstance(data.get("model"), str) else None
    user = data.get("user") if isinstance(data.get("user"), str) else None
    path = (path or headers.get(":path") or "").partition("?")[0] or None
    return RoutingRequest(prefix_text=prompt_text(data), session_key=headers.get(session_header) or user,
                          model=model, answer_prefix=answer_prefix(data), body=data, path=path,
                          authorization=headers.get("authorization"))


def _content_text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: their text, in order
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else json.dumps(content, sort_keys=True)


def prompt_text(data: dict) -> str | None:
    """The request's prompt as one string that grows at the end as a conversation grows: chat messages
    (role and content) in order, or a completion's prompt. The model name leads, so models don't mix."""
    head = f"{data.get('model')}\x1d"
    messages = data.get("messages")
    if isinstance(messages, list):
        return head + "".join(f"\x1e{m.get('role')}\x1f{_content_text(m.get('content'))}"
                              for m in messages if isinstance(m, dict))
    prompt = data.get("prompt", data.get("input"))
    if isinstance(prompt, str):
        return head + prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return head + first  # a batch: its first prompt decides
        if isinstance(first, int):
            return head + ",".join(map(str, prompt))  # token ids
    return None


def answer_prefix(data: dict) -> str | None:
    """How the answer continues prompt_text in the conversation's next request: an assistant message after
    a chat's messages, the text itself after a completion's prompt. None when choice 0 alone would not be
    the continuation (several choices, an echoed prompt) or the prompt is not text."""
    if data.get("n") not in (None, 1) or data.get("echo"):
        return None
    if isinstance(data.get("messages"), list):
        return "\x1eassistant\x1f"
    return "" if isinstance(data.get("prompt"), str) else None


class Router:
    """What every request shares: the backends, the policy, the metrics and the upstream connections."""

    def __init__(self, pool: BackendPool, policy: Policy, config: RouterConfig, metrics_prefix: str | None = None):
        self.pool = pool
        self.policy = policy
        self.config = config
        self.metrics = RouterMetrics(pool, policy.name, *([metrics_prefix] if metrics_prefix else []))
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT)
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=30)
        # auto_decompress off: bodies pass through exactly as the backend encoded them
        self.session = aiohttp.ClientSession(timeout=timeout, connector=connector, auto_decompress=False)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    def backend_changed(self, backend: Backend, healthy: bool) -> None:
        if not healthy:  # a replica that died comes back with an empty cache
            self.policy.forget(backend.url)

    async def prepare(self, request: RoutingRequest) -> None:
        await self.policy.prepare(request, self.pool.healthy(), self.session)

    def choose(self, request: RoutingRequest, exclude: set[str]) -> Decision:
        healthy = [b for b in self.pool.healthy() if b.url not in exclude]
        if not healthy:
            self.metrics.rejected.labels("no-backend").inc()
            raise APIError(503, "no healthy backend: every replica is down or still starting", code="no_backend",
                           headers={"Retry-After": RETRY_AFTER_SECONDS})
        open_ = [b for b in healthy if b.in_flight < self.config.max_in_flight_per_backend]
        if not open_:
            self.metrics.rejected.labels("saturated").inc()
            raise APIError(429, f"every backend is saturated ({self.config.max_in_flight_per_backend} requests "
                                "in flight each); retry later", code="saturated",
                           headers={"Retry-After": RETRY_AFTER_SECONDS})
        if request.model:  # a model (LoRA adapter) some backends serve and others don't: those that do
            serving = [b for b in open_ if request.model in b.models]
            open_ = serving or open_
        decision = self.policy.choose(request, open_)
        self.metrics.decisions.labels(self.policy.name, decision.reason).inc()
        if self.policy.name == "prefix":
            self.metrics.prefix_prompt_chars.inc(decision.prompt_chars)
            self.metrics.prefix_hit_chars.inc(decision.matched_chars)
        return decision


class ProxyResponse(Response):
    """An ASGI response that forwards the request and streams the answer back, watching for the client's
    disconnect meanwhile (as Starlette's StreamingResponse does). Status and headers are the backend's."""

    def __init__(self, router: Router, method: str, path: str, headers: list[tuple[str, str]], body: bytes,
                 request: RoutingRequest, arrived: float):  # noqa: PLR0913 (Response.__init__ is not used)
        self.background = None
        self.router = router
        self.method = method
        self.path = path
        self.forward_headers = headers
        self.request_body = body
        self.request = request
        self.arrived = arrived
        self.overhead = 0.0
        self.extra_headers: list[tuple[bytes, bytes]] = []  # added to the response's (P/D: the prefill backend)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as tasks:
            async def watch_disconnect() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                tasks.cancel_scope.cancel()

            tasks.start_soon(watch_disconnect)
            try:
                await self.forward(send)
            finally:
                tasks.cancel_scope.cancel()

    async def forward(self, send: Send) -> None:
        router, tried, started = self.router, set(), self.arrived
        await router.prepare(self.request)
        for attempt in range(2):
            try:
                decision = router.choose(self.request, tried)
            except APIError as e:
                return await self.send_error(send, e)
            backend = decision.backend
            self.overhead += time.perf_counter() - started
            may_retry = attempt == 0 and any(b.url not in tried | {backend.url} for b in router.pool.healthy())
            try:
                return await self.attempt(decision, send, may_retry)
            except BackendFailed as failure:
                tried.add(backend.url)
                logger.warning("request to %s failed before any byte was sent (%s)%s", backend.url,
                               failure.reason, "; retrying on another backend" if may_retry else "")
                if not may_retry:
                    return await self.send_error(send, APIError(
                        502, f"backend {backend.url} failed: {failure.reason}", code="backend_failed"))
                router.metrics.retries.labels(failure.kind).inc()
                started = time.perf_counter()

    async def attempt(self, decision: Decision, send: Send, may_retry: bool) -> None:
        backend, router = decision.backend, self.router
        backend.in_flight += 1
        response = None
        try:
            try:
                response = await router.session.request(
                    self.method, backend.url + self.path, headers=self.forward_headers, data=self.request_body or None,
                    allow_redirects=False, skip_auto_headers=("Accept-Encoding", "User-Agent", "Content-Type"))
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                router.metrics.requests.labels(backend.url, "error").inc()
                if isinstance(e, (aiohttp.ClientConnectorError, asyncio.TimeoutError)):
                    backend.mark_down(f"{type(e).__name__}: {e}")  # leaves now; the probe brings it back
                    router.backend_changed(backend, False)
                raise BackendFailed(backend, "connect", f"{type(e).__name__}: {e}") from None
            router.metrics.requests.labels(backend.url, str(response.status)).inc()
            if response.status in RETRY_STATUSES and may_retry:
                raise BackendFailed(backend, f"status-{response.status}", f"it answered {response.status}")
            router.policy.routed(self.request, decision)
            tap = (AnswerTap() if router.policy.wants_answers and self.request.answer_prefix is not None
                   and response.status == 200 else None)
            if await self.relay(backend, response, send, tap) and tap is not None:
                text = tap.text(response.headers.get("content-type", "").startswith("text/event-stream"))
                if text:
                    router.policy.answered(self.request, decision, text)
        finally:
            backend.in_flight -= 1
            if response is not None:
                response.close()  # a no-op once fully read; otherwise drops the connection: the backend aborts

    async def relay(self, backend: Backend, response: aiohttp.ClientResponse, send: Send,
                    tap: AnswerTap | None = None) -> bool:
        """Pass the response on; True when it came through whole (`tap`, if any, saw every byte)."""
        chunks = response.content.iter_any()
        try:
            first = await anext(chunks, b"")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise BackendFailed(backend, "no-first-byte", f"{type(e).__name__} before the first byte: {e}") from None
        got_first = time.perf_counter()
        headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in response.headers.items()
                   if k.lower() not in _NOT_PASSED_BACK]
        headers.append((BACKEND_HEADER.encode(), backend.url.encode()))
        headers += self.extra_headers
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        await send({"type": "http.response.body", "body": first, "more_body": bool(first)})
        self.overhead += time.perf_counter() - got_first
        self.router.metrics.overhead.observe(self.overhead)
        if not first:
            return True
        is_stream = response.headers.get("content-type", "").startswith("text/event-stream")
        tail = first
        if tap is not None:
            tap.add(first)
        try:
            async for chunk in chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                tail = chunk
                if tap is not None:
                    tap.add(chunk)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            self.router.metrics.stream_errors.labels(backend.url).inc()
            logger.warning("backend %s failed mid-stream: %s: %s", backend.url, type(e).__name__, e)
            if not is_stream:
                raise  # a plain body cut short: the client sees the connection end without a complete body
            error = error_body(502, f"backend {backend.url} failed mid-stream: {type(e).__name__}",
                               code="backend_failed")
            boundary = b"" if tail.endswith(b"\n\n") else b"\n\n"  # end a half-sent event first
            event = boundary + f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
            await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return False
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return True

    async def send_error(self, send: Send, error: APIError) -> None:
        body = json.dumps(error_body(error.status, error.message, error.param, error.code)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items()]
        await send({"type": "http.response.start", "status": error.status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})


def upstream_headers(raw: list[tuple[bytes, bytes]], request_id: str) -> list[tuple[str, str]]:
    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in raw
               if k.decode("latin-1").lower() not in _HOP_BY_HOP and k.lower() != b"x-request-id"]
    headers.append(("X-Request-Id", request_id))  # the backend names its engine request after the router's id
    return headers


__all__ = ["BackendPool", "ProxyResponse", "Router", "RouterConfig", "routing_request", "upstream_headers"]
