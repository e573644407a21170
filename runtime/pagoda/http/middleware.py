"""HTTP middleware around every route: CORS (Starlette's, configured by vLLM's flags) and `X-Request-Id`.

Every response carries `X-Request-Id`: the client's own when it sent one, a fresh one otherwise. The id is
kept in the request's state, so the OpenAI handlers name their engine request (and the response `id`)
after it, and log lines about the request carry it.
"""

import uuid

from fastapi import FastAPI, Request
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_HEADER = "X-Request-Id"
_HEADER_KEY = REQUEST_ID_HEADER.lower().encode()
MAX_REQUEST_ID_CHARS = 256  # a longer client id is replaced by a fresh one (it would end up in every log line)


def request_id_of(request: Request) -> str:
    """The id the middleware gave this request (the client's X-Request-Id, or a fresh one)."""
    state = request.scope.get("state") or {}
    return state.get("request_id") or uuid.uuid4().hex


class RequestIdMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware, which would buffer streams and hide client disconnects)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = dict(scope.get("headers") or []).get(_HEADER_KEY, b"").decode("latin-1").strip()
        request_id = sent if 0 < len(sent) <= MAX_REQUEST_ID_CHARS and sent.isprintable() else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        header = (_HEADER_KEY, request_id.encode("latin-1"))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() != _HEADER_KEY]
                message = {**message, "headers": [*headers, header]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def install_middleware(app: FastAPI, allowed_origins: list[str], allowed_methods: list[str],
                       allowed_headers: list[str], allow_credentials: bool) -> None:
    """CORS inside, the request id outside: CORS preflight answers carry an X-Request-Id too."""
    app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=allowed_methods,
                       allow_headers=allowed_headers, allow_credentials=allow_credentials,
                       expose_headers=[REQUEST_ID_HEADER])
    app.add_middleware(RequestIdMiddleware)
