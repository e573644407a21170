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
