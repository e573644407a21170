"""Fixtures: three live `pagoda serve` replicas (tiny random Llama) and `pagoda router` processes in front."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "server"))  # live_server.py

from live_router import RouterProcess, start_replica, start_router  # noqa: E402
from live_server import API_KEY  # noqa: E402


@pytest.fixture(scope="module")
def replicas(tiny_llama_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("replicas")
    started = [start_replica(tiny_llama_dir, log_dir) for _ in range(3)]
    try:
        for replica in started:
            replica.wait_ready()
        yield started
    finally:
        for replica in started:
            replica.stop()


@pytest.fixture(scope="module")
def router_factory(replicas, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("router")
    started: list[RouterProcess] = []

    def start(policy: str, *flags: str, backends=None, ready: int | None = None) -> RouterProcess:
        urls = [r if isinstance(r, str) else r.url for r in (backends or replicas)]
        router = start_router(log_dir, "--policy", policy, *[a for u in urls for a in ("--backend", u)], *flags,
                              env={"PAGODA_API_KEY": API_KEY})
        started.append(router)
        try:
            router.wait_ready(len(urls) if ready is None else ready)
        except BaseException:
            router.stop()
            raise
        return router

    yield start
    for router in started:
        router.stop()
