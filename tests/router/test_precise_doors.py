"""`pagoda router --policy precise` with agent traffic: a multi-turn conversation through each door (chat with
tools and `chat_template_kwargs`, Responses continued by `previous_response_id`, Messages with a system
prompt and tools) goes back to the replica holding its prefix, decided `prefix-match`. Two live replicas
publish KV events; their chat template writes the tools and a template variable into the prompt ahead of
the conversation (tests/agent_template.py), so only the tokens the engine renders match its blocks."""

import json
import time

import httpx
import pytest
from agent_template import AGENT_TEMPLATE, WEATHER_TOOL
from live_router import MODEL, start_replica, start_router
from live_server import API_KEY, free_port

pytestmark = pytest.mark.server

SYSTEM = "You are a weather agent: answer briefly, and call a tool whenever a city is named."  # the tiny BPE: ~1 token a character, 512 positions
PREFIX_MATCH = "pagoda_router:routing_decisions_total{policy=precise,reason=prefix-match}"


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir, tmp_path_factory):
    sockets = tmp_path_factory.mktemp("kv")
    log_dir = tmp_path_factory.mktemp("precise-doors")
    template = log_dir / "agent.jinja"
    template.write_text(AGENT_TEMPLATE)
    ports = [free_port(), free_port()]
    replicas = []
    for port in ports:
        events = {"enable_kv_cache_events": True, "endpoint": f"ipc://{sockets}/kv-{port}",
                  "replay_endpoint": f"ipc://{sockets}/replay-{port}"}
        replicas.append(start_replica(tiny_llama_dir, log_dir, port, "--kv-events-config", json.dumps(events),
                                      "--chat-template", str(template), "--enable-auto-tool-choice",
                                      "--tool-call-parser", "hermes"))
    router = None
    try:
        for r in replicas:
            r.wait_ready()
        router = start_router(log_dir, "--policy", "precise", "--backend", replicas[0].url, "--backend",
                              replicas[1].url, "--kv-events-endpoint", f"ipc://{sockets}/kv-{{port}}",
                              "--kv-events-replay-endpoint", f"ipc://{sockets}/replay-{{port}}",
                              env={"PAGODA_API_KEY": API_KEY})
        router.wait_ready(2)
        yield router
    finally:
        if router is not None:
            router.stop()
        for r in replicas:
            r.stop()


def blocks_of(router, backend: str) -> int:
    return httpx.get(router.url + "/debug/kv-index", timeout=5).json().get(backend, {}).get("blocks", 0)


def stored_more(router, backend: str, than: int, timeout: float = 30.0) -> None:
    """Until the router's index holds more of `backend`'s blocks than `than` (the prompt's blocks are stored
    in one step, and their events arrive async)."""
    deadline = time.monotonic() + timeout
    while blocks_of(router, backend) <= than:
        assert time.monotonic() < deadline, f"{backend}'s events did not reach the router"
        time.sleep(0.2)


class Turns:
    """Each request's backend, and whether the router decided it by prefix-match."""

    def __init__(self, router):
        self.router = router

    def __call__(self, send, first: bool = False) -> tuple[str, bool, object]:
        """Send a turn: (its backend, decided by prefix-match, the reply); a conversation's first turn
        returns once the router's index has its blocks."""
        before = self.router.metrics().get(PREFIX_MATCH, 0)
        held = {url: entry.get("blocks", 0) for url, entry in
                httpx.get(self.router.url + "/debug/kv-index", timeout=5).json().items()}
        raw = send()
        matched = self.router.metrics().get(PREFIX_MATCH, 0) > before
        backend = raw.headers["x-pagoda-backend"]
        if first:
            stored_more(self.router, backend, held.get(backend, 0))
        return backend, matched, raw.parse()


def test_chat_with_tools_follows_its_prefix(cluster):
    client, turn = cluster.client(), Turns(cluster)
    extra = {"chat_template_kwargs": {"persona": "a terse forecaster"}, "ignore_eos": True}
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Weather in Paris today?"}]
    ask = lambda: client.chat.completions.with_raw_response.create(  # noqa: E731
        model=MODEL, messages=messages, tools=[WEATHER_TOOL], max_tokens=4, temperature=0, extra_body=extra)
    first, _, answer = turn(ask, first=True)
    messages += [{"role": "assistant", "content": answer.choices[0].message.content or ""},
                 {"role": "user", "content": "And tomorrow?"}]
    second, matched, _ = turn(ask)
    assert (second, matched) == (first, True)


