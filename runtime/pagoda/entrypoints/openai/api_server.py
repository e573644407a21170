"""The head's HTTP server: FastAPI on uvicorn over `AsyncLLMEngine`.

The port opens at once and the model loads in a worker thread meanwhile, so `/health` can say 503
(loading) to Kubernetes' startup probe. SIGTERM drains: new requests get 503 while running ones have
`--shutdown-timeout` seconds to finish; then the engine stops and the process exits 0. A SIGTERM while the
model still loads exits at once.
"""

import asyncio
import concurrent.futures
import contextlib
import logging
import multiprocessing
import os
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

import pagoda
from pagoda.config import EngineArgs, SchedulerConfig
from pagoda.entrypoints.openai.cli_args import ServerArgs, flagify
from pagoda.entrypoints.openai.embedding_protocol import EmbeddingRequest, EmbeddingResponse
from pagoda.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from pagoda.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from pagoda.entrypoints.openai.protocol_messages import CountTokensRequest, MessagesRequest, openapi_extra
from pagoda.entrypoints.openai.protocol_responses import ResponsesRequest
from pagoda.entrypoints.openai.serving_base import Admission
from pagoda.entrypoints.openai.serving_chat import OpenAIServingChat
from pagoda.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagoda.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from pagoda.entrypoints.openai.serving_messages import AnthropicServingMessages, handle
from pagoda.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagoda.entrypoints.openai.serving_tokenize import OpenAIServingTokenize
from pagoda.http.connections import IDLE_KEEP_ALIVE_SECONDS
from pagoda.http.errors import APIError, ErrorResponse, error_response, install_error_handlers
from pagoda.http.middleware import install_middleware
from pagoda.lora.request import LoRARequest
from pagoda.process.startup_heap import frozen_when_loaded

logger = logging.getLogger("pagoda.server")


@dataclass
class ServerState:
    engine_args: EngineArgs
    server_args: ServerArgs
    engine: object | None = None
    loader: threading.Thread | None = None  # the model load's thread
    load_error: BaseException | None = None
    draining: bool = False
    started: float = field(default_factory=time.time)
    completion: OpenAIServingCompletion | None = None
    chat: OpenAIServingChat | None = None
    embedding: OpenAIServingEmbedding | None = None
    responses: OpenAIServingResponses | None = None
    messages: AnthropicServingMessages | None = None
    tokenize: OpenAIServingTokenize | None = None
    metrics: ServerMetrics | None = None
    admission: Admission | None = None
    on_fatal: Callable[[], None] = lambda: None
    last_lora_id: int = 0  # adapters get ids 1, 2, ... (--lora-modules, then /v1/load_lora_adapter)

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.is_running and not self.draining

    def unavailable_reason(self) -> str | None:
        if self.draining:
            return "the server is shutting down"
        if self.load_error is not None:
            return f"the model failed to load: {self.load_error}"
        if self.engine is None:
            return "the model is still loading"
        if not self.engine.is_running:
            return "the engine is not running (it failed); the server needs a restart"
        return None


def default_engine_factory(args: EngineArgs):
    """The engine core in a process of its own, or in this one (PAGODA_ENABLE_ENGINE_CORE_PROCESS)."""
    from pagoda import AsyncLLMEngine
    from pagoda.config import resolve_device
    from pagoda.engine.core_client import AsyncMPEngine, engine_core_process_enabled

    if engine_core_process_enabled(resolve_device(args.device)):
        return AsyncMPEngine.from_engine_args(args)
    return AsyncLLMEngine.from_engine_args(args)


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # accepted for vLLM's clients; the name decides


def lora_requests(modules: list, engine) -> dict[str, LoRARequest]:
    """--lora-modules as the engine's LoRARequests (ids 1, 2, ... in flag order), each checked now: a bad
    adapter stops the server at start-up, naming it."""
    requests = {}
    for i, module in enumerate(modules, start=1):
        request = LoRARequest(module.name, i, module.path, module.base_model_name)
        try:
            engine.loras.resolve(request)
        except ValueError as e:
            raise ValueError(f"--lora-modules {module.name}: {e}") from None
        requests[module.name] = request
    return requests


