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

from pagoda.http.connections import IDLE_KEEP_ALIVE_SECONDS
from pagoda.http.errors import error_response, install_error_handlers
from pagoda.http.middleware import RequestIdMiddleware, request_id_of
from pagoda.router.args import RouterArgs
from pagoda.router.backends import BackendPool
from pagoda.router.disaggregated import PREFILL_METRICS_PREFIX, DisaggregatedResponse, Disaggregation
from pagoda.router.health import HealthMonitor
from pagoda.router.metrics import CONTENT_TYPE
from pagoda.router.policies import make_policy
from pagoda.router.precise import Precise
from pagoda.router.proxy import ProxyResponse, Router, RouterConfig, routing_request, upstream_headers

logger = logging.getLogger(__name__)
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]


def _discovery(service: str | None, namespace: str | None, router: Router):
    if service is None:
        return None
    from pagoda.router.kubernetes import EndpointSliceWatcher

    def update(urls: list[str]) -> None:
        added, removed = router.pool.set_urls(urls)
        for url in removed:
            router.policy.forget(url)
        if added or removed:
            logger.info("backends of service %s: +%s -%s", service, added, removed)

    return EndpointSliceWatcher(service, namespace, update).run()


def _disaggregation(args: RouterArgs, router: Router):
    """P/D mode: the prefill backends, their policy, and the choice (None without prefill backends)."""
    if not args.disaggregated:
        return None
    policy = Precise() if args.prefill_policy == "precise" else make_policy(args.prefill_policy)
    prefill = Router(BackendPool(args.prefill_backends), policy, RouterConfig(
        policy=args.prefill_policy, max_in_flight_per_backend=args.max_in_flight_per_backend,
        session_header=args.session_header), metrics_prefix=PREFILL_METRICS_PREFIX)
    return Disaggregation(prefill, args.pd_threshold, router.metrics.registry, timeout_s=args.prefill_timeout)


def build_app(args: RouterArgs) -> FastAPI:
    pool = BackendPool(args.backends)
    policy = Precise() if args.policy == "precise" else make_policy(args.policy)
    router = Router(pool, policy, RouterConfig(
        policy=args.policy, max_in_flight_per_backend=args.max_in_flight_per_backend,
        session_header=args.session_header))
    monitor = HealthMonitor(pool, router.backend_changed, api_key=args.backend_api_key)
    pd = _disaggregation(args, router)
    prefill_monitor = None if pd is None else HealthMonitor(pd.prefill.pool, pd.prefill.backend_changed,
                                                            api_key=args.backend_api_key)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await router.start()
        loops = [monitor.run()]
        discovery = _discovery(args.k8s_service, args.namespace, router)
        if discovery is not None:
            loops.append(discovery)
        if pd is not None:
            await pd.prefill.start()
            loops.append(prefill_monitor.run())
            prefill_discovery = _discovery(args.prefill_k8s_service, args.namespace, pd.prefill)
            if prefill_discovery is not None:
                loops.append(prefill_discovery)
        for precise in [r for r in (router, pd.prefill if pd else None) if r and r.policy.name == "precise"]:
            from pagoda.router.kv_subscriber import KVEventSubscriber

            loops.append(KVEventSubscriber(precise.pool, precise.policy.index, args.kv_events_endpoint,
                                           args.kv_events_replay_endpoint, args.kv_events_topic).run())
        tasks = [asyncio.create_task(loop) for loop in loops]
        epp = None
        if args.epp:
            from pagoda.router.epp import EPPServer

            epp = EPPServer(router, args.host, args.epp_port, args.epp_max_queue, args.session_header,
                            args.epp_fallbacks, pd)
            await epp.set_serving(False)
            await epp.start()
        await monitor_first_round(monitor)
        if prefill_monitor is not None:
            await monitor_first_round(prefill_monitor)
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
            if pd is not None:
                await pd.prefill.close()

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
        prefill = b"" if pd is None else pd.prefill.metrics.render()  # its own names: pagoda_router:prefill_*
        return Response(router.metrics.render() + prefill, media_type=CONTENT_TYPE)

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
        forwarded = (router, request.method, target, upstream_headers(request.scope["headers"], request_id_of(request)),
                     body, routing_request(body, headers, router.config.session_header, request.url.path), arrived)
        if pd is not None:
            return DisaggregatedResponse(pd, *forwarded)
        return ProxyResponse(*forwarded)

    return app


async def monitor_first_round(monitor: HealthMonitor) -> None:
    """Wait (briefly) for the first probes, so backends that are up are in the rotation from the start."""
    for _ in range(40):
        if monitor.rounds > 0:
            return
        await asyncio.sleep(0.05)


def run_router(args: RouterArgs) -> int:
    config = uvicorn.Config(build_app(args), host=args.host, port=args.port, log_level=args.log_level,
                            access_log=False, timeout_graceful_shutdown=30, timeout_keep_alive=IDLE_KEEP_ALIVE_SECONDS)
    uvicorn.Server(config).run()
    return 0
