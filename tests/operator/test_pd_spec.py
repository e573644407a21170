"""spec.prefill (P/D disaggregation): the spec's rules, the CRD's rules, the two roles' pods, the router's P/D
flags (parsed by the runtime's own parsers), the status, and the manifests against the Kubernetes schemas.
Pure, no cluster (tests/operator/test_pd_kmock.py runs the operator)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from test_model_cache import cel_failures

from pagoda_operator import builders as b
from pagoda_operator import disaggregation as pd
from pagoda_operator.router import build_router, router_args
from pagoda_operator.spec import InvalidSpec, parse_spec, prefill_view
from pagoda_operator.status import GroupObservation, build_status, with_prefill_status

pytestmark = pytest.mark.operator

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "pagoda.dev_llmdeployments.yaml"
SAMPLES = sorted(p for p in (ROOT / "crds" / "samples").glob("*.yaml") if "-pd" not in p.name)
CPU = {"requests": {"cpu": "1", "memory": "2Gi"}}
PD = {"resources": CPU, "router": {"enabled": True}, "prefill": {"replicas": 2}}


def body(spec: dict, name: str = "demo") -> dict:
    return {"apiVersion": b.API_VERSION, "kind": b.KIND,
            "metadata": {"name": name, "namespace": "serving", "uid": "u"}, "spec": spec}


def parse(spec: dict):
    return parse_spec(body(spec), default_image="pagoda-runtime:test")


def manifests(spec: dict) -> dict[str, dict]:
    parsed = parse(spec)
    return {f"{m['kind']}/{m['metadata']['name']}": m for m in b.build_all(parsed, body(spec))
            + build_router(parsed, body(spec))}


def container(sts: dict) -> dict:
    return sts["spec"]["template"]["spec"]["containers"][0]


def crd_schema() -> dict:
    return yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


# ----- without spec.prefill nothing changes -----

@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.name)
def test_without_prefill_no_manifest_carries_anything_of_pd(sample):
    raw = yaml.safe_load(sample.read_text())
    raw["metadata"].update(namespace="default", uid="u")
    parsed = parse_spec(raw, default_image="i")
    assert parsed.pd_role is None and parsed.prefill is None
    text = json.dumps(b.build_all(parsed, raw) + build_router(parsed, raw))
    for trace in (pd.LABEL_PD_ROLE, pd.LABEL_LLM_D_ROLE, "--kv-transfer-config", pd.SIDE_CHANNEL_HOST_ENV,
                  '"nixl"', "-prefill", "--prefill-k8s-service"):
        assert trace not in text
    # the prefill pass would build nothing and remove nothing that is not there
    assert prefill_view(parsed).replicas == 0


# ----- the two roles -----

def test_prefill_makes_producer_groups_and_the_main_groups_consumers():
    built = manifests({**PD, "replicas": 1, "prefill": {"replicas": 2, "resources": {"requests": {"cpu": "3"}}}})
    assert sorted(k for k in built if k.startswith("StatefulSet/")) == [
        "StatefulSet/demo-g0-head", "StatefulSet/demo-p0-head", "StatefulSet/demo-p1-head"]
    decode, prefill = built["StatefulSet/demo-g0-head"], built["StatefulSet/demo-p1-head"]
    for sts, role, kv_role in ((decode, "decode", "kv_consumer"), (prefill, "prefill", "kv_producer")):
        pod_labels = sts["spec"]["template"]["metadata"]["labels"]
        assert pod_labels[pd.LABEL_PD_ROLE] == pod_labels[pd.LABEL_LLM_D_ROLE] == role
        assert sts["metadata"]["labels"][pd.LABEL_PD_ROLE] == role
        args = container(sts)["args"]
        assert json.loads(args[args.index("--kv-transfer-config") + 1]) == {"kv_connector": "NixlConnector",
                                                                          "kv_role": kv_role}
        env = {e["name"]: e for e in container(sts)["env"]}
        assert env[pd.SIDE_CHANNEL_HOST_ENV]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env[pd.SIDE_CHANNEL_PORT_ENV]["value"] == "5600"
        assert {"name": "nixl", "containerPort": 5600, "protocol": "TCP"} in container(sts)["ports"]
    # the main groups keep their selector (immutable); the prefill groups' never match a main pod
    assert decode["spec"]["selector"]["matchLabels"] == {b.LABEL_DEPLOYMENT: "demo", b.LABEL_GROUP: "0",
                                                          b.LABEL_ROLE: "head"}
    assert prefill["spec"]["selector"]["matchLabels"] == {b.LABEL_DEPLOYMENT: "demo", b.LABEL_GROUP: "1",
                                                           b.LABEL_ROLE: "head", pd.LABEL_PD_ROLE: "prefill"}
    assert container(prefill)["resources"] == {"requests": {"cpu": "3"}}
    assert container(decode)["resources"] == CPU
    # Service X: the decode heads; Service X-prefill: the prefill heads
    assert built["Service/demo"]["spec"]["selector"] == {b.LABEL_DEPLOYMENT: "demo", b.LABEL_ROLE: "head",
                                                         pd.LABEL_PD_ROLE: "decode"}
    assert built["Service/demo-prefill"]["spec"]["selector"] == {b.LABEL_DEPLOYMENT: "demo", b.LABEL_ROLE: "head",
                                                                 pd.LABEL_PD_ROLE: "prefill"}
    args = container(built["Deployment/demo-router"])["args"]
    assert args[args.index("--k8s-service") + 1] == "demo"
    assert args[args.index("--prefill-k8s-service") + 1] == "demo-prefill"
    assert args[args.index("--policy") + 1] == "least-load" and args[args.index("--prefill-policy") + 1] == "prefix"


def test_prefill_resources_default_to_the_main_groups():
    built = manifests(PD)
    assert container(built["StatefulSet/demo-p0-head"])["resources"] == CPU


@pytest.mark.parametrize("version", ["1.30", kubernetes_validate.utils.latest_version()])
def test_pd_manifests_are_valid_kubernetes_objects(version):
    for manifest in manifests({**PD, "replicas": 2}).values():
        kubernetes_validate.validate(manifest, version, strict=True)


def test_the_user_cannot_override_the_side_channel_env():
    built = manifests({**PD, "env": [{"name": pd.SIDE_CHANNEL_PORT_ENV, "value": "1"}, {"name": "A", "value": "b"}]})
    env = [e for e in container(built["StatefulSet/demo-p0-head"])["env"] if e["name"] == pd.SIDE_CHANNEL_PORT_ENV]
    assert env == [{"name": pd.SIDE_CHANNEL_PORT_ENV, "value": "5600"}]


def revisions(spec: dict) -> dict[str, str]:
    return {k: m["metadata"]["labels"][b.LABEL_REVISION] for k, m in manifests(spec).items()
            if k.startswith("StatefulSet/")}


def test_each_role_rolls_on_its_own():
    before = revisions(PD)
    more = revisions({**PD, "prefill": {"replicas": 3}})  # scaling prefill: no pod changes, one group more
    assert {k: more[k] for k in before} == before and "StatefulSet/demo-p2-head" in more
    resized = revisions({**PD, "prefill": {"replicas": 2, "resources": {"requests": {"cpu": "4"}}}})
    assert resized["StatefulSet/demo-g0-head"] == before["StatefulSet/demo-g0-head"]  # decode untouched
    assert resized["StatefulSet/demo-p0-head"] != before["StatefulSet/demo-p0-head"]
    # the decode pods' own resources: only they roll once prefill has resources of its own
    own = {**PD, "prefill": {"replicas": 2, "resources": CPU}}
    edited = revisions({**own, "resources": {"requests": {"cpu": "2"}}})
    assert edited["StatefulSet/demo-p0-head"] == revisions(own)["StatefulSet/demo-p0-head"]
    assert edited["StatefulSet/demo-g0-head"] != revisions(own)["StatefulSet/demo-g0-head"]


# ----- the runtime parses what the operator writes -----

def test_pod_and_router_args_parse_with_the_runtime_parsers(monkeypatch):
    cli = pytest.importorskip("pagoda.entrypoints.cli", reason="the runtime package is not importable")
    kv_transfer = pytest.importorskip("pagoda.config.kv_transfer")
    router_cli = pytest.importorskip("pagoda.router.cli")
    for var in [v for v in os.environ if v.startswith("PAGODA_")]:
        monkeypatch.delenv(var)
    assert (pd.SIDE_CHANNEL_HOST_ENV, pd.SIDE_CHANNEL_PORT_ENV, pd.SIDE_CHANNEL_PORT) == (
        kv_transfer.SIDE_CHANNEL_HOST_ENV, kv_transfer.SIDE_CHANNEL_PORT_ENV, kv_transfer.DEFAULT_SIDE_CHANNEL_PORT)
    built = manifests(PD)
    for name, role in (("StatefulSet/demo-g0-head", "kv_consumer"), ("StatefulSet/demo-p0-head", "kv_producer")):
        args = [a.replace("$(PAGODA_NODE_RANK)", "0") for a in container(built[name])["args"]]
        ns = cli.build_parser().parse_args(args)
        assert kv_transfer.KVTransferConfig.parse(ns.kv_transfer_config).kv_role == role
    # the router: its P/D flags, with the Kubernetes API stubbed (the Services are discovered at run time)
    import argparse

    import pagoda.router.kubernetes as router_kubernetes
    monkeypatch.setattr(router_kubernetes, "load_config", lambda namespace=None: None)
    parser = argparse.ArgumentParser()
    router_cli.add_router_arguments(parser)
    args = router_args(parse({**PD, "router": {"enabled": True, "policy": "session", "pdThreshold": 64}}))
    assert args[0] == "router"
    parsed = router_cli.router_args(parser, parser.parse_args(args[1:]))
    assert parsed.disaggregated and parsed.prefill_k8s_service == "demo-prefill" and parsed.k8s_service == "demo"
    assert parsed.policy == "least-load" and parsed.prefill_policy == "session" and parsed.pd_threshold == 64
    assert "--pd-threshold" not in router_args(parse(PD))  # the router's default: every prompt takes P/D
    timed = router_args(parse({**PD, "router": {"enabled": True, "prefillTimeoutSeconds": 20}}))
    assert router_cli.router_args(parser, parser.parse_args(timed[1:])).prefill_timeout == 20
    assert "--prefill-timeout" not in router_args(parse(PD))  # the router's default
    # precise: the prefill pod chosen by what the prefill heads' KV events say they hold; only they publish
    precise = {**PD, "router": {"enabled": True, "policy": "precise"}}
    parsed = router_cli.router_args(parser, parser.parse_args(router_args(parse(precise))[1:]))
    assert parsed.prefill_policy == "precise" and "--kv-events-endpoint" in router_args(parse(precise))
    built = manifests(precise)
    assert "--kv-events-config" in container(built["StatefulSet/demo-p0-head"])["args"]
    assert "--kv-events-config" not in container(built["StatefulSet/demo-g0-head"])["args"]


# ----- what is refused, naming the field -----

@pytest.mark.parametrize("spec,field", [
    ({**PD, "prefill": {"replicas": 0}}, "prefill.replicas"),
    ({**PD, "prefill": {"parallelism": {"data": 2}}}, "prefill.parallelism.data"),
    ({**PD, "prefill": {"parallelism": {"dataLocal": 2}}}, "prefill.parallelism.dataLocal"),
    ({**PD, "prefill": {"parallelism": {"tensor": 0}}}, "prefill.parallelism.tensor"),
    ({**PD, "prefill": {"parallelism": {"tensor": 3}}}, "prefill.parallelism.tensor"),
    ({**PD, "prefill": {"parallelism": {"expert": True}}}, "prefill.parallelism.expert"),
    ({**PD, "prefill": {"replica": 1}}, "prefill.replica"),
    ({**PD, "prefill": {"resources": "big"}}, "prefill.resources"),
    ({**PD, "prefill": 3}, "prefill must be an object"),
    ({**PD, "router": {"enabled": False}}, "spec.router"),
    ({**PD, "router": {"enabled": True, "mode": "epp"}}, "mode proxy"),
    ({**PD, "parallelism": {"data": 2}}, "parallelism.data"),
    ({**PD, "tensorParallelSize": 3}, "tensorParallelSize"),
    ({**PD, "tensorParallelSize": 3, "prefill": {"parallelism": {"tensor": 1}}},
     "prefill.parallelism.tensor 1 differs from tensorParallelSize 3"),
    ({**PD, "adapters": []}, "spec.adapters"),
    ({**PD, "scheduling": {"gang": "volcano"}}, "scheduling.gang"),
    ({**PD, "engine": {"extraArgs": ["--kv-transfer-config={}"]}}, "--kv-transfer-config"),
    ({**PD, "router": {"enabled": True, "pdThreshold": -1}}, "router.pdThreshold"),
    ({"router": {"enabled": True, "pdThreshold": 100}}, "router.pdThreshold needs spec.prefill"),
    ({**PD, "router": {"enabled": True, "prefillTimeoutSeconds": 0}}, "router.prefillTimeoutSeconds"),
    ({"router": {"enabled": True, "prefillTimeoutSeconds": 30}}, "router.prefillTimeoutSeconds needs spec.prefill"),
    ({**PD, "prefill": {"resources": {"limits": {"nvidia.com/gpu": "1"}}, "parallelism": {"pipeline": 2}}},
     "prefill.parallelism.pipeline"),
])
def test_invalid_prefill_is_refused_naming_the_field(spec, field):
    with pytest.raises(InvalidSpec, match=field.replace(".", r"\.")):
        parse(spec)


def test_a_user_kv_transfer_config_stays_allowed_without_prefill():
    parsed = parse({"engine": {"extraArgs": ["--kv-transfer-config", "{}"]}})
    assert parsed.pd_role is None


@pytest.mark.parametrize("spec,broken", [
    (PD, None),
    ({**PD, "router": {"enabled": True, "mode": "proxy"}, "prefill": {"parallelism": {"tensor": 1}}}, None),
    ({**PD, "tensorParallelSize": 3, "prefill": {"parallelism": {"tensor": 3}}}, None),  # the same TP: served
    ({"prefill": {"replicas": 1}}, "prefill needs router.enabled true"),
    ({**PD, "router": {"enabled": False}}, "prefill needs router.enabled true"),
    ({**PD, "router": {"enabled": True, "mode": "epp"}}, "prefill needs router.enabled true"),
    ({**PD, "parallelism": {"data": 2}}, "parallelism.data > 1 with prefill"),
])
def test_the_crd_refuses_impossible_pd_shapes_at_apply_time(spec, broken):
    failures = cel_failures(crd_schema()["properties"]["spec"], spec)
    if broken is None:
        assert failures == []
        jsonschema.Draft4Validator(crd_schema()).validate(body(spec))
        parse(spec)
    else:
        assert any(broken in f for f in failures), failures
        with pytest.raises(InvalidSpec):
            parse(spec)


@pytest.mark.parametrize("prefill", [{"replicas": 0}, {"parallelism": {"data": 2}}, {"parallelism": {"tensor": 0}},
                                     {"parallelism": {"dataLocal": 2}}])
def test_the_crd_schema_refuses_impossible_prefill_values(prefill):
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft4Validator(crd_schema()).validate(body({**PD, "prefill": prefill}))


# ----- the status of both roles -----

def group(spec, index: int, ready: bool) -> GroupObservation:
    revision = b.group_revision(spec, index, 0)
    pod = {"metadata": {"name": f"p{index}", "labels": {b.LABEL_REVISION: revision}},
           "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}
    return GroupObservation(index=index, size=1, wanted_revision=revision, revision=revision, pods=[pod])


def test_status_shows_both_roles_and_prefill_progress_without_losing_availability():
    spec = parse(PD)
    view = prefill_view(spec)
    main = build_status(spec, [group(spec, 0, True)], generation=1, timestamp="t0")
    assert main["phase"] == "Ready"
    status = with_prefill_status(main, view, [group(view, 0, True), group(view, 1, False)], previous={})
    assert status["prefill"]["ready"] == "1/2" and status["prefill"]["readyReplicas"] == 1
    assert status["prefill"]["selector"] == f"{b.LABEL_DEPLOYMENT}=demo,{pd.LABEL_PD_ROLE}=prefill,{b.LABEL_ROLE}=head"
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Available"]["status"] == "True"  # the decode groups answer alone meanwhile
    assert conditions["Progressing"]["status"] == "True" and conditions["Progressing"]["message"].startswith(
        "prefill groups [1]")
    assert status["phase"] == "Progressing"
    done = with_prefill_status(main, view, [group(view, 0, True), group(view, 1, True)], previous={})
    assert done["phase"] == "Ready" and done["prefill"]["ready"] == "2/2"
    # spec.prefill removed: status.prefill is cleared once
    plain = parse({"resources": CPU, "router": {"enabled": True}})
    cleared = with_prefill_status(main, prefill_view(plain), [], previous=done)
    assert cleared["prefill"] is None
    assert with_prefill_status(main, prefill_view(plain), [], previous=cleared) is main