def _attach_engine(state: ServerState, engine) -> None:
    config = engine.config
    name = config.model.served_model_name
    cache = config.cache
    cache_info = {"block_size": str(cache.block_size), "cache_dtype": config.model.dtype,
                  "enable_prefix_caching": str(cache.enable_prefix_caching),
                  "gpu_memory_utilization": str(cache.gpu_memory_utilization),
                  "num_gpu_blocks": str(engine.get_stats().num_blocks_total),
                  "num_cpu_blocks": str(cache.num_swap_blocks), "swap_space": str(cache.swap_space_gib),
                  "preemption_mode": cache.preemption_mode}
    state.metrics = ServerMetrics(name, engine.get_stats, max_model_len=config.model.max_model_len,
                                  cache_info=cache_info,
                                  max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
                                  vllm_names=state.server_args.metrics_vllm_names,
                                  engines=range(config.parallel.data_parallel_rank, config.parallel.data_parallel_rank
                                                + config.parallel.data_parallel_size))
    args = state.server_args
    state.admission = Admission(config.scheduler.max_num_seqs, args.max_queued_requests, args.max_num_queued_reqs,
                                args.max_num_queued_tokens, on_busy=state.metrics.admission_rejected)
    state.completion = OpenAIServingCompletion(engine, name, state.metrics, state.admission,
                                               stream_interval=args.stream_interval)
    state.chat = OpenAIServingChat(engine, name, state.metrics, state.admission, stream_interval=args.stream_interval,
                                   trust_request_chat_template=state.server_args.trust_request_chat_template,
                                   tool_call_parser=(state.server_args.tool_call_parser
                                                     if state.server_args.enable_auto_tool_choice else None),
                                   chat_template=state.server_args.chat_template,
                                   reasoning_parser=state.server_args.reasoning_parser)
    state.embedding = OpenAIServingEmbedding(engine, name, state.metrics, state.admission)
    state.responses = OpenAIServingResponses(state.chat, state.server_args.max_stored_responses)
    state.messages = AnthropicServingMessages(state.chat)
    state.tokenize = OpenAIServingTokenize(state.chat, state.responses)
    adapters = lora_requests(state.server_args.lora_modules or [], engine)
    for serving in (state.completion, state.chat, state.embedding):
        serving.lora_modules = adapters  # one dict: loading and unloading at runtime reach all three
    state.last_lora_id = len(adapters)
    state.engine = engine
    if hasattr(engine, "add_group_failure_callback"):
        # a dead rank cannot be replaced in place: report 503 for a moment, then exit non-zero so the
        # operator (or the kubelet) recreates the whole group
        loop = asyncio.get_running_loop()
        engine.add_group_failure_callback(
            lambda message: loop.call_soon_threadsafe(loop.call_later, 2.0, state.on_fatal))
    cache, par = config.cache, config.parallel
    num_blocks = engine.get_stats().num_blocks_total
    host = state.server_args.host
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{state.server_args.port}/v1"
    logger.info("serving model %s from %s: dtype=%s, max_model_len=%d, tensor_parallel_size=%d, "
                "pipeline_parallel_size=%d, KV cache %d blocks x %d = %d tokens, max_num_seqs=%d, "
                "max queued requests=%d, preemption by %s (swap space %d blocks), stats log %s",
                name, config.model.path, config.model.dtype, config.model.max_model_len,
                par.tensor_parallel_size, par.pipeline_parallel_size, num_blocks, cache.block_size,
                num_blocks * cache.block_size, config.scheduler.max_num_seqs,
                state.server_args.max_queued_requests, cache.preemption_mode, cache.num_swap_blocks,
                f"every {config.stats_log_interval:g}s" if config.log_stats else "off")
    limits = limits_set(config.scheduler, state.server_args)
    if limits:
        logger.info("limits set: %s", ", ".join(limits))
    logger.info("ready in %.1fs: OpenAI API at %s", time.time() - state.started, url)


