"""`pagoda router --epp`: the router's choice served as a Gateway API Inference Extension Endpoint Picker.

The gateway (Envoy, or an Envoy-based one) calls this over Envoy's ext_proc gRPC protocol, one stream per
HTTP request. The picker reads the request's headers and body (buffered, streamed, or FULL_DUPLEX_STREAMED as
the extension's gateways configure it: then the bodies pass back through the picker), chooses a backend with
the router's policy among the healthy backends, and answers as the Endpoint Picker protocol says:

- the chosen ``ip:port`` in the ``x-gateway-destination-endpoint`` header and in the dynamic metadata
  ``envoy.lb`` / ``x-gateway-destination-endpoint`` (the same value), for an ORIGINAL_DST cluster; with
  ``--epp-fallbacks N``, followed by up to N other eligible endpoints, least loaded first
  (``ip:port,ip:port,...``, protocol v0.4), for a gateway that retries down the list;
- a subset hint (filter metadata ``envoy.lb.subset_hint`` / ``x-gateway-destination-endpoint-subset``)
  limits the choice to those endpoints;
- 503 (ImmediateResponse) when no backend (of the subset) is ready; 429 when every one's queue is past
  ``--epp-max-queue`` waiting requests (scraped from its /metrics);
- P/D mode (``--prefill-backend`` / ``--prefill-k8s-service``, pagoda.router.disaggregated): the chosen
  endpoint is a decode backend, and a request that takes the P/D path also gets llm-d's
  ``x-prefiller-host-port: ip:port`` header naming a prefill backend (the prefill policy's choice), for the
  routing sidecar beside the decode pod to run the prefill first; a request below ``--pd-threshold``, or with
  no prefill backend ready, gets none (a client's own such header is removed), so it is decoded alone;
- gRPC health (``grpc.health.v1``) for "", ``liveness``, ``readiness`` and the ext_proc service;
- the endpoint that served the request, when the gateway reports it with the response headers (metadata
  ``envoy.lb`` / ``x-gateway-destination-endpoint-served``, protocol v1.0): where it is not the one picked
  (the gateway retried elsewhere), the policy is told the request went there (``Policy.routed``), so what it
  believes each replica holds follows where the work was done.

A picked request counts in its backend's ``in_flight`` (as the proxy's do) from the pick to its stream's end:
the response complete (its last body chunk or trailers), the stream closed, or an error. Least-load and the
prefix policy's load bound so see a burst that arrives between two /metrics scrapes; a request the gateway
reports served elsewhere moves its count there.
"""

from __future__ import annotations

import json
import logging
from contextlib import aclosing
from urllib.parse import urlsplit

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pagoda.router.backends import Backend
from pagoda.router.disaggregated import PREFILLER_HEADER, Disaggregation
from pagoda.router.policies import Decision, RoutingRequest
from pagoda.router.proxy import Router, routing_request

logger = logging.getLogger(__name__)

DESTINATION = "x-gateway-destination-endpoint"
SUBSET = "x-gateway-destination-endpoint-subset"
SERVED = "x-gateway-destination-endpoint-served"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_SERVICES = ("", "liveness", "readiness", EXT_PROC_SERVICE)
FULL_DUPLEX_STREAMED = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


def endpoint_of(backend: Backend) -> str:
    """A backend's `ip:port` (as the gateway's ORIGINAL_DST cluster connects to it)."""
    parts = urlsplit(backend.url)
    host = parts.hostname or ""
    return f"[{host}]:{parts.port}" if ":" in host else f"{host}:{parts.port or 80}"


