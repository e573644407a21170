"""The Endpoint Picker's answers over real gRPC, from a router whose backends' states are set by the test
(no replicas): 429 when every backend's queue is at the bound, the least-loaded one otherwise, 503 when none
is healthy; the endpoint the gateway says served a request is where the policy records it."""

import argparse
import asyncio
import json

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from live_server import free_port

from pagoda.router.backends import BackendPool
from pagoda.router.epp import EPPServer
from pagoda.router.policies import make_policy
from pagoda.router.proxy import Router, RouterConfig, routing_request

pytestmark = pytest.mark.server


async def ask(port: int, metadata: base_pb2.Metadata | None = None) -> ext_proc.ProcessingResponse:
    headers = ext_proc.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions")]))
    body = ext_proc.HttpBody(body=b'{"model": "m", "prompt": "hi"}', end_of_stream=True)
    first = ext_proc.ProcessingRequest(request_headers=headers)
    if metadata is not None:
        first.metadata_context.CopyFrom(metadata)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = ext_proc_grpc.ExternalProcessorStub(channel).Process(
            iter([first, ext_proc.ProcessingRequest(request_body=body)]))
        return [answer async for answer in call][-1]


def test_queue_bound_429_least_loaded_and_503():
    async def scenario():
        pool = BackendPool(["http://10.0.0.1:8000", "http://10.0.0.2:8000"])
        a, b = pool.all()
        router = Router(pool, make_policy("least-load"), RouterConfig(policy="least-load"))
        server = EPPServer(router, "127.0.0.1", free_port(), max_queue=4, session_header="x-session-id")
        await server.start()
        try:
            a.mark_up(), b.mark_up()
            a.waiting, b.waiting = 4, 4
            answer = await ask(server.port)
            assert answer.immediate_response.status.code == 429
            b.waiting = 3
            answer = await ask(server.port)
            endpoint = answer.request_body.response.header_mutation.set_headers[0].header.raw_value
            assert endpoint == b"10.0.0.2:8000"
            a.mark_down("test"), b.mark_down("test")
            assert (await ask(server.port)).immediate_response.status.code == 503
        finally:
            await server.stop()

    asyncio.run(scenario())


def test_the_endpoint_that_served_is_what_the_policy_learns():
    """Protocol v1.0: the gateway reports the endpoint that served (envoy.lb / x-gateway-destination-endpoint-
    served) with the response headers; a request the gateway sent to a fallback is recorded there."""
    prompt = "You are a careful assistant. " * 12

    async def scenario():
        pool = BackendPool(["http://10.0.0.1:8000", "http://10.0.0.2:8000"])
        a, b = pool.all()
        router = Router(pool, make_policy("prefix"), RouterConfig(policy="prefix"))
        server = EPPServer(router, "127.0.0.1", free_port(), max_queue=4, session_header="x-session-id")
        await server.start()
        try:
            a.mark_up(), b.mark_up()
            b.in_flight = 1  # the picker prefers a
            served = base_pb2.Metadata()
            served.filter_metadata["envoy.lb"].update({"x-gateway-destination-endpoint-served": "10.0.0.2:8000"})
            headers = ext_proc.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
                base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions")]))
            body = ext_proc.HttpBody(body=json.dumps({"model": "m", "prompt": prompt}).encode(), end_of_stream=True)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                call = ext_proc_grpc.ExternalProcessorStub(channel).Process(iter([
                    ext_proc.ProcessingRequest(request_headers=headers),
                    ext_proc.ProcessingRequest(request_body=body),
                    ext_proc.ProcessingRequest(response_headers=ext_proc.HttpHeaders(), metadata_context=served)]))
                answers = [answer async for answer in call]
            picked = answers[1].request_body.response.header_mutation.set_headers[0].header.raw_value
            assert picked == b"10.0.0.1:8000" and answers[2].HasField("response_headers")
            hashes = routing_request(body.body, {}, "x-session-id").hashes()
            assert router.policy.index.match(b.url, hashes) == len(hashes) > 0  # where it was served
        finally:
            await server.stop()

    asyncio.run(scenario())


