"""The routing policies, the prefix index and the router's flags, without a server."""

import json

import pytest

from pagoda.router.backends import Backend, BackendPool, normalize_url
from pagoda.router.health import parse_load
from pagoda.router.policies import LeastLoad, Prefix, RoundRobin, RoutingRequest, Session, make_policy
from pagoda.router.prefix_index import BLOCK_CHARS, PrefixIndex, block_hashes
from pagoda.router.proxy import prompt_text, routing_request

pytestmark = pytest.mark.unit


def backends(n: int = 3) -> list[Backend]:
    return [Backend(f"http://10.0.0.{i}:8000", healthy=True) for i in range(n)]


def test_round_robin_cycles():
    policy, pool = RoundRobin(), backends()
    chosen = [policy.choose(RoutingRequest(), pool).backend.url for _ in range(6)]
    assert len(set(chosen[:3])) == 3 and chosen[:3] == chosen[3:]


def test_least_load_counts_in_flight_queue_and_full_cache():
    pool = backends()
    pool[0].in_flight, pool[1].waiting, pool[2].kv_usage = 2, 1, 0.95
    assert LeastLoad().choose(RoutingRequest(), pool).backend is pool[2]  # 0.5 < 1 < 2
    pool[2].kv_usage = 1.0  # 1 full cache = 1 waiting request: ties spread
    assert {LeastLoad().choose(RoutingRequest(), pool).backend.url for _ in range(2)} <= {pool[1].url, pool[2].url}


def test_block_hashes_are_a_chain_over_full_blocks():
    a = "x" * BLOCK_CHARS * 3 + "tail"
    assert len(block_hashes(a)) == 3
    b = "y" + a[1:]
    assert not set(block_hashes(a)) & set(block_hashes(b))  # a changed first block changes every hash
    assert block_hashes(a + "more")[:3] == block_hashes(a)


def test_prefix_index_matches_leading_blocks_and_evicts_lru():
    index = PrefixIndex(max_blocks_per_backend=4)
    chain = block_hashes("a" * BLOCK_CHARS * 4)
    index.insert("u", chain[:3])
    assert index.match("u", chain) == 3 and index.match("v", chain) == 0
    index.insert("u", block_hashes("b" * BLOCK_CHARS * 2))  # 5 blocks > 4: the oldest goes
    assert index.match("u", chain) == 0


def test_prefix_sticks_then_balances_past_the_bound():
    policy, pool = Prefix(), backends()
    conversation = "system: " + "be helpful. " * 40
    first = policy.choose(RoutingRequest(conversation), pool)
    assert first.reason == "no-prefix-match"
    policy.routed(RoutingRequest(conversation), first)
    again = policy.choose(RoutingRequest(conversation + " user: next turn"), pool)
    assert again.backend is first.backend and again.reason == "prefix-match"
    assert again.matched_chars >= len(conversation) - BLOCK_CHARS
    first.backend.in_flight = 5  # far past 1.25 x the mean: the least-loaded takes it
    over = policy.choose(RoutingRequest(conversation + " user: next turn"), pool)
    assert over.backend is not first.backend and over.reason == "prefix-overloaded"
    policy.forget(first.backend.url)
    first.backend.in_flight = 0
    assert policy.choose(RoutingRequest(conversation), pool).reason == "no-prefix-match"


def test_session_is_sticky_and_moves_only_when_its_owner_leaves():
    policy, pool = Session(), backends(4)
    owners = {k: policy.choose(RoutingRequest(session_key=k), pool).backend.url for k in map(str, range(40))}
    assert len(set(owners.values())) == 4
    assert all(policy.choose(RoutingRequest(session_key=k), pool).backend.url == u for k, u in owners.items())
    gone = pool.pop()
    moved = {k for k, u in owners.items() if policy.choose(RoutingRequest(session_key=k), pool).backend.url != u}
    assert moved == {k for k, u in owners.items() if u == gone.url}
    assert policy.choose(RoutingRequest(), pool).reason == "no-session-key"


def test_routing_request_reads_chat_completion_and_user():
    req = routing_request(b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "user": "bob"}',
                          {}, "x-session-id")
    assert req.session_key == "bob" and req.model == "m" and "hi" in req.prefix_text
    assert routing_request(b'{"prompt": "p"}', {"x-session-id": "s"}, "x-session-id").session_key == "s"
    assert routing_request(b"not json", {}, "x-session-id").prefix_text is None
    # a conversation's text grows at the end: turn 2's text starts with turn 1's
    turn1 = prompt_text({"model": "m", "messages": [{"role": "user", "content": "a"}]})
    turn2 = prompt_text({"model": "m", "messages": [{"role": "user", "content": "a"},
                                                    {"role": "assistant", "content": "b"}]})
    assert turn2.startswith(turn1)
    assert prompt_text({"model": "m", "prompt": [1, 2, 3]}).endswith("1,2,3")