class Picked(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class InFlight:
    """The backend one stream's request counts against in `Backend.in_flight`, once picked."""

    def __init__(self) -> None:
        self.backend: Backend | None = None

    def start(self, backend: Backend) -> None:
        self.end()
        backend.in_flight += 1
        self.backend = backend

    def end(self) -> None:
        if self.backend is not None:
            self.backend.in_flight -= 1
            self.backend = None


class EndpointPicker(ext_proc_grpc.ExternalProcessorServicer):
    def __init__(self, router: Router, max_queue: int, session_header: str = "x-session-id", fallbacks: int = 0,
                 pd: Disaggregation | None = None):
        self.router = router
        self.max_queue = max_queue
        self.session_header = session_header
        self.fallbacks = fallbacks
        self.pd = pd

    async def pick(self, headers: dict[str, str], body: bytes, subset: list[str] | None
                   ) -> tuple[RoutingRequest, Decision, list[Backend], Decision | None]:
        """The request, the policy's decision, the fallback endpoints (least loaded first), and in P/D mode
        the prefill backend's decision (None: decode alone)."""
        router = self.router
        healthy = router.pool.healthy()
        if subset is not None:
            allowed = set(subset)
            healthy = [b for b in healthy if endpoint_of(b) in allowed]
        if not healthy:
            router.metrics.rejected.labels("no-backend").inc()
            raise Picked(503, "no ready endpoint" + (" in the subset" if subset is not None else ""))
        open_ = [b for b in healthy if b.waiting < self.max_queue]
        if not open_:
            router.metrics.rejected.labels("saturated").inc()
            raise Picked(429, f"every endpoint has {self.max_queue} or more requests waiting")
        request = routing_request(body, headers, self.session_header)
        if request.model:
            open_ = [b for b in open_ if request.model in b.models] or open_
        await router.policy.prepare(request, open_, router.session)
        decision = router.policy.choose(request, open_)
        router.metrics.decisions.labels(router.policy.name, decision.reason).inc()
        router.policy.routed(request, decision)
        others = sorted((b for b in open_ if b is not decision.backend), key=lambda b: b.load())
        prefill = None
        if self.pd is not None:
            await self.pd.prefill.prepare(request)
            prefill = self.pd.prefill_for(headers.get(":method", "POST"), headers.get(":path"), request)
        return request, decision, others[: self.fallbacks], prefill

    def served(self, picked: tuple | None, metadata: base_pb2.Metadata) -> Backend | None:
        """The gateway says which endpoint served the request: if not the one picked, the policy learns it;
        returns that other backend (None when it is the one picked, unknown or not said)."""
        endpoint = _served(metadata)
        if picked is None or endpoint is None or endpoint == endpoint_of(picked[1].backend):
            return None
        backend = next((b for b in self.router.pool.all() if endpoint_of(b) == endpoint), None)
        if backend is None:
            logger.debug("served by %s, which is not in the pool", endpoint)
            return None
        request, decision = picked[0], picked[1]
        self.router.policy.routed(request, Decision(backend, "served", decision.matched_chars,
                                                    decision.prompt_chars))
        return backend

    async def Process(self, request_iterator, context):  # noqa: N802 (the gRPC method's name)
        in_flight = InFlight()
        prefilling = InFlight()  # P/D: the prefill backend's count, until the decode's response starts
        try:
            async with aclosing(self._process(request_iterator, in_flight, prefilling)) as answers:
                async for answer in answers:
                    yield answer
        finally:  # the stream closed, normally, by the gateway's cancel, or on an error
            in_flight.end()
            prefilling.end()

    async def _process(self, request_iterator, in_flight: InFlight, prefilling: InFlight | None = None):
        prefilling = prefilling or InFlight()
        headers: dict[str, str] = {}
        body = b""
        subset = None
        duplex_request = duplex_response = False  # FULL_DUPLEX_STREAMED: bodies come back through the picker
        headers_pending = False  # duplex: the headers' answer waits for the whole body (it carries the choice)
        picked: list = [None]  # (request, decision, fallbacks, prefill) once chosen
        async for message in request_iterator:
            if message.HasField("protocol_config"):
                config = message.protocol_config
                duplex_request = config.request_body_mode == FULL_DUPLEX_STREAMED
                duplex_response = config.response_body_mode == FULL_DUPLEX_STREAMED
            kind = message.WhichOneof("request")
            if message.HasField("metadata_context"):
                if kind == "response_headers":
                    elsewhere = self.served(picked[0], message.metadata_context)
                    if elsewhere is not None and in_flight.backend is not None:
                        in_flight.start(elsewhere)
                elif subset is None:
                    subset = _subset(message.metadata_context)
            if kind == "request_headers":
                for h in message.request_headers.headers.headers:
                    headers[h.key.lower()] = h.raw_value.decode("latin-1") if h.raw_value else h.value
                if message.request_headers.end_of_stream:
                    yield await self._answer("request_headers", headers, b"", subset, picked, in_flight,
                                             prefilling)
                elif duplex_request:
                    headers_pending = True
                else:
                    yield ext_proc.ProcessingResponse(request_headers=ext_proc.HeadersResponse())
            elif kind == "request_body":
                chunk = message.request_body
                body += chunk.body
                if not chunk.end_of_stream:
                    if not duplex_request:  # (streamed: each chunk passes on; the choice comes with the last)
                        yield ext_proc.ProcessingResponse(request_body=ext_proc.BodyResponse())
                    continue
                if headers_pending:  # the headers with the choice, then the body back to Envoy
                    headers_pending = False
                    answer = await self._answer("request_headers", headers, body, subset, picked, in_flight,
                                                prefilling)
                    yield answer
                    if answer.HasField("immediate_response"):
                        return
                    yield _streamed("request_body", body, True)
                else:
                    yield await self._answer("request_body", headers, body, subset, picked, in_flight,
                                             prefilling)
            elif kind == "request_trailers":
                yield ext_proc.ProcessingResponse(request_trailers=ext_proc.TrailersResponse())
            elif kind == "response_headers":
                prefilling.end()  # the sidecar ran the prefill before the decode answered
                if message.response_headers.end_of_stream:  # a response without a body: complete
                    in_flight.end()
                yield ext_proc.ProcessingResponse(response_headers=ext_proc.HeadersResponse())
            elif kind == "response_body":
                if message.response_body.end_of_stream:  # the response is complete
                    in_flight.end()
                if duplex_response:  # every chunk as it comes: a stream's events are not held back
                    yield _streamed("response_body", message.response_body.body, message.response_body.end_of_stream)
                else:
                    yield ext_proc.ProcessingResponse(response_body=ext_proc.BodyResponse())
            elif kind == "response_trailers":
                in_flight.end()
                yield ext_proc.ProcessingResponse(response_trailers=ext_proc.TrailersResponse())

    async def _answer(self, phase: str, headers: dict[str, str], body: bytes, subset, picked: list,
                      in_flight: InFlight, prefilling: InFlight) -> ext_proc.ProcessingResponse:
        try:
            picked[0] = await self.pick(headers, body, subset)
            _, decision, fallbacks, prefill = picked[0]
            in_flight.start(decision.backend)
            if prefill is not None:
                prefilling.start(prefill.backend)
        except Picked as e:
            error = {"error": {"message": e.message, "type": "ServiceUnavailable" if e.status == 503
                               else "TooManyRequests", "param": None, "code": e.status}}
            return ext_proc.ProcessingResponse(immediate_response=ext_proc.ImmediateResponse(
                status=http_status_pb2.HttpStatus(code=e.status), body=json.dumps(error).encode(),
                headers=ext_proc.HeaderMutation(set_headers=[_header("content-type", "application/json"),
                                                             _header("retry-after", "1")]),
                details=e.message))
        endpoint = ",".join(endpoint_of(b) for b in [decision.backend, *fallbacks])
        set_headers, remove_headers = [_header(DESTINATION, endpoint)], []
        if prefill is not None:
            set_headers.append(_header(PREFILLER_HEADER, endpoint_of(prefill.backend)))
        elif PREFILLER_HEADER in headers:  # a client's own: the sidecar must not prefill where it says
            remove_headers.append(PREFILLER_HEADER)
        common = ext_proc.CommonResponse(header_mutation=ext_proc.HeaderMutation(
            set_headers=set_headers, remove_headers=remove_headers), clear_route_cache=True)
        metadata = struct_pb2.Struct()
        metadata.update({LB_NAMESPACE: {DESTINATION: endpoint}})
        if phase == "request_headers":
            return ext_proc.ProcessingResponse(request_headers=ext_proc.HeadersResponse(response=common),
                                               dynamic_metadata=metadata)
        return ext_proc.ProcessingResponse(request_body=ext_proc.BodyResponse(response=common),
                                           dynamic_metadata=metadata)


def _streamed(phase: str, data: bytes, end_of_stream: bool) -> ext_proc.ProcessingResponse:
    """A body chunk handed back to Envoy (FULL_DUPLEX_STREAMED: it forwards only what the picker returns)."""
    mutation = ext_proc.BodyMutation(streamed_response=ext_proc.StreamedBodyResponse(body=data,
                                                                                    end_of_stream=end_of_stream))
    return ext_proc.ProcessingResponse(**{phase: ext_proc.BodyResponse(
        response=ext_proc.CommonResponse(body_mutation=mutation))})


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, raw_value=value.encode()))