def test_fallbacks_follow_the_choice_least_loaded_first_within_the_subset():
    async def scenario():
        pool = BackendPool(["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"])
        a, b, c = pool.all()
        router = Router(pool, make_policy("least-load"), RouterConfig(policy="least-load"))
        server = EPPServer(router, "127.0.0.1", free_port(), max_queue=4, session_header="x-session-id",
                           fallbacks=1)
        await server.start()
        try:
            for backend, load in ((a, 1), (b, 3), (c, 2)):
                backend.mark_up()
                backend.in_flight = load
            answer = await ask(server.port)
            header = answer.request_body.response.header_mutation.set_headers[0].header
            assert (header.key, header.raw_value) == ("x-gateway-destination-endpoint", b"10.0.0.1:8000,10.0.0.3:8000")
            metadata = answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields
            assert metadata["x-gateway-destination-endpoint"].string_value == "10.0.0.1:8000,10.0.0.3:8000"
            # a subset hint bounds the fallbacks too
            subset = base_pb2.Metadata()
            subset.filter_metadata["envoy.lb.subset_hint"].update(
                {"x-gateway-destination-endpoint-subset": ["10.0.0.2:8000", "10.0.0.3:8000"]})
            answer = await ask(server.port, subset)
            endpoint = answer.request_body.response.header_mutation.set_headers[0].header.raw_value
            assert endpoint == b"10.0.0.3:8000,10.0.0.2:8000"
        finally:
            await server.stop()

    asyncio.run(scenario())


def test_epp_fallbacks_flag(capsys):
    from pagoda.router.cli import add_router_arguments, router_args

    def parse(*argv):
        parser = argparse.ArgumentParser()
        add_router_arguments(parser)
        return router_args(parser, parser.parse_args(["--backend", "http://10.0.0.1:8000", *argv]))

    assert parse().epp_fallbacks == 0 and parse("--epp-fallbacks", "2").epp_fallbacks == 2
    with pytest.raises(SystemExit):
        parse("--epp-fallbacks", "-1")
    assert "--epp-fallbacks" in capsys.readouterr().err


async def hold_streams(port: int, bodies: list[bytes], pool: BackendPool, finish_first: int = 0):
    """Opens one ext_proc stream per body at once and reads each one's choice; the streams stay open (their
    requests in flight) until every one has its choice. The first `finish_first` streams then report their
    response complete (the last body chunk) before they close. Returns the endpoints picked (in the order of
    the bodies) and each backend's in_flight while all were open."""
    release = asyncio.Event()
    picked: list[bytes | None] = [None] * len(bodies)
    all_picked = asyncio.Event()
    headers = ext_proc.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions")]))

    async def one(channel, i: int) -> None:
        async def requests():
            yield ext_proc.ProcessingRequest(request_headers=headers)
            yield ext_proc.ProcessingRequest(request_body=ext_proc.HttpBody(body=bodies[i], end_of_stream=True))
            await release.wait()
            if i < finish_first:
                yield ext_proc.ProcessingRequest(response_body=ext_proc.HttpBody(body=b"{}", end_of_stream=True))

        call = ext_proc_grpc.ExternalProcessorStub(channel).Process(requests())
        await call.read()  # the headers' answer
        answer = await call.read()
        picked[i] = answer.request_body.response.header_mutation.set_headers[0].header.raw_value
        if all(p is not None for p in picked):
            all_picked.set()
        while await call.read() is not grpc.aio.EOF:  # the rest, until the picker ends the stream
            pass

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        tasks = [asyncio.create_task(one(channel, i)) for i in range(len(bodies))]
        await asyncio.wait_for(all_picked.wait(), timeout=30)
        chosen, in_flight = list(picked), [backend.in_flight for backend in pool.all()]
        release.set()
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
    return chosen, in_flight


