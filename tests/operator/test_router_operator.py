"""spec.router and the InferencePool: parsing, the pure builders (checked against Kubernetes' schemas, the
runtime's own `pagoda router` parser and the InferencePool schema in schemas/), the status endpoint, and
kopf for real against KMock creating and removing the router's children."""

from __future__ import annotations

import copy
import os

import jsonschema
import pytest
import yaml
from operator_harness import NS, VERBS, eventually
from test_autoscaling_kmock import has
from test_autoscaling_scheduling import SCHEMAS, closed
from test_schemas import VERSIONS, crd_schema, validate

from pagoda.entrypoints import cli
from pagoda_operator import builders as b
from pagoda_operator import router as r
from pagoda_operator.spec import InvalidSpec, parse_spec
from pagoda_operator.status import build_status

pytestmark = pytest.mark.operator

OWNER = {"apiVersion": b.API_VERSION, "kind": b.KIND, "metadata": {"name": "llama", "namespace": NS, "uid": "u"}}
CPU = {"resources": {"requests": {"cpu": "1"}}, "image": "pagoda-runtime:test"}
POOL_SCHEMA = jsonschema.Draft4Validator(closed(yaml.safe_load(
    (SCHEMAS / "inference.networking.k8s.io_v1_inferencepool.yaml").read_text())))


def parse(spec: dict):
    return parse_spec({"metadata": {"name": "llama", "namespace": NS}, "spec": spec}, default_image="img")


def test_router_parses_with_defaults_and_rejects_bad_values():
    assert parse(CPU).router is None
    assert parse({**CPU, "router": {"enabled": False, "policy": "session"}}).router is None
    router = parse({**CPU, "router": {"enabled": True}}).router
    assert (router.policy, router.replicas, router.resources) == ("prefix", 1, None)
    for bad, message in (({"policy": "random"}, "router.policy"), ({"replicas": 0}, "router.replicas"),
                         ({"resources": "big"}, "router.resources")):
        with pytest.raises(InvalidSpec, match=message):
            parse({**CPU, "router": {"enabled": True, **bad}})
    schema = jsonschema.Draft4Validator(crd_schema())
    body = {"apiVersion": b.API_VERSION, "kind": b.KIND, "metadata": {"name": "llama"}}
    schema.validate({**body, "spec": {"router": {"enabled": True, "policy": "least-load", "replicas": 2}}})
    with pytest.raises(jsonschema.ValidationError):
        schema.validate({**body, "spec": {"router": {"enabled": True, "policy": "fastest"}}})


@pytest.mark.parametrize("version", VERSIONS)
def test_router_children_are_valid_kubernetes(version):
    spec = parse({**CPU, "service": {"type": "LoadBalancer", "port": 80}, "imagePullSecrets": [{"name": "reg"}],
                  "router": {"enabled": True, "policy": "least-load", "replicas": 2,
                             "resources": {"requests": {"cpu": "2"}}}})
    manifests = r.build_router(spec, OWNER)
    assert [m["kind"] for m in manifests] == list(r.ROUTER_KINDS)
    assert {m["metadata"]["name"] for m in manifests} == {"llama-router"}
    for manifest in manifests:
        validate(manifest, version)
    service, deployment = manifests[3], manifests[4]
    assert service["spec"]["type"] == "LoadBalancer" and service["spec"]["ports"][0]["port"] == 80
    pods = deployment["spec"]["template"]
    assert service["spec"]["selector"].items() <= pods["metadata"]["labels"].items()
    assert deployment["spec"]["replicas"] == 2 and pods["spec"]["serviceAccountName"] == "llama-router"
    assert pods["spec"]["containers"][0]["resources"] == {"requests": {"cpu": "2"}}
    # the router's pods are not heads: neither Service X nor the InferencePool selects them
    assert not b.head_selector(spec).items() <= pods["metadata"]["labels"].items()


def test_router_role_reads_endpointslices_and_nothing_more():
    spec = parse({**CPU, "router": {"enabled": True}})
    sa, role, binding, *_ = r.build_router(spec, OWNER)
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "llama-router"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": NS}]


def test_router_args_parse_with_the_runtime_cli(monkeypatch):
    for var in [v for v in os.environ if v.startswith("PAGODA_")]:
        monkeypatch.delenv(var)
    spec = parse({**CPU, "router": {"enabled": True, "policy": "session"}})
    container = r.build_router_deployment(spec, OWNER)["spec"]["template"]["spec"]["containers"][0]
    ns = cli.build_parser().parse_args(container["args"])
    assert ns.command == "router" and ns.k8s_service == b.head_service_name(spec) == "llama"
    assert (ns.namespace, ns.policy, ns.port) == (NS, "session", b.HTTP_PORT)
    assert container["ports"][0]["containerPort"] == b.HTTP_PORT