def _served(metadata: base_pb2.Metadata) -> str | None:
    """The endpoint the gateway reports as having served the request, or None."""
    if LB_NAMESPACE not in metadata.filter_metadata:
        return None
    fields = metadata.filter_metadata[LB_NAMESPACE].fields
    return fields[SERVED].string_value or None if SERVED in fields else None


def _subset(metadata: base_pb2.Metadata) -> list[str] | None:
    """The subset hint's endpoints, or None when the gateway sent none (then every backend may be chosen)."""
    if SUBSET_NAMESPACE not in metadata.filter_metadata:
        return None
    fields = metadata.filter_metadata[SUBSET_NAMESPACE].fields
    if SUBSET not in fields:
        return None
    value = fields[SUBSET]
    if value.HasField("list_value"):
        return [v.string_value for v in value.list_value.values]
    return [e.strip() for e in value.string_value.split(",") if e.strip()]


class EPPServer:
    """The gRPC server: ext_proc and health, on the router's event loop."""

    def __init__(self, router: Router, host: str, port: int, max_queue: int, session_header: str,
                 fallbacks: int = 0, pd: Disaggregation | None = None):
        self.server = grpc.aio.server()
        ext_proc_grpc.add_ExternalProcessorServicer_to_server(
            EndpointPicker(router, max_queue, session_header, fallbacks, pd), self.server)
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.port = self.server.add_insecure_port(address)

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in HEALTH_SERVICES:
            result = self.health.set(service, status)
            if hasattr(result, "__await__"):
                await result

    async def start(self) -> None:
        await self.server.start()
        logger.info("endpoint picker (ext_proc) listening on port %d", self.port)

    async def stop(self) -> None:
        await self.server.stop(grace=2)