@pytest.mark.parametrize("policy", ["least-load", "prefix"])
def test_a_burst_between_scrapes_spreads_over_the_pods(policy):
    """Nine requests at once, before any /metrics scrape: each one picked counts in its pod's in_flight until
    its stream ends, so least-load and the prefix policy's load bound spread them (they all went to the pod
    that looked idle, or that held the prompt, while the picker counted nothing); the counts return to 0."""
    prompt = "You are a careful assistant. " * 12
    body = json.dumps({"model": "m", "prompt": prompt}).encode()

    async def scenario():
        pool = BackendPool(["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"])
        a, b, c = pool.all()
        router = Router(pool, make_policy(policy), RouterConfig(policy=policy))
        server = EPPServer(router, "127.0.0.1", free_port(), max_queue=100, session_header="x-session-id")
        await server.start()
        try:
            for backend in (a, b, c):
                backend.mark_up()
            b.waiting = c.waiting = 1  # the last scrape: a looked idle
            picked, during = await hold_streams(server.port, [body] * 9, pool, finish_first=3)
            return picked, during, [x.in_flight for x in (a, b, c)]
        finally:
            await server.stop()

    picked, during, after = asyncio.run(scenario())
    counts = [picked.count(endpoint) for endpoint in (b"10.0.0.1:8000", b"10.0.0.2:8000", b"10.0.0.3:8000")]
    if policy == "least-load":
        assert min(counts) > 0 and max(counts) <= 4, counts
    else:  # the pods that took the prompt hold it too: the bound spreads the burst over two of them
        assert max(counts) <= 6 and sorted(counts)[1] > 0, counts
    assert during == counts and after == [0, 0, 0]


def test_a_complete_response_ends_the_count_before_the_stream_closes():
    async def scenario():
        pool = BackendPool(["http://10.0.0.1:8000"])
        (a,) = pool.all()
        a.mark_up()
        router = Router(pool, make_policy("least-load"), RouterConfig(policy="least-load"))
        server = EPPServer(router, "127.0.0.1", free_port(), max_queue=4, session_header="x-session-id")
        await server.start()
        try:
            headers = ext_proc.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
                base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions")]), end_of_stream=True)
            done, close = asyncio.Event(), asyncio.Event()

            async def requests():
                yield ext_proc.ProcessingRequest(request_headers=headers)
                await done.wait()
                yield ext_proc.ProcessingRequest(response_body=ext_proc.HttpBody(body=b"{}", end_of_stream=True))
                await close.wait()

            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                call = ext_proc_grpc.ExternalProcessorStub(channel).Process(requests())
                await call.read()
                during = a.in_flight
                done.set()
                await call.read()  # the response body's answer: the picker has seen it
                after_response = a.in_flight
                close.set()
                while await call.read() is not grpc.aio.EOF:
                    pass
            return during, after_response, a.in_flight
        finally:
            await server.stop()

    assert asyncio.run(scenario()) == (1, 0, 0)


def test_a_request_served_elsewhere_counts_there():
    """The gateway retried on another endpoint (protocol v1.0 reports it): the request's in-flight count
    moves there until its stream ends."""
    async def scenario():
        pool = BackendPool(["http://10.0.0.1:8000", "http://10.0.0.2:8000"])
        a, b = pool.all()
        router = Router(pool, make_policy("least-load"), RouterConfig(policy="least-load"))
        server = EPPServer(router, "127.0.0.1", free_port(), max_queue=4, session_header="x-session-id")
        await server.start()
        try:
            a.mark_up(), b.mark_up()
            b.in_flight = 1  # the picker prefers a
            served = base_pb2.Metadata()
            served.filter_metadata["envoy.lb"].update({"x-gateway-destination-endpoint-served": "10.0.0.2:8000"})
            headers = ext_proc.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
                base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions")]), end_of_stream=True)
            answered, close = asyncio.Event(), asyncio.Event()

            async def requests():
                yield ext_proc.ProcessingRequest(request_headers=headers)
                await answered.wait()
                yield ext_proc.ProcessingRequest(response_headers=ext_proc.HttpHeaders(), metadata_context=served)
                await close.wait()

            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                call = ext_proc_grpc.ExternalProcessorStub(channel).Process(requests())
                await call.read()
                picked = (a.in_flight, b.in_flight)
                answered.set()
                await call.read()  # the response headers' answer
                moved = (a.in_flight, b.in_flight)
                close.set()
                while await call.read() is not grpc.aio.EOF:
                    pass
            return picked, moved, (a.in_flight, b.in_flight)
        finally:
            await server.stop()

    assert asyncio.run(scenario()) == ((1, 1), (0, 2), (0, 1))
