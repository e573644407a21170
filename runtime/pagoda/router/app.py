"""The router's HTTP app: its own /health and /metrics; every other path is forwarded to a backend
(/v1/models included, so it lists what the replicas serve and answers as they do)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from pagoda.http.errors import error_response, install_error_handlers
from pagoda.http.middleware import RequestIdMiddleware, request_id_of
from pagoda.router.args import RouterArgs
from pagoda.router.backends import BackendPool
from pagoda.router.health import HealthMonitor
from pagoda.router.metrics import CONTENT_TYPE
from pagoda.router.policies import make_policy
from pagoda.router.precise import Precise
from pagoda.router.proxy import ProxyResponse, Router, RouterConfig, routing_request, upstream_headers

logger = logging.getLogger(__name__)
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]


def _discovery(args: RouterArgs, pool: BackendPool, router: Router):
    if args.k8s_service is None:
        return None
    from pagoda.router.kubernetes import EndpointSliceWatcher

    def update(urls: list[str]) -> None:
        added, removed = pool.set_urls(urls)
        for url in removed:
            router.policy.forget(url)
        if added or removed:
            logger.info("backends of service %s: +%s -%s", args.k8s_service, added, removed)

    return EndpointSliceWatcher(args.k8s_service, args.namespace, update).run()


def build_app(args: RouterArgs) -> FastAPI:
    pool = BackendPool(args.backends)
    policy = Precise() if args.policy == "precise" else make_policy(args.policy)
    router = Router(pool, policy, RouterConfig(
        policy=args.policy, max_in_flight_per_backend=args.max_in_flight_per_backend,
        session_header=args.session_header))
    monitor = HealthMonitor(pool, router.backend_changed, api_key=args.backend_api_key)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await router.start()
        loops = [monitor.run()]
        discovery = _discovery(args, pool, router)
        if discovery is not None:
            loops.append(discovery)
        if args.policy == "precise":
            from pagoda.router.kv_subscriber import KVEventSubscriber

            loops.append(KVEventSubscriber(pool, router.policy.index, args.kv_events_endpoint,
                                           args.kv_events_replay_endpoint, args.kv_events_topic).run())
        tasks = [asyncio.create_task(loop) for loop in loops]
        epp = None
        if args.epp:
            from pagoda.router.epp import EPPServer

            epp = EPPServer(router, args.host, args.epp_port, args.epp_max_queue, args.session_header,
                            args.epp_fallbacks)
            await epp.set_serving(False)
            await epp.start()
        await monitor_first_round(monitor)
        if epp is not None:
            await epp.set_serving(True)  # backends known (readiness: the picker's view is synced)
        try:
            yield
        finally:
            if epp is not None:
                await epp.stop()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await router.close()

    app = FastAPI(title="pagoda router", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    app.state.router = router
    install_error_handlers(app)
    app.add_middleware(RequestIdMiddleware)

    @app.get("/health")
    async def health() -> Response:
        if pool.healthy():
            return Response(status_code=200)
        reasons = "; ".join(f"{b.url}: {b.last_error}" for b in pool.all()) or "no backend discovered yet"
        return error_response(503, f"no healthy backend ({reasons})", code="no_backend")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/debug/kv-index")
    async def kv_index() -> Response:
        """--policy precise: per backend, the blocks its events say its cache holds, and the stream's state."""
        index = getattr(router.policy, "index", None)
        if router.policy.name != "precise":
            return error_response(404, "the KV index exists with --policy precise", code="not_found")
        return JSONResponse(index.summary())

    @app.api_route("/{path:path}", methods=METHODS, response_model=None)
    async def forward(request: Request) -> Response:
        arrived = time.perf_counter()
        body = await request.body()
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in request.scope["headers"]}
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return ProxyResponse(router, request.method, target,
                             upstream_headers(request.scope["headers"], request_id_of(request)), body,
                             routing_request(body, headers, router.config.session_header, request.url.path),
                             arrived)

    return app


async def monitor_first_round(monitor: HealthMonitor) -> None:
    """Wait (briefly) for the first probes, so backends that are up are in the rotation from the start."""
    for _ in range(40):
        if monitor.rounds > 0:
            return
        await asyncio.sleep(0.05)


def run_router(args: RouterArgs) -> int:
    config = uvicorn.Config(build_app(args), host=args.host, port=args.port, log_level=args.log_level,
                            access_log=False, timeout_graceful_shutdown=30)
    uvicorn.Server(config).run()
    return 0