def test_endpoint_is_the_routers_service_when_on():
    plain, routed = parse(CPU), parse({**CPU, "router": {"enabled": True}})
    assert build_status(plain, [], generation=1)["endpoint"] == f"http://llama.{NS}.svc:8000/v1"
    assert build_status(routed, [], generation=1)["endpoint"] == f"http://llama-router.{NS}.svc:8000/v1"


def test_inference_pool_selects_the_heads_and_matches_its_schema():
    spec = parse(CPU)
    pool = r.build_inference_pool(spec, OWNER)
    POOL_SCHEMA.validate(pool)
    assert pool["metadata"]["name"] == "llama" and pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"]["selector"]["matchLabels"] == b.head_selector(spec)
    assert pool["spec"]["targetPorts"] == [{"number": b.HTTP_PORT}]
    broken = copy.deepcopy(pool)
    broken["spec"]["targetPorts"] = [{"port": 8000}]
    with pytest.raises(jsonschema.ValidationError):
        POOL_SCHEMA.validate(broken)


@pytest.mark.parametrize("version", VERSIONS)
def test_epp_mode_is_the_pools_endpoint_picker(version, monkeypatch):
    for var in [v for v in os.environ if v.startswith("PAGODA_")]:
        monkeypatch.delenv(var)
    body = {"apiVersion": b.API_VERSION, "kind": b.KIND, "metadata": {"name": "llama", "namespace": NS}}
    schema = jsonschema.Draft4Validator(crd_schema())
    schema.validate({**body, "spec": {"router": {"enabled": True, "mode": "epp", "failureMode": "FailClose"}}})
    for bad in ({"mode": "sidecar"}, {"failureMode": "Open"}):
        with pytest.raises(jsonschema.ValidationError):
            schema.validate({**body, "spec": {"router": {"enabled": True, **bad}}})
    with pytest.raises(InvalidSpec, match="router.mode"):
        parse({**CPU, "router": {"enabled": True, "mode": "sidecar"}})
    spec = parse({**CPU, "router": {"enabled": True, "mode": "epp", "failureMode": "FailClose"}})
    manifests = r.build_router(spec, OWNER)
    assert {m["metadata"]["name"] for m in manifests} == {"llama-epp"}
    for manifest in manifests:
        validate(manifest, version)
    service, deployment = manifests[3], manifests[4]
    assert service["spec"]["type"] == "ClusterIP"
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"grpc-ext-proc": 9002, "http": b.HTTP_PORT}
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["grpc"] == {"port": 9002, "service": "readiness"}
    ns = cli.build_parser().parse_args(container["args"])
    assert ns.epp and ns.epp_port == 9002 and ns.k8s_service == "llama"
    precise = parse({**CPU, "router": {"enabled": True, "policy": "precise"}})
    container = r.build_router_deployment(precise, OWNER)["spec"]["template"]["spec"]["containers"][0]
    ns = cli.build_parser().parse_args(container["args"])
    assert (ns.policy, ns.kv_events_endpoint, ns.kv_events_replay_endpoint) == \
        ("precise", "tcp://{host}:5557", "tcp://{host}:5558")
    pool = r.build_inference_pool(spec, OWNER)
    POOL_SCHEMA.validate(pool)
    assert pool["spec"]["endpointPickerRef"] == {"kind": "Service", "name": "llama-epp", "port": {"number": 9002},
                                                 "failureMode": "FailClose"}
    # clients go through the gateway: the LLMDeployment's own endpoint stays Service X
    assert build_status(spec, [], generation=1)["endpoint"] == f"http://llama.{NS}.svc:8000/v1"
    # without spec.router the pool still names X-epp (a picker of the user's own), failing open
    assert r.build_inference_pool(parse(CPU), OWNER)["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"


# ----- kopf against KMock -----

DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NS}/deployments"
ROLES = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/roles"
POOLS = f"/apis/inference.networking.k8s.io/v1/namespaces/{NS}/inferencepools"


@pytest.fixture
def router_apis(kmock):
    info = kmock.ResourceInfo
    kmock.resources["apps/v1/deployments"] = info(kind="Deployment", namespaced=True, verbs=VERBS)
    kmock.resources["v1/serviceaccounts"] = info(kind="ServiceAccount", namespaced=True, verbs=VERBS)
    kmock.resources["rbac.authorization.k8s.io/v1/roles"] = info(kind="Role", namespaced=True, verbs=VERBS)
    kmock.resources["rbac.authorization.k8s.io/v1/rolebindings"] = info(kind="RoleBinding", namespaced=True,
                                                                         verbs=VERBS)
    kmock.resources["inference.networking.k8s.io/v1/inferencepools"] = info(kind="InferencePool", namespaced=True,
                                                                             verbs=VERBS)