def limits_set(scheduler: SchedulerConfig, args: ServerArgs) -> list[str]:
    """vLLM's scheduling and admission knobs this server runs with other than their defaults, as `name=value`
    (the start-up log: what bounds this server beside max_num_seqs)."""
    knobs = [(scheduler, name) for name in ("max_num_active_seqs", "max_num_scheduled_tokens",
                                            "long_prefill_token_threshold", "long_prefill_token_threshold_adaptive",
                                            "watermark", "reserve_full_isl", "prefill_schedule_interval")]
    knobs += [(args, name) for name in ("max_num_queued_reqs", "max_num_queued_tokens", "stream_interval")]
    defaults = {name: f.default for config in (scheduler, args) for name, f in config.__dataclass_fields__.items()}
    return [f"{name}={getattr(config, name)}" for config, name in knobs if getattr(config, name) != defaults[name]]


def build_app(engine_args: EngineArgs, server_args: ServerArgs,
              engine_factory: Callable[[EngineArgs], object] = default_engine_factory) -> FastAPI:
    state = ServerState(engine_args, server_args)

    async def load() -> None:
        loaded: concurrent.futures.Future = concurrent.futures.Future()

        def load_engine() -> None:
            loaded.set_running_or_notify_cancel()
            try:
                loaded.set_result(engine_factory(engine_args))
            except BaseException as e:  # noqa: BLE001 - handed to the await below
                loaded.set_exception(e)

        # a daemon thread of its own, not asyncio's executor, which the process would join at exit: a
        # SIGTERM during a long load must not wait for it (run_server)
        state.loader = threading.Thread(target=load_engine, name="pagoda-load", daemon=True)
        try:
            with frozen_when_loaded():
                state.loader.start()
                engine = await asyncio.wrap_future(loaded)
        except Exception as e:  # noqa: BLE001 - logged, then the process exits non-zero
            logger.error("failed to load the model: %s", flagify(str(e)),
                         exc_info=not isinstance(e, ValueError | OSError))
            state.load_error = e
            state.on_fatal()
            return
        try:
            _attach_engine(state, engine)
        except ValueError as e:  # a flag the loaded model cannot honour (e.g. --reasoning-parser's tags)
            logger.error("%s", e)
            state.load_error = e
            await asyncio.to_thread(engine.shutdown)
            state.on_fatal()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loader = asyncio.create_task(load())
        yield
        loader.cancel()
        if state.engine is not None:
            await asyncio.to_thread(state.engine.shutdown)

    app = FastAPI(title="Pagoda", version=pagoda.__version__, lifespan=lifespan)
    app.state.pagoda = state
    install_error_handlers(app)
    install_middleware(app, server_args.allowed_origins, server_args.allowed_methods, server_args.allowed_headers,
                       server_args.allow_credentials)

    def require_ready() -> None:
        reason = state.unavailable_reason()
        if reason is not None:
            raise APIError(503, reason, code="service_unavailable", headers={"Retry-After": "5"})

    def require_api_key(request: Request) -> None:
        key = server_args.api_key
        if not key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if "x-api-key" in request.headers:  # Anthropic's clients send the key so
            scheme, token = "bearer", request.headers["x-api-key"]
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "invalid or missing API key: send `Authorization: Bearer <key>`",
                           code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key), Depends(require_ready)])

    @v1.post("/completions")
    async def completions(body: CompletionRequest, raw: Request):
        return await state.completion.create(body, raw)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        return await state.chat.create(body, raw)

    @v1.post("/embeddings")
    async def embeddings(body: EmbeddingRequest, raw: Request) -> EmbeddingResponse:
        return await state.embedding.create(body, raw)

    @v1.post("/responses")
    async def responses(body: ResponsesRequest, raw: Request):
        return await state.responses.create(body, raw)

    @v1.get("/responses/{response_id}")
    async def retrieve_response(response_id: str):
        return JSONResponse(state.responses.retrieve(response_id))

    @v1.post("/responses/{response_id}/cancel")
    async def cancel_response(response_id: str):
        return JSONResponse(state.responses.cancel(response_id))

    def model_card(adapter: LoRARequest | None = None) -> ModelCard:
        config = state.engine.config
        if adapter is not None:
            return ModelCard(id=adapter.lora_name, root=adapter.lora_path, parent=config.model.served_model_name,
                             created=int(state.started), max_model_len=config.model.max_model_len)
        return ModelCard(id=config.model.served_model_name, root=config.model.path, created=int(state.started),
                         max_model_len=config.model.max_model_len)

    @v1.get("/models")
    async def models() -> ModelList:
        return ModelList(data=[model_card(), *map(model_card, state.completion.lora_modules.values())])

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        return model_card(state.completion.check_model(model_id))

    if server_args.allow_runtime_lora_updating:  # it lets a client make the server read a path: off by default
        @v1.post("/load_lora_adapter")
        async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
            adapters = state.completion.lora_modules
            if body.lora_name in adapters or body.lora_name == state.engine.config.model.served_model_name:
                raise APIError(400, f"The model `{body.lora_name}` is already served.", param="lora_name",
                               code="invalid_value")
            state.last_lora_id += 1  # an unloaded adapter's id is never reused
            request = LoRARequest(body.lora_name, state.last_lora_id, body.lora_path)
            try:  # read and checked off the event loop; a bad adapter is this request's error alone
                await asyncio.to_thread(state.engine.loras.resolve, request)
            except ValueError as e:
                raise APIError(400, str(e), param="lora_path", code="invalid_value") from None
            adapters[body.lora_name] = request
            return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

        @v1.post("/unload_lora_adapter")
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
            if state.completion.lora_modules.pop(body.lora_name, None) is None:
                raise APIError(404, f"The LoRA adapter `{body.lora_name}` is not loaded.", param="lora_name",
                               code="model_not_found")
            # requests already running keep their adapter; its slot is reused when another adapter needs one
            return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.",
                            media_type="text/plain")

    app.include_router(v1)

    # Anthropic's Messages API: its own error shape, so its checks run inside the handler
    @app.post("/v1/messages", openapi_extra=openapi_extra(MessagesRequest, streams=True))
    async def anthropic_messages(raw: Request):
        return await handle(raw, MessagesRequest, lambda: (require_api_key(raw), require_ready()),
                            lambda body: state.messages.create(body, raw))

    @app.post("/v1/messages/count_tokens", openapi_extra=openapi_extra(CountTokensRequest, streams=False))
    async def anthropic_count_tokens(raw: Request):
        return await handle(raw, CountTokensRequest, lambda: (require_api_key(raw), require_ready()),
                            lambda body: state.messages.count_tokens(body))

    @app.post("/tokenize", dependencies=[Depends(require_ready)])
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        tokens = await state.tokenize.tokenize(body)
        return TokenizeResponse(count=len(tokens), max_model_len=state.engine.config.model.max_model_len,
                                tokens=tokens)

    @app.post("/detokenize", dependencies=[Depends(require_ready)])
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        state.completion.check_model(body.model)
        vocab = len(state.engine.tokenizer)
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return DetokenizeResponse(prompt=await asyncio.to_thread(state.engine.tokenizer.decode, body.tokens))

    @app.get("/health")
    async def health() -> Response:
        reason = state.unavailable_reason()
        if reason is None:
            return Response(status_code=200)
        return error_response(503, reason, code="service_unavailable")

    @app.get("/metrics")
    async def metrics() -> Response:
        body = state.metrics.render() if state.metrics is not None else b""
        return Response(body, media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": pagoda.__version__})

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = document_errors(get_openapi(title=app.title, version=app.version, routes=app.routes))
            paths = schema["paths"]
            paths["/health"]["get"]["responses"]["200"] = {"description": "Ready: the model is loaded and the "
                                                                          "whole group has joined (empty body)"}
            paths["/metrics"]["get"]["responses"]["200"] = {
                "description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}
            for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):  # `stream: true`: events
                ok = paths[path]["post"]["responses"]["200"]
                ok.setdefault("content", {})["text/event-stream"] = {"schema": {
                    "type": "object", "required": ["data"],
                    "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    return app


def document_errors(schema: dict) -> dict:
    """Make the OpenAPI document say what the server answers: request-body errors are 400 (not FastAPI's
    422), in OpenAI's error shape, with every other status a route can return."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    components.update(ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
                      .pop("$defs", {}))
    components["ErrorResponse"] = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    for path, operations in schema.get("paths", {}).items():
        for method, operation in operations.items():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            statuses = {500}
            if method == "post" or "parameters" in operation:
                statuses.add(400)
            if path.startswith("/v1/"):
                statuses |= {401, 503}
            if path in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses"):
                statuses |= {404, 429}
            if path.startswith("/v1/responses/"):
                statuses.add(404)
            if path.startswith("/v1/models/") or path in ("/tokenize", "/detokenize"):
                statuses |= {404, 503}
            if path == "/health":
                statuses.add(503)
            for status in sorted(statuses):
                phrase = HTTPStatus(status).phrase
                responses.setdefault(str(status), {"description": phrase, **error})
    return schema


class DrainingServer(uvicorn.Server):
    """uvicorn, but the first SIGTERM/SIGINT drains (503 for new requests) before it stops."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state
        self.loop: asyncio.AbstractEventLoop | None = None
        self.failed = False
        self.first_signal_at = 0.0
        state.on_fatal = self.fail

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def fail(self) -> None:
        self.failed = True
        self.should_exit = True

    # a second signal sooner than this after the first is the same stop delivered twice (`make serve` stopped
    # by a signal to its process group: make forwards SIGTERM to the server, which got its own), not a user
    # asking to skip the drain
    SAME_STOP_S = 1.0

    def handle_exit(self, sig: int, frame) -> None:
        # unlike uvicorn's own handler, don't re-raise the signal at the end: a drained exit is a clean exit 0
        now = time.monotonic()
        if self.state.draining and now - self.first_signal_at < self.SAME_STOP_S:
            return
        if self.state.draining or self.loop is None:
            logger.warning("second %s: stopping now", signal.Signals(sig).name)
            self.should_exit = self.force_exit = True
            return
        self.state.draining = True
        self.first_signal_at = now
        if self.state.engine is None:  # nothing to drain
            logger.info("%s while the model loads: stopping", signal.Signals(sig).name)
            self.should_exit = True
            return
        self.loop.call_soon_threadsafe(lambda: self.loop.create_task(self._drain(sig)))

    async def _drain(self, sig: int) -> None:
        timeout = self.state.server_args.shutdown_timeout
        admission = self.state.admission
        in_flight = admission.in_flight if admission else 0
        logger.info("%s: draining; %d requests in flight get up to %.0fs to finish", signal.Signals(sig).name,
                    in_flight, timeout)
        deadline = time.monotonic() + timeout
        while admission is not None and admission.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if admission is not None and admission.in_flight > 0:
            logger.warning("shutdown timeout: aborting %d requests", admission.in_flight)
        self.should_exit = True


def run_server(engine_args: EngineArgs, server_args: ServerArgs,
               engine_factory: Callable[[EngineArgs], object] = default_engine_factory) -> int:
    """Serve until SIGTERM/SIGINT; returns the process exit code."""
    app = build_app(engine_args, server_args, engine_factory)
    config = uvicorn.Config(app, host=server_args.host, port=server_args.port, log_level=server_args.log_level,
                            access_log=server_args.log_level == "debug", timeout_graceful_shutdown=1,
                            timeout_keep_alive=IDLE_KEEP_ALIVE_SECONDS)
    state: ServerState = app.state.pagoda
    server = DrainingServer(config, state)
    server.run()
    code = 1 if server.failed else 0
    if state.loader is not None and state.loader.is_alive():
        exit_while_loading(code)
    return code


def exit_while_loading(code: int) -> None:
    """Stopped before the model finished loading: the load cannot be interrupted, so exit without waiting
    for it (the interpreter's own exit would, or end its thread in the middle of C++), and take the
    worker processes it has started along (SIGTERM ends them at once: they install no handler)."""
    for child in multiprocessing.active_children():
        child.terminate()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