def test_backend_urls_and_pool_membership():
    assert normalize_url("10.0.0.1:8000") == "http://10.0.0.1:8000"
    assert normalize_url("http://h:1/") == "http://h:1"
    for bad in ("ftp://h", "http://h:1/v1", "http://h:99999"):
        with pytest.raises(ValueError, match="--backend"):
            normalize_url(bad)
    pool = BackendPool(["http://a:1", "http://b:1"])
    pool.get("http://a:1").in_flight = 3
    assert pool.set_urls(["http://a:1", "http://c:1"]) == (["http://c:1"], ["http://b:1"])
    assert pool.get("http://a:1").in_flight == 3 and pool.generation == 2
    assert pool.healthy() == []  # new backends wait for their first probe


def test_parse_load_reads_the_servers_gauges():
    text = ('# TYPE pagoda:num_requests_waiting gauge\npagoda:num_requests_waiting{model_name="m"} 3.0\n'
            '# TYPE pagoda:kv_cache_usage_perc gauge\npagoda:kv_cache_usage_perc{model_name="m"} 0.5\n')
    assert parse_load(text) == {"waiting": 3.0, "kv_usage": 0.5}
    # a data-parallel replica: a series per engine, queues summed, cache usage averaged
    dp = ('# TYPE pagoda:num_requests_waiting gauge\npagoda:num_requests_waiting{engine="0",model_name="m"} 3.0\n'
          'pagoda:num_requests_waiting{engine="1",model_name="m"} 1.0\n'
          '# TYPE pagoda:kv_cache_usage_perc gauge\npagoda:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
          'pagoda:kv_cache_usage_perc{engine="1",model_name="m"} 0.25\n')
    assert parse_load(dp) == {"waiting": 4.0, "kv_usage": 0.375}


def test_unknown_policy_and_missing_backends_are_usage_errors(capsys):
    from pagoda.entrypoints.cli import main

    with pytest.raises(ValueError, match="--policy"):
        make_policy("random")
    for argv, message in ((["router"], "--backend URL"), (["router", "--backend", "http://h:1/v1"], "no path"),
                          (["router", "--policy", "fastest", "--backend", "h:1"], "--policy"),
                          (["router", "--namespace", "x", "--backend", "h:1"], "--namespace goes with")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        assert message in capsys.readouterr().err


def test_router_prefers_backends_serving_the_model_and_rejects_when_full():
    from pagoda.http.errors import APIError
    from pagoda.router.proxy import Router, RouterConfig

    pool = BackendPool(["http://a:1", "http://b:1"])
    router = Router(pool, LeastLoad(), RouterConfig(max_in_flight_per_backend=2))
    with pytest.raises(APIError) as e:
        router.choose(RoutingRequest(), set())
    assert e.value.status == 503 and e.value.headers == {"Retry-After": "1"}
    a, b = pool.get("http://a:1"), pool.get("http://b:1")
    a.mark_up(), b.mark_up()
    a.models, b.models = frozenset({"base", "sql-lora"}), frozenset({"base"})
    b.in_flight = 0
    a.in_flight = 1  # busier, but the only one with the adapter resident
    assert router.choose(RoutingRequest(model="sql-lora"), set()).backend is a
    assert router.choose(RoutingRequest(model="base"), set()).backend is b
    assert router.choose(RoutingRequest(model="unknown"), set()).backend is b  # nobody lists it: any
    assert router.choose(RoutingRequest(), {b.url}).backend is a  # a retry skips the failed backend
    a.in_flight = b.in_flight = 2
    with pytest.raises(APIError) as e:
        router.choose(RoutingRequest(), set())
    assert e.value.status == 429 and e.value.code == "saturated"


def test_flags_beat_the_environment(monkeypatch):
    from pagoda.entrypoints.cli import build_parser
    from pagoda.router.cli import router_args

    monkeypatch.setenv("PAGODA_ROUTER_BACKEND", "http://env-a:1,http://env-b:1")
    monkeypatch.setenv("PAGODA_ROUTER_POLICY", "session")
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices["router"]
    args = router_args(sub, parser.parse_args(["router"]))
    assert args.backends == ["http://env-a:1", "http://env-b:1"] and args.policy == "session"
    args = router_args(sub, parser.parse_args(["router", "--backend", "flag:2", "--policy", "prefix"]))
    assert args.backends == ["http://flag:2"] and args.policy == "prefix"
    monkeypatch.setenv("PAGODA_ROUTER_PORT", "eighty")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["router"])


def test_prefix_balances_a_new_conversation_that_matches_only_a_shared_system_prompt():
    policy, pool = Prefix(), backends(3)
    system = "system: " + "be helpful. " * 20  # ~4 blocks shared by every conversation
    opener = policy.choose(RoutingRequest(system + "user: " + "first document. " * 40), pool)
    policy.routed(RoutingRequest(system + "user: " + "first document. " * 40), opener)
    opener.backend.in_flight = 1
    # a second conversation behind the same system prompt: its match is under half its prompt, so it goes
    # by load, not onto the replica that saw the system prompt
    second = policy.choose(RoutingRequest(system + "user: " + "second document. " * 40), pool)
    assert second.reason == "prefix-short-match" and second.backend is not opener.backend
    # among equally loaded replicas the one holding the system prompt wins
    opener.backend.in_flight = 0
    again = policy.choose(RoutingRequest(system + "user: " + "third document. " * 40), pool)
    assert again.reason == "prefix-short-match" and again.backend is opener.backend