async def test_router_comes_and_goes_with_spec_router(router_apis, cluster, operator):
    await cluster.create("llama", {**CPU, "replicas": 2, "router": {"enabled": True, "policy": "prefix"}})
    await cluster.converge_groups("llama", 2)
    await eventually(has(cluster, DEPLOYMENTS, {"llama-router"}), what="the router Deployment")
    await eventually(has(cluster, ROLES, {"llama-router"}), what="its Role")
    await eventually(has(cluster, POOLS, {"llama"}), what="the InferencePool (the API is served)")
    services = await cluster.services()
    assert {"llama", "llama-headless", "llama-router"} <= set(services)

    async def status_says(router, endpoint):
        status = await cluster.status("llama")
        return status.get("router") == router and status.get("endpoint") == endpoint and status
    status = await eventually(lambda: status_says("llama-router", f"http://llama-router.{NS}.svc:8000/v1"))
    assert status["inferencePool"] == "llama"
    assert "RouterCreated" in await cluster.event_reasons("llama")

    await cluster.update_spec("llama", {"router": {"enabled": False}})
    await eventually(has(cluster, DEPLOYMENTS, set()), what="the router Deployment gone")
    await eventually(has(cluster, ROLES, set()), what="its Role gone")
    await eventually(lambda: status_says(None, f"http://llama.{NS}.svc:8000/v1"))
    assert "llama-router" not in await cluster.services()


async def test_switching_the_mode_replaces_the_children(router_apis, cluster, operator):
    await cluster.create("llama", {**CPU, "replicas": 1, "router": {"enabled": True}})
    await cluster.converge_groups("llama", 1)
    await eventually(has(cluster, DEPLOYMENTS, {"llama-router"}), what="the proxy's Deployment")
    await cluster.update_spec("llama", {"router": {"enabled": True, "mode": "epp"}})
    await eventually(has(cluster, DEPLOYMENTS, {"llama-epp"}), what="the picker's Deployment, the proxy's gone")
    await eventually(has(cluster, ROLES, {"llama-epp"}), what="its Role")
    services = await cluster.services()
    assert "llama-epp" in services and "llama-router" not in services

    async def status_says_epp():  # the status is patched after the children, at the end of the pass
        status = await cluster.status("llama")
        return status.get("router") == "llama-epp" and status.get("endpoint") == f"http://llama.{NS}.svc:8000/v1"
    await eventually(status_says_epp, what="the status naming the picker")


def test_precise_routing_turns_on_the_heads_kv_events_where_the_router_reads_them():
    from pagoda.config.kv_events import KVEventsConfig
    from pagoda.entrypoints.openai.cli_args import split_args

    spec = parse({**CPU, "router": {"enabled": True, "policy": "precise"}, "pipelineParallelSize": 2})
    router_ns = cli.build_parser().parse_args(r.build_router_deployment(spec, OWNER)["spec"]["template"]["spec"]
                                              ["containers"][0]["args"])
    for sts in (m for m in b.build_all(spec, OWNER) if m["kind"] == "StatefulSet"):
        container = sts["spec"]["template"]["spec"]["containers"][0]
        args = [a.replace("$(PAGODA_NODE_RANK)", "0") for a in container["args"]]
        engine, _ = split_args(cli.build_parser().parse_args(args))
        events = KVEventsConfig.parse(engine.kv_events_config)
        assert events.enable_kv_cache_events
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        # the router's templates, filled with a pod's address, are the heads' endpoints on that address
        assert router_ns.kv_events_endpoint.format(host="10.0.0.9", port=8000) == \
            events.endpoint.replace("*", "10.0.0.9") == f"tcp://10.0.0.9:{ports['kv-events']}"
        assert router_ns.kv_events_replay_endpoint.format(host="10.0.0.9", port=8000) == \
            events.replay_endpoint.replace("*", "10.0.0.9") == f"tcp://10.0.0.9:{ports['kv-replay']}"
    # the user's own flag wins and is not repeated; other policies publish nothing
    own = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "t"}'
    spec = parse({**CPU, "router": {"enabled": True, "policy": "precise"},
                  "engine": {"extraArgs": ["--kv-events-config", own]}})
    args = [m for m in b.build_all(spec, OWNER) if m["kind"] == "StatefulSet"][0]["spec"]["template"]["spec"][
        "containers"][0]["args"]
    assert args.count("--kv-events-config") == 1 and own in args
    spec = parse({**CPU, "router": {"enabled": True, "policy": "prefix"}})
    args = [m for m in b.build_all(spec, OWNER) if m["kind"] == "StatefulSet"][0]["spec"]["template"]["spec"][
        "containers"][0]["args"]
    assert "--kv-events-config" not in args
