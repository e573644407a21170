"""spec.parallelism (data parallelism, experts over every rank): the spec's rules, the CRD's CEL rules, the
pods of a DP x TP group, their status, and the manifests against the Kubernetes schemas. Pure, no cluster."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from test_model_cache import cel_failures

from pagoda_operator import builders as b
from pagoda_operator.router import build_router
from pagoda_operator.scheduling import KUEUE_GROUP_TOTAL_COUNT, pod_group_spec
from pagoda_operator.spec import InvalidSpec, parse_spec
from pagoda_operator.status import GroupObservation, build_status

pytestmark = pytest.mark.operator

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "pagoda.dev_llmdeployments.yaml"
SAMPLE = ROOT / "crds" / "samples" / "gpu-moe-data-parallel.yaml"
MOE = {"model": {"path": "/models/moe", "volume": {"persistentVolumeClaim": {"claimName": "w"}}}}
HEAD = "demo-g{}-head-0.demo-headless.serving.svc.cluster.local"


def body(spec: dict) -> dict:
    return {"apiVersion": b.API_VERSION, "kind": b.KIND,
            "metadata": {"name": "demo", "namespace": "serving", "uid": "u"}, "spec": spec}


def build(spec: dict):
    parsed = parse_spec(body(spec), default_image="pagoda-runtime:test")
    return parsed, b.build_all(parsed, body(spec))


def statefulsets(manifests) -> dict[str, dict]:
    return {m["metadata"]["name"]: m for m in manifests if m["kind"] == "StatefulSet"}


def container(sts: dict) -> dict:
    return sts["spec"]["template"]["spec"]["containers"][0]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def crd_schema() -> dict:
    return yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


# ----- the pods of a group -----

@pytest.mark.parametrize("data,local,tp", [(2, 1, 1), (4, 2, 2), (8, 8, 1), (6, 3, 4)])
def test_a_group_is_data_over_data_local_pods_of_data_local_x_tp_gpus(data, local, tp):
    spec, manifests = build({**MOE, "tensorParallelSize": tp, "replicas": 2,
                             "parallelism": {"data": data, "dataLocal": local, "expert": True}})
    pods = data // local
    assert spec.pods_per_group == pods and spec.gpus_per_pod == local * tp and spec.world_size == data * tp
    sts = statefulsets(manifests)
    assert sorted(sts) == sorted(f"demo-g{g}-{r}" for g in range(2) for r in (["head", "worker"] if pods > 1
                                                                              else ["head"]))
    for group in range(2):
        assert sts[f"demo-g{group}-head"]["spec"]["replicas"] == 1
        if pods > 1:
            worker = sts[f"demo-g{group}-worker"]
            assert worker["spec"]["replicas"] == pods - 1 and worker["spec"]["ordinals"] == {"start": 1}
        for role in ["head", "worker"] if pods > 1 else ["head"]:
            c = container(sts[f"demo-g{group}-{role}"])
            args = c["args"]
            assert c["resources"]["limits"] == {"nvidia.com/gpu": str(local * tp)}
            assert flag(args, "--tensor-parallel-size") == str(tp) and flag(args, "--pipeline-parallel-size") == "1"
            assert flag(args, "--data-parallel-size") == str(data)
            assert flag(args, "--data-parallel-size-local") == str(local)
            # rendezvous through the headless Service's stable name of the group's rank 0
            assert flag(args, "--data-parallel-address") == HEAD.format(group)
            assert flag(args, "--data-parallel-rpc-port") == "29550"
            assert "--enable-expert-parallel" in args
            # each pod's tensor-parallel world stays inside it: no cross-pod torch rendezvous flags
            assert not {"--nnodes", "--master-addr", "--master-port"} & set(args)
            assert flag(args, "--node-rank") == "0"  # not the pod index, which PAGODA_NODE_RANK would default it to
            assert ("--headless" in args) == (role == "worker")
            assert {"name": "dp-rpc", "containerPort": 29550, "protocol": "TCP"} in c["ports"]


def test_workers_start_at_their_ordinal_times_data_local(tmp_path):
    """dataLocal 1: the pod index is the start rank ($(VAR) expansion); dataLocal > 1: a shell multiplies."""
    _, manifests = build({**MOE, "parallelism": {"data": 4, "dataLocal": 1}})
    worker = container(statefulsets(manifests)["demo-g0-worker"])
    assert "command" not in worker and flag(worker["args"], "--data-parallel-start-rank") == "$(PAGODA_NODE_RANK)"
    head = container(statefulsets(manifests)["demo-g0-head"])
    assert "command" not in head and "--data-parallel-start-rank" not in head["args"]  # rank 0, the default

    _, manifests = build({**MOE, "parallelism": {"data": 6, "dataLocal": 2}})
    worker = container(statefulsets(manifests)["demo-g0-worker"])
    assert "--data-parallel-start-rank" not in worker["args"] and worker["command"][:2] == ["/bin/sh", "-c"]
    fake = tmp_path / "pagoda"  # stands for the image's pagoda: prints the arguments it was started with
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    for ordinal, start in [(1, 2), (2, 4)]:
        ran = subprocess.run(worker["command"] + worker["args"], capture_output=True, text=True, check=True,
                             env={"PATH": f"{tmp_path}:{os.environ['PATH']}", "PAGODA_NODE_RANK": str(ordinal)})
        assert ran.stdout.splitlines() == worker["args"] + ["--data-parallel-start-rank", str(start)]


def test_without_data_parallelism_the_pods_are_unchanged():
    """parallelism.data 1 (or the field absent) renders exactly the pods of before: no group restarts on upgrade."""
    base = {**MOE, "tensorParallelSize": 2, "pipelineParallelSize": 2}
    plain, _ = build(base)
    for same in ({"parallelism": {}}, {"parallelism": {"data": 1, "tensor": 2}}, {"parallelism": {"expert": False}}):
        spec, _ = build({**base, **same})
        assert b.group_revision(spec, 0, 0) == b.group_revision(plain, 0, 0), same
    expert, manifests = build({**base, "parallelism": {"expert": True}})  # EP over TP alone, as before
    assert b.group_revision(expert, 0, 0) != b.group_revision(plain, 0, 0)
    args = container(statefulsets(manifests)["demo-g0-worker"])["args"]
    assert "--enable-expert-parallel" in args and flag(args, "--node-rank") == "$(PAGODA_NODE_RANK)"


def test_the_service_selects_heads_and_the_headless_service_names_the_rpc_port():
    _, manifests = build({**MOE, "parallelism": {"data": 2, "dataLocal": 1, "dataRPCPort": 13345}})
    services = {m["metadata"]["name"]: m for m in manifests if m["kind"] == "Service"}
    assert services["demo"]["spec"]["selector"] == b.head_selector(parse_spec(body(MOE), default_image="i"))
    assert {"name": "dp-rpc", "port": 13345, "targetPort": "dp-rpc"} in services["demo-headless"]["spec"]["ports"]
    worker = container(statefulsets(manifests)["demo-g0-worker"])
    assert flag(worker["args"], "--data-parallel-rpc-port") == "13345"


def test_gangs_count_every_pod_of_a_dp_group():
    spec, _ = build({**MOE, "tensorParallelSize": 2, "parallelism": {"data": 8, "dataLocal": 2},
                     "scheduling": {"gang": "volcano"}})
    assert pod_group_spec(spec, b.build_resources(spec)) == {"minMember": 4, "minResources": {"nvidia.com/gpu": "16"}}
    _, manifests = build({**MOE, "parallelism": {"data": 4, "dataLocal": 2}, "scheduling": {"gang": "kueue"}})
    for sts in statefulsets(manifests).values():
        assert sts["spec"]["template"]["metadata"]["annotations"][KUEUE_GROUP_TOTAL_COUNT] == "2"


# ----- the spec's rules -----

@pytest.mark.parametrize("spec,message", [
    ({"parallelism": {"data": 3, "dataLocal": 2}}, "parallelism.data (3) is not a multiple of parallelism.dataLocal (2)"),
    ({"parallelism": {"data": 1, "dataLocal": 2}}, "parallelism.data (1) is not a multiple of parallelism.dataLocal"),
    ({"parallelism": {"data": 2}, "pipelineParallelSize": 2}, "parallelism.data (2) with pipeline parallelism"),
    ({"parallelism": {"data": 2, "pipeline": 2}}, "parallelism.data (2) with pipeline parallelism"),
    ({"parallelism": {"tensor": 4}, "tensorParallelSize": 2}, "parallelism.tensor (4) and tensorParallelSize (2) differ"),
    ({"parallelism": {"pipeline": 2}, "pipelineParallelSize": 3}, "parallelism.pipeline (2) and pipelineParallelSize"),
    ({"parallelism": {"expert": True}}, "parallelism.expert is true but the model is the built-in default"),
    ({"parallelism": {"expert": True}, "model": {"servedName": "x"}}, "parallelism.expert is true but the model"),
    ({"parallelism": {"data": 0}}, "parallelism.data must be an integer >= 1"),
    ({"parallelism": {"dataRPCPort": 70000}}, "parallelism.dataRPCPort must be a port number"),
    ({"parallelism": {"expert": "yes"}, **MOE}, "parallelism.expert must be true or false"),
    ({"parallelism": [2]}, "parallelism must be an object"),
    ({"parallelism": {"data": 2}, **MOE, "engine": {"extraArgs": ["--data-parallel-size", "4"]}},
     "engine.extraArgs must not set --data-parallel-size"),
    ({**MOE, "engine": {"extraArgs": ["--headless"]}}, "engine.extraArgs must not set --headless"),
    ({**MOE, "parallelism": {"expert": False}, "engine": {"extraArgs": ["--enable-expert-parallel"]}},
     "must not set --enable-expert-parallel with parallelism.expert"),
    ({**MOE, "tensorParallelSize": 2, "parallelism": {"data": 4, "dataLocal": 2},
      "resources": {"limits": {"nvidia.com/gpu": 2}}}, "parallelism.dataLocal x tensorParallelSize = 2 x 2 = 4"),
    ({"tensorParallelSize": 64, "parallelism": {"data": 8}}, "tensorParallelSize x parallelism.data = 64 x 8"),
    ({**MOE, "parallelism": {"data": 2, "dataLocal": 1}, "scheduling": {"topologyKey": "kubernetes.io/hostname"}},
     "every data-parallel pod of a group on one node"),
])
def test_impossible_shapes_are_refused_naming_the_field(spec, message):
    with pytest.raises(InvalidSpec) as e:
        parse_spec(body(spec), default_image="i")
    assert message in str(e.value)


def test_aliases_and_defaults():
    spec = parse_spec(body({**MOE, "parallelism": {"tensor": 4, "pipeline": 2}, "tensorParallelSize": 4}),
                      default_image="i")
    assert (spec.tensor_parallel_size, spec.pipeline_parallel_size, spec.pods_per_group) == (4, 2, 2)
    spec = parse_spec(body({**MOE, "parallelism": {"data": 4}}), default_image="i")
    assert (spec.data_parallel_size_local, spec.pods_per_group, spec.gpus_per_pod) == (4, 1, 4)  # vLLM's default
    # the user's own --enable-expert-parallel stays theirs while parallelism.expert is not given
    spec = parse_spec(body({**MOE, "engine": {"extraArgs": ["--enable-expert-parallel"]}}), default_image="i")
    assert spec.enable_expert_parallel is None


# ----- the CRD at apply time (CEL, as the API server evaluates it) -----

@pytest.mark.parametrize("spec,broken", [
    ({"parallelism": {"data": 4, "dataLocal": 2}, **MOE}, None),
    ({**MOE, "parallelism": {"data": 4}, "tensorParallelSize": 2}, None),
    ({**MOE, "parallelism": {"tensor": 2}, "tensorParallelSize": 2}, None),
    ({"parallelism": {"expert": True}, "model": {"name": "org/moe"}}, None),
    ({"parallelism": {"expert": False}}, None),
    ({"parallelism": {"data": 1}, "pipelineParallelSize": 4}, None),
    ({"parallelism": {"data": 3, "dataLocal": 2}}, "parallelism.data must be a multiple of parallelism.dataLocal"),
    ({"parallelism": {"dataLocal": 2}}, "parallelism.data must be a multiple of parallelism.dataLocal"),
    ({"parallelism": {"data": 2}, "pipelineParallelSize": 2}, "parallelism.data > 1 excludes pipeline parallelism"),
    ({"parallelism": {"data": 2, "pipeline": 2}}, "parallelism.data > 1 excludes pipeline parallelism"),
    ({"parallelism": {"tensor": 4}, "tensorParallelSize": 2}, "parallelism.tensor and tensorParallelSize differ"),
    ({"parallelism": {"pipeline": 1}, "pipelineParallelSize": 2}, "parallelism.pipeline and pipelineParallelSize"),
    ({"parallelism": {"expert": True}}, "parallelism.expert needs spec.model"),
    ({"parallelism": {"expert": True}, "model": {"servedName": "x"}}, "parallelism.expert needs spec.model"),
])
def test_the_crd_refuses_impossible_shapes_at_apply_time(spec, broken):
    failures = cel_failures(crd_schema()["properties"]["spec"], spec)
    if broken is None:
        assert failures == []
        jsonschema.Draft4Validator(crd_schema()).validate(body(spec))
        parse_spec(body(spec), default_image="i")  # what the CRD admits, the operator realises
    else:
        assert any(broken in f for f in failures), failures
        with pytest.raises(InvalidSpec):  # and the operator refuses it too (a CRD without the rules)
            parse_spec(body(spec), default_image="i")


@pytest.mark.parametrize("bad", [{"data": 0}, {"dataLocal": 0}, {"dataRPCPort": 0}, {"dataRPCPort": 65536},
                                 {"expert": "yes"}, {"tensor": 0}, {"data": 1.5}])
def test_the_crd_schema_types_parallelism(bad):
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft4Validator(crd_schema()).validate(body({"parallelism": bad}))


# ----- status and the sample -----

def test_a_dp_group_is_ready_only_when_every_pod_is():
    spec = parse_spec(body({**MOE, "parallelism": {"data": 4, "dataLocal": 1}}), default_image="i")
    rev = b.group_revision(spec, 0, 0)

    def pod(name, ready=True):
        return {"metadata": {"name": name, "labels": {b.LABEL_REVISION: rev}},
                "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": str(ready)}]}}

    def observe(pods):
        return GroupObservation(index=0, size=spec.pods_per_group, wanted_revision=rev, revision=rev, pods=pods)
    names = ["demo-g0-head-0"] + [f"demo-g0-worker-{i}" for i in (1, 2, 3)]
    assert observe([pod(n) for n in names]).ready
    assert not observe([pod(n) for n in names[:3]]).ready
    assert not observe([pod(n, ready=n != names[2]) for n in names]).ready
    status = build_status(spec, [observe([pod(n) for n in names])], generation=1)
    assert status["parallelism"] == {"tensor": 1, "pipeline": 1, "data": 4, "dataLocal": 1, "expert": False,
                                     "podsPerGroup": 4}
    assert status["readyReplicas"] == 1 and status["phase"] == "Ready"


@pytest.mark.parametrize("version", ["1.30", kubernetes_validate.utils.latest_version()])
@pytest.mark.parametrize("spec", [
    {**MOE, "tensorParallelSize": 2, "parallelism": {"data": 4, "dataLocal": 2, "expert": True}},
    {**MOE, "parallelism": {"data": 2, "dataLocal": 1, "dataRPCPort": 13345}, "replicas": 2,
     "router": {"enabled": True, "policy": "precise"}},
    {**MOE, "parallelism": {"data": 2}},
])
def test_dp_manifests_are_valid_kubernetes(spec, version):
    jsonschema.Draft4Validator(crd_schema()).validate(body(spec))
    parsed, manifests = build(spec)
    for manifest in manifests + build_router(parsed, body(spec)):
        kubernetes_validate.validate(manifest, version, strict=True)
    if parsed.router:  # the router balances over the groups' API servers: the heads behind Service X
        args = next(m for m in build_router(parsed, body(spec)) if m["kind"] == "Deployment")[
            "spec"]["template"]["spec"]["containers"][0]["args"]
        assert flag(args, "--k8s-service") == "demo"


def test_the_dp_sample_spreads_experts_over_two_pods():
    sample = yaml.safe_load(SAMPLE.read_text())
    jsonschema.Draft4Validator(crd_schema()).validate(sample)
    assert cel_failures(crd_schema()["properties"]["spec"], sample["spec"]) == []
    spec = parse_spec(sample, default_image="i")
    assert (spec.data_parallel_size, spec.pods_per_group, spec.enable_expert_parallel) == (16, 2, True)
    assert spec.gpus_per_pod == 8


# ----- the runtime's parser (once it has the data-parallel flags) -----

def test_dp_pod_args_parse_with_the_runtime_cli(monkeypatch):
    cli = pytest.importorskip("pagoda.entrypoints.cli", reason="the runtime package is not importable")
    parser = cli.build_parser()
    try:
        parser.parse_args(["serve", "--headless"])
    except SystemExit:
        pytest.skip("the runtime's `pagoda serve` has no --headless yet (issue 53's runtime part)")
    for var in [v for v in os.environ if v.startswith("PAGODA_")]:
        monkeypatch.delenv(var)
    spec, manifests = build({**MOE, "tensorParallelSize": 2, "parallelism": {"data": 4, "dataLocal": 2,
                                                                             "expert": True}})
    for sts in statefulsets(manifests).values():
        c = container(sts)
        ordinal = sts["spec"]["ordinals"]["start"]
        args = c["args"] + (["--data-parallel-start-rank", str(ordinal * 2)] if c.get("command") else [])
        ns = parser.parse_args([a.replace("$(PAGODA_NODE_RANK)", str(ordinal)) for a in args])
        assert (ns.data_parallel_size, ns.data_parallel_size_local, ns.tensor_parallel_size) == (4, 2, 2)
        assert ns.data_parallel_address == HEAD.format(0) and ns.data_parallel_rpc_port == 29550
        assert ns.headless == (ordinal > 0) and ns.enable_expert_parallel
        assert ns.data_parallel_start_rank == ordinal * 2


def test_dp_rpc_port_default_is_vllms_in_the_runtime_and_the_operator():
    """vLLM's ParallelConfig.data_parallel_rpc_port defaults to 29550: the runtime's flag and the operator's
    spec.parallelism.dataRPCPort default to it too, so a pod without the flag still meets its head."""
    args = pytest.importorskip("pagoda.config.args", reason="the runtime package is not importable")
    from pagoda_operator.spec import DEFAULT_DATA_RPC_PORT

    assert args.EngineArgs(model="m").data_parallel_rpc_port == DEFAULT_DATA_RPC_PORT == 29550
