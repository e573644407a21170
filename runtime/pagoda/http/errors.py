"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the matching status, for the
server and the router alike."""

import json
import logging
import re
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """Raised anywhere in a request handler; turned into an OpenAI error response."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def invalid_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    info = ErrorInfo(message=message, type=_ERROR_TYPES.get(status) or HTTPStatus(status).phrase,
                     param=param, code=code or str(status))
    return ErrorResponse(error=info).model_dump()


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def sse_error(error: APIError) -> str:
    """An error inside an already-started stream: one event with the error body, then [DONE]."""
    return f"data: {json.dumps(error_body(error.status, error.message, error.param, error.code))}\n\n"


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    # a union type reports each failed alternative as a location: keep the field path only
    loc = [part for part in loc if not re.match(r"^(str|int|float|bool|constrained-\w+|list\[.*\]|.*\[.*\])$", part)]
    param = ".".join(loc) or None
    if param is None:
        return f"invalid request body: {first.get('msg')}", None
    return f"invalid value for {param!r}: {first.get('msg')}", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error while serving a request")
        return error_response(500, f"internal server error: {exc!r}")