def test_responses_with_previous_response_id_follow_their_prefix(cluster):
    client, turn = cluster.client(), Turns(cluster)
    tools = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
              "parameters": WEATHER_TOOL["function"]["parameters"]}]
    first, _, response = turn(lambda: client.responses.with_raw_response.create(
        model=MODEL, instructions=SYSTEM, input="Weather in Oslo today?", tools=tools, max_output_tokens=4,
        temperature=0), first=True)
    second, matched, _ = turn(lambda: client.responses.with_raw_response.create(
        model=MODEL, instructions=SYSTEM, previous_response_id=response.id, input="And in Bergen?", tools=tools,
        max_output_tokens=4, temperature=0))
    assert (second, matched) == (first, True)


def test_messages_with_a_system_prompt_follow_their_prefix(cluster):
    import anthropic

    client = anthropic.Anthropic(base_url=cluster.url, api_key=API_KEY, max_retries=0, timeout=60)
    turn = Turns(cluster)
    tools = [{"name": "get_weather", "description": "The weather in a city",
              "input_schema": WEATHER_TOOL["function"]["parameters"]}]
    messages = [{"role": "user", "content": "Weather in Rome today?"}]
    ask = lambda: client.messages.with_raw_response.create(  # noqa: E731
        model=MODEL, system=SYSTEM, messages=messages, tools=tools, max_tokens=4)
    first, _, message = turn(ask, first=True)
    text = "".join(block.text for block in message.content if block.type == "text")
    messages += [{"role": "assistant", "content": text or "Let me look."},
                 {"role": "user", "content": "Should I take an umbrella?"}]
    second, matched, _ = turn(ask)
    assert (second, matched) == (first, True)


@pytest.mark.parametrize("path, body, expected", [
    ("/v1/chat/completions", {"model": "m", "messages": [], "tools": []}, "/v1/chat/completions"),
    ("/v1/responses", {"model": "m", "input": "hi", "previous_response_id": "resp_1"}, "/v1/responses"),
    ("/v1/messages", {"model": "m", "system": "s", "messages": []}, "/v1/messages"),
    (None, {"model": "m", "messages": []}, "/v1/chat/completions"),  # no path known: a chat body
])
def test_the_router_sends_the_doors_own_body(path, body, expected):
    from pagoda.router.precise import tokenize_query
    from pagoda.router.proxy import routing_request

    request = routing_request(json.dumps(body).encode(), {}, "x-session-id", path)
    assert tokenize_query(request) == {"model": "m", "endpoint": expected, "request": body}


def test_the_epp_finds_the_door_in_envoys_path_header():
    from pagoda.router.precise import tokenize_query
    from pagoda.router.proxy import routing_request

    body = {"model": "m", "input": "hi"}
    request = routing_request(json.dumps(body).encode(), {":path": "/v1/responses?x=1"}, "x-session-id")
    assert tokenize_query(request)["endpoint"] == "/v1/responses"
    completion = routing_request(b'{"model": "m", "prompt": "hi"}', {":path": "/v1/completions"}, "x-session-id")
    assert tokenize_query(completion) == {"model": "m", "prompt": "hi"}


async def test_a_responses_follow_up_is_tokenized_where_its_history_is_stored():
    """The first replica asked does not hold the previous response (404): the next one is asked."""
    import aiohttp
    from aiohttp import web

    from pagoda.router.backends import Backend
    from pagoda.router.policies import RoutingRequest
    from pagoda.router.precise import Precise

    asked = []

    def replica(name: str, status: int):
        async def tokenize(request: web.Request) -> web.Response:
            asked.append((name, await request.json()))
            return web.json_response({"tokens": [1, 2, 3]} if status == 200 else {"error": {}}, status=status)

        app = web.Application()
        app.router.add_post("/tokenize", tokenize)
        return app

    runners = []
    try:
        urls = []
        for name, status in (("elsewhere", 404), ("holder", 200)):
            runner = web.AppRunner(replica(name, status))
            await runner.setup()
            port = free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            runners.append(runner)
            urls.append(f"http://127.0.0.1:{port}")
        body = {"model": "m", "input": "and then?", "previous_response_id": "resp_1"}
        request = RoutingRequest(body=body, path="/v1/responses")
        async with aiohttp.ClientSession() as session:
            await Precise().prepare(request, [Backend(url, healthy=True) for url in urls], session)
        assert request.token_ids == [1, 2, 3]
        assert [name for name, _ in asked] == ["elsewhere", "holder"]
        assert asked[0][1] == {"model": "m", "endpoint": "/v1/responses", "request": body}
    finally:
        for runner in runners:
            await runner.cleanup()
