"""Worker ranks (node rank > 0) serve only `GET /health` and `GET /metrics` on `--port`.

The rank's own work (joining the torch.distributed group, running its pipeline stage) is the
distributed executor's: it is passed in as `run_rank(mark_ready)`, a blocking callable that calls
`mark_ready()` once the rank joined its group and returns (or raises) when the group ends.
"""

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from pagoda.entrypoints.openai.cli_args import ServerArgs
from pagoda.entrypoints.openai.metrics import CONTENT_TYPE, PREFIX
from pagoda.http.errors import error_response

logger = logging.getLogger("pagoda.worker")

RunRank = Callable[[Callable[[], None]], None]


def build_worker_app(run_rank: RunRank, on_exit: Callable[[int], None]) -> FastAPI:
    registry = CollectorRegistry()
    joined = Gauge(PREFIX + "worker_joined", "1 once this rank joined its group.", registry=registry)
    ready = threading.Event()

    def mark_ready() -> None:
        ready.set()
        joined.set(1)

    def run() -> None:
        code = 0
        try:
            run_rank(mark_ready)
        except Exception:
            logger.exception("worker rank failed")
            code = 1
        ready.clear()
        joined.set(0)
        on_exit(code)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        thread = threading.Thread(target=run, name="pagoda-worker-rank", daemon=True)
        thread.start()
        yield

    app = FastAPI(title="Pagoda worker", lifespan=lifespan)

    @app.get("/health")
    async def health() -> Response:
        if ready.is_set():
            return Response(status_code=200)
        return error_response(503, "this rank has not joined its group", code="service_unavailable")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE)

    return app


def run_worker_server(server_args: ServerArgs, run_rank: RunRank) -> int:
    """Serve /health and /metrics while `run_rank` runs; the exit code is the rank's."""
    exit_code = 0
    server: uvicorn.Server | None = None

    def on_exit(code: int) -> None:
        nonlocal exit_code
        exit_code = code
        server.should_exit = True

    app = build_worker_app(run_rank, on_exit)
    server = uvicorn.Server(uvicorn.Config(app, host=server_args.host, port=server_args.port,
                                           log_level=server_args.log_level, access_log=False))
    asyncio.run(server.serve())
    return exit_code
