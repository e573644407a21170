"""`pagoda router --policy precise` on two live replicas publishing KV events (tiny Llama, a KV cache small
enough to evict): conversations go where their blocks are; the router's index agrees with each engine's own
count of cached blocks after a run with evictions, and after a replica restarts."""

import json
import time

import httpx
import pytest
from live_router import MODEL, scrape, start_replica, start_router
from live_server import API_KEY, free_port

pytestmark = pytest.mark.server

BLOCKS = 48  # the tiny llama's KV block is 8 KiB: 48 blocks of 16 tokens
KV_MEMORY = str(BLOCKS * 8192 / 2**30)


def events_flags(directory, port: int) -> list[str]:
    config = {"enable_kv_cache_events": True, "endpoint": f"ipc://{directory}/kv-{port}",
              "replay_endpoint": f"ipc://{directory}/replay-{port}"}
    return ["--kv-events-config", json.dumps(config)]


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir, tmp_path_factory):
    sockets = tmp_path_factory.mktemp("kv")
    log_dir = tmp_path_factory.mktemp("precise")
    ports = [free_port(), free_port()]
    replicas = [start_replica(tiny_llama_dir, log_dir, p, *events_flags(sockets, p), kv_cache_memory=KV_MEMORY)
                for p in ports]
    router = None
    try:
        for r in replicas:
            r.wait_ready()
        router = start_router(log_dir, "--policy", "precise", "--backend", replicas[0].url, "--backend",
                              replicas[1].url, "--kv-events-endpoint", f"ipc://{sockets}/kv-{{port}}",
                              "--kv-events-replay-endpoint", f"ipc://{sockets}/replay-{{port}}",
                              env={"PAGODA_API_KEY": API_KEY})
        router.wait_ready(2)
        yield {"router": router, "replicas": replicas, "sockets": sockets, "log_dir": log_dir,
               "model": tiny_llama_dir}
    finally:
        if router is not None:
            router.stop()
        for r in replicas:
            r.stop()


def complete(router, prompt: str, max_tokens: int = 4) -> str:
    raw = router.client().completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
    return raw.headers["x-pagoda-backend"]


def index_of(router) -> dict:
    return httpx.get(router.url + "/debug/kv-index", timeout=5).json()


def wait_agreement(router, replicas, timeout: float = 30.0) -> dict:
    """Until the index's count for each replica is within 1 % of the engine's own (events arrive async)."""
    deadline = time.monotonic() + timeout
    while True:
        index = index_of(router)
        engine = {r.url: scrape(r.url)["pagoda:prefix_cache_blocks"] for r in replicas}
        held = {url: index.get(url, {}).get("blocks", -1) for url in engine}
        if all(abs(held[u] - engine[u]) <= 0.01 * max(engine[u], 1) for u in engine):
            return {"index": index, "engine": engine}
        assert time.monotonic() < deadline, f"index {held} vs engines {engine}"
        time.sleep(0.2)


def test_conversations_follow_their_blocks(cluster):
    router = cluster["router"]
    heads = [f"Conversation {i} opens with its own long context: " + "lorem ipsum " * 12 for i in range(4)]
    first = [complete(router, head) for head in heads]
    wait_agreement(router, cluster["replicas"])
    again = [complete(router, head + " and a follow-up question") for head in heads]
    assert again == first
    m = router.metrics()
    assert m.get("pagoda_router:routing_decisions_total{policy=precise,reason=prefix-match}", 0) >= 4


def test_index_matches_the_engines_after_evictions(cluster):
    router, replicas = cluster["router"], cluster["replicas"]
    for i in range(24):  # far more distinct blocks than 2 x 48: the engines evict
        complete(router, f"Distinct prompt {i}: " + f"{i} filler words " * 10, max_tokens=8)
    state = wait_agreement(router, replicas)
    assert all(v > 0 for v in state["engine"].values())
    assert sum(scrape(r.url)["pagoda:prefix_cache_queries_total"] for r in replicas) > 0
    assert all(e["gaps"] == 0 for e in state["index"].values())


def test_a_restarted_replica_starts_empty_in_the_index(cluster):
    router, replicas = cluster["router"], cluster["replicas"]
    victim = replicas[1]
    victim.stop()
    restarted = start_replica(cluster["model"], cluster["log_dir"], victim.port,
                              *events_flags(cluster["sockets"], victim.port), kv_cache_memory=KV_MEMORY)
    replicas[1] = restarted
    restarted.wait_ready()
    router.wait_ready(2)
    for i in range(6):
        complete(router, f"After the restart {i}: " + "words " * 20)
    state = wait_agreement(router, replicas)
    entry = state["index"][restarted.url]
    assert entry["restarts"] + entry["clears"] >= 1
