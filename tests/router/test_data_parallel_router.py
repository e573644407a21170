"""`pagoda router` in front of externally balanced DP ranks (`pagoda serve --data-parallel-size 2
--data-parallel-rank R`, each rank its own endpoint, as vLLM's external load balancing): both answer as one
process would, round robin spreads over them, and the precise policy follows each rank's KV events where
rank R publishes them (the configured port + R), so conversations follow their blocks."""

import json
import socket
import time

import httpx
import pytest
from live_router import MODEL, scrape, start_replica, start_router
from live_server import API_KEY

pytestmark = pytest.mark.server

PROMPTS = ["Hello, my name is", "The capital of France is", "one two three four", "Paged attention stores"]


def free_port_pair() -> int:
    """A port p with p + 1 free too (rank 1 publishes on the configured port + 1)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


@pytest.fixture(scope="module")
def ranks(tiny_llama_dir, tmp_path_factory):
    """Two external DP ranks of one model, each with the same KV events config (rank R adds R to its ports)."""
    log_dir = tmp_path_factory.mktemp("dp-ranks")
    events, replay = free_port_pair(), free_port_pair()
    config = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{events}",
                         "replay_endpoint": f"tcp://*:{replay}"})
    started = [start_replica(tiny_llama_dir, log_dir, None, "--data-parallel-size", "2", "--data-parallel-rank",
                             str(rank), "--kv-events-config", config) for rank in (0, 1)]
    router = None
    try:
        for server in started:
            server.wait_ready()
        router = start_router(log_dir, "--policy", "precise", *[a for s in started for a in ("--backend", s.url)],
                              "--kv-events-endpoint", f"tcp://{{host}}:{events}",
                              "--kv-events-replay-endpoint", f"tcp://{{host}}:{replay}",
                              env={"PAGODA_API_KEY": API_KEY})
        router.wait_ready(2)
        yield {"servers": started, "router": router, "log_dir": log_dir}
    finally:
        if router is not None:
            router.stop()
        for server in started:
            server.stop()


def complete(client, prompt: str, max_tokens: int = 8):
    return client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                                       temperature=0, extra_body={"ignore_eos": True})


def test_each_rank_answers_and_round_robin_spreads_over_both(ranks):
    servers = ranks["servers"]
    direct = [[complete(s.client(API_KEY, timeout=60), p).parse().choices[0].text for p in PROMPTS]
              for s in servers]
    assert direct[0] == direct[1]  # independent ranks of one model: greedy text is the same on each
    router = start_router(ranks["log_dir"], "--policy", "round-robin",
                          *[a for s in servers for a in ("--backend", s.url)], env={"PAGODA_API_KEY": API_KEY})
    try:
        router.wait_ready(2)
        raws = [complete(router.client(), p) for p in PROMPTS * 2]
        assert [r.parse().choices[0].text for r in raws] == direct[0] * 2
        served = [r.headers["x-pagoda-backend"] for r in raws]
        assert {served.count(s.url) for s in servers} == {len(PROMPTS)}
    finally:
        router.stop()
    for rank, server in enumerate(servers):  # each labels its series with its own rank
        assert scrape(server.url)["pagoda:e2e_request_latency_seconds_count"] == 2 * len(PROMPTS)
        assert f'engine="{rank}"' in httpx.get(server.url + "/metrics").text


def test_precise_policy_follows_each_ranks_events(ranks):
    router, servers = ranks["router"], ranks["servers"]
    wanted = {servers[0].url, servers[1].url + "#engine=1"}  # rank 1's stream, on the port + 1
    deadline = time.monotonic() + 30
    while set(index := httpx.get(router.url + "/debug/kv-index", timeout=5).json()) != wanted:
        assert time.monotonic() < deadline, f"the router follows {sorted(index)}, not {sorted(wanted)}"
        time.sleep(0.2)
    heads = [f"Conversation {i} opens with its own long context: " + "lorem ipsum " * 12 for i in range(4)]
    first = [complete(router.client(), head, 4).headers["x-pagoda-backend"] for head in heads]
    keys = {servers[0].url: servers[0].url, servers[1].url: servers[1].url + "#engine=1"}
    deadline = time.monotonic() + 30
    while True:  # the index agrees with each rank's own count of cached blocks
        index = httpx.get(router.url + "/debug/kv-index", timeout=5).json()
        engine = {s.url: scrape(s.url)["pagoda:prefix_cache_blocks"] for s in servers}
        if all(index[keys[url]]["blocks"] == engine[url] > 0 for url in engine):
            break
        assert time.monotonic() < deadline, f"index {index} vs engines {engine}"
        time.sleep(0.2)
    again = [complete(router.client(), head + " and a follow-up", 4).headers["x-pagoda-backend"] for head in heads]
    assert again == first
    assert router.metrics().get("pagoda_router:routing_decisions_total{policy=precise,reason=prefix-match}", 0) >= 4