def test_answer_tap_reads_choice_zero_from_streams_and_bodies():
    from pagoda.router.answers import AnswerTap

    def tapped(body: bytes, cut: int = 7) -> AnswerTap:
        tap = AnswerTap()
        for i in range(0, len(body), cut):  # chunk boundaries fall anywhere, mid-line included
            tap.add(body[i:i + cut])
        return tap

    events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
              {"choices": [{"index": 0, "delta": {"content": "Hello"}}]},
              {"choices": [{"index": 0, "delta": {"content": " there"}, "finish_reason": "length"}]},
              {"choices": [], "usage": {"prompt_tokens": 3}}]
    stream = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    assert tapped(stream).text(is_stream=True) == "Hello there"
    error = stream.replace(b"data: [DONE]", b'data: {"error": {"message": "backend failed"}}\n\ndata: [DONE]')
    assert tapped(error).text(is_stream=True) is None
    chat = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi!"}}]}
    assert tapped(json.dumps(chat).encode()).text(is_stream=False) == "Hi!"
    completion = {"choices": [{"index": 0, "text": " and so on"}]}
    assert tapped(json.dumps(completion).encode()).text(is_stream=False) == " and so on"
    assert tapped(b"not json").text(is_stream=False) is None


def test_prefix_follows_a_conversation_through_its_recorded_answer():
    """A short system prompt and a long answer: turn 2's previous prompt is under half of it, so only the
    recorded answer makes it a match (the engine caches the answer's blocks and turn 2 resends them)."""
    def chat(*messages):
        data = {"model": "m", "messages": [{"role": r, "content": c} for r, c in messages]}
        return routing_request(json.dumps(data).encode(), {}, "x-session-id")

    turn1 = [("system", "Be brief."), ("user", "Tell me about the sea. " * 4)]
    answer = "The sea is wide and deep and full of fish. " * 20
    turn2 = [*turn1, ("assistant", answer), ("user", "And rivers?")]
    for record in (False, True):
        policy, pool = Prefix(), backends(3)
        first = policy.choose(chat(*turn1), pool)
        policy.routed(chat(*turn1), first)
        if record:
            policy.answered(chat(*turn1), first, answer)
        first.backend.in_flight = 1  # another conversation's turn runs there now
        second = policy.choose(chat(*turn2), pool)
        assert (second.reason, second.backend is first.backend) == (
            ("prefix-match", True) if record else ("prefix-short-match", False))
    assert chat(*turn1).answer_prefix == "\x1eassistant\x1f"
    assert routing_request(b'{"prompt": "p", "n": 2}', {}, "x").answer_prefix is None
    assert routing_request(b'{"prompt": "p"}', {}, "x").answer_prefix == ""


def test_prefix_balances_conversations_behind_a_long_shared_system_prompt():
    """A system prompt that is most of a first turn: the conversations behind it must not all follow the
    replica that first saw it, while each conversation's own turns (and one edit) still follow it."""
    policy, pool = Prefix(), backends(3)
    system = "system: " + "you answer questions about the sea, briefly and kindly. " * 12

    def send(text, load=1):
        decision = policy.choose(RoutingRequest(text), pool)
        policy.routed(RoutingRequest(text), decision)
        decision.backend.in_flight += load  # still running
        return decision

    openers = [send(system + f"user: question {c} about fish and tides") for c in range(3)]
    assert [d.reason for d in openers] == ["no-prefix-match", "prefix-match", "prefix-shared"]
    assert openers[2].backend is not openers[0].backend  # by load: the third continuation of a shared prefix
    for d in openers:
        d.backend.in_flight = 0
    follow = send(system + "user: question 0 about fish and tides" + " assistant: they swim. user: and whales?")
    assert follow.reason == "prefix-match" and follow.backend is openers[0].backend
    edit = send(system + "user: question 0 about fish and tides" + " assistant: they float. user: really?")
    assert edit.reason == "prefix-match" and edit.backend is openers[0].backend


def test_load_is_read_from_vllm_names_where_pagodas_are_missing():
    from pagoda.router.health import parse_load

    vllm = ("# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name=\"m\"} 3.0\n"
            "# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc{model_name=\"m\"} 0.5\n")
    assert parse_load(vllm) == {"waiting": 3.0, "kv_usage": 0.5}
    both = "# TYPE pagoda:num_requests_waiting gauge\npagoda:num_requests_waiting 2.0\n" + vllm
    assert parse_load(both) == {"waiting": 2.0}  # not counted twice under --metrics-vllm-names
