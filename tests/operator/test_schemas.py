"""Everything Pagoda hands to Kubernetes, checked against the Kubernetes OpenAPI schemas
(kubernetes-validate, strict: unknown fields are errors), plus the chart's lint and its CRD copy."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from pagoda_operator import builders as b
from pagoda_operator.adapters import build_adapter_job
from pagoda_operator.router import build_router
from pagoda_operator.spec import parse_spec

pytestmark = pytest.mark.operator

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "pagoda.dev_llmdeployments.yaml"
CHART = ROOT / "charts" / "pagoda"
SAMPLES = sorted((ROOT / "crds" / "samples").glob("*.yaml"))
VERSIONS = ["1.30", kubernetes_validate.utils.latest_version()]
HELM = shutil.which("helm") or str(ROOT / ".venv" / "bin" / "helm")


def validate(manifest: dict, version: str) -> None:
    kubernetes_validate.validate(manifest, version, strict=True)


def crd_schema() -> dict:
    return yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def helm(*args: str) -> subprocess.CompletedProcess:
    if not Path(HELM).exists():
        pytest.skip("helm is not installed (make setup installs it)")
    return subprocess.run([HELM, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("version", VERSIONS)
def test_crd_is_a_valid_customresourcedefinition(version):
    validate(yaml.safe_load(CRD.read_text()), version)


def test_chart_ships_the_same_crd():
    assert (CHART / "crds" / CRD.name).read_bytes() == CRD.read_bytes(), \
        "charts/pagoda/crds/ must be a copy of crds/: cp crds/pagoda.dev_llmdeployments.yaml charts/pagoda/crds/"


def test_crd_names_columns_and_subresources():
    crd = yaml.safe_load(CRD.read_text())["spec"]
    assert crd["names"]["shortNames"] == ["llmd"] and crd["scope"] == "Namespaced"
    version = crd["versions"][0]
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "TP", "PP", "DP", "Replicas", "Ready", "Prefill", "Phase", "Model", "ModelReady", "Router", "Adapters",
        "Endpoint", "Age"]
    # the shape in force (status.parallelism): tensorParallelSize and parallelism.tensor are one field
    assert [c["jsonPath"] for c in version["additionalPrinterColumns"][:3]] == [
        ".status.parallelism.tensor", ".status.parallelism.pipeline", ".status.parallelism.data"]
    assert version["subresources"]["scale"] == {"specReplicasPath": ".spec.replicas",
                                                "statusReplicasPath": ".status.replicas",
                                                "labelSelectorPath": ".status.selector"}


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.name)
def test_samples_match_the_crd_schema_and_build_valid_manifests(sample):
    body = yaml.safe_load(sample.read_text())
    jsonschema.Draft4Validator(crd_schema()).validate(body)  # OpenAPI v3.0 schemas are draft-4 style
    body["metadata"].update(namespace="default", uid="00000000-0000-0000-0000-000000000000")
    spec = parse_spec(body, default_image="pagoda-runtime:0.1.0")
    jobs = [build_adapter_job(spec, body, a) for a in spec.adapters or () if a.hub is not None]
    for manifest in b.build_all(spec, body) + build_router(spec, body) + jobs:
        validate(manifest, VERSIONS[0])


def test_cpu_sample_asks_for_no_gpu_and_gpu_sample_for_two_8_gpu_nodes():
    cpu = parse_spec(yaml.safe_load((ROOT / "crds/samples/cpu-smollm2.yaml").read_text()), default_image="x")
    assert cpu.gpus_per_pod == 0 and cpu.model_path is None
    gpu = parse_spec(yaml.safe_load((ROOT / "crds/samples/gpu-llama3-70b.yaml").read_text()), default_image="x")
    assert (gpu.tensor_parallel_size, gpu.pipeline_parallel_size, gpu.gpus_per_pod) == (8, 2, 8)


@pytest.mark.parametrize("bad", [
    {"tensorParallelSize": 0}, {"replicas": -1}, {"restartPolicy": "Always"}, {"engine": {"dtype": "int4"}},
    {"service": {"type": "ExternalName"}}, {"model": {"path": "relative"}}, {"engine": {"gpuMemoryUtilization": 0}},
])
def test_crd_schema_rejects_bad_fields(bad):
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft4Validator(crd_schema()).validate(
            {"apiVersion": b.API_VERSION, "kind": b.KIND, "metadata": {"name": "x"}, "spec": bad})


SPECS = [
    {},
    {"tensorParallelSize": 8, "pipelineParallelSize": 2, "replicas": 3,
     "model": {"path": "/models/m", "volume": {"persistentVolumeClaim": {"claimName": "w", "readOnly": True}}}},
    {"pipelineParallelSize": 4, "model": {"path": "/m", "volume": {"hostPath": {"path": "/data/m"}}},
     "resources": {"requests": {"cpu": "4", "memory": "8Gi"}}, "service": {"type": "NodePort", "port": 80}},
    {"model": {"path": "/m", "volume": {"nfs": {"server": "nfs", "path": "/w"}}},
     "engine": {"maxModelLen": 8192, "maxNumSeqs": 256, "blockSize": 16, "enablePrefixCaching": True,
                "gpuMemoryUtilization": 0.9, "extraArgs": ["--api-key", "k"]},
     "nodeSelector": {"a": "b"}, "tolerations": [{"key": "k", "operator": "Exists", "effect": "NoSchedule"}],
     "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
         "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}]}}},
     "priorityClassName": "p", "imagePullSecrets": [{"name": "r"}], "serviceAccountName": "sa",
     "env": [{"name": "K", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
     "podAnnotations": {"x": "y"}, "podLabels": {"team": "ml"}},
]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("spec", SPECS, ids=range(len(SPECS)))
def test_every_built_manifest_is_valid_kubernetes(spec, version):
    body = {"apiVersion": b.API_VERSION, "kind": b.KIND,
            "metadata": {"name": "demo", "namespace": "ns", "uid": "u"}, "spec": spec}
    jsonschema.Draft4Validator(crd_schema()).validate(body)
    parsed = parse_spec(body, default_image="pagoda-runtime:0.1.0")
    records = {0: b.GroupRecord(epoch=3, recreations=1, recreated_at="2026-01-01T00:00:00Z", pending=True)}
    for manifest in b.build_all(parsed, body, records):
        validate(manifest, version)


def test_helm_lint_is_clean():
    result = helm("lint", "--strict", str(CHART))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("values", [[], ["--set", "watchNamespaces={serving,staging}", "--set", "logLevel=DEBUG"]],
                         ids=["clusterwide", "namespaced"])
def test_helm_template_renders_valid_kubernetes(values):
    result = helm("template", "pagoda", str(CHART), "--namespace", "pagoda-system", "--include-crds", *values)
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    kinds = sorted(d["kind"] for d in docs)
    for doc in docs:
        validate(doc, VERSIONS[0])
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["PAGODA_OPERATOR_RUNTIME_IMAGE"] == "pagoda-runtime:0.1.0"
    managing = [d for d in docs if d["kind"] == "Role" and not d["metadata"]["name"].endswith("-leader-election")]
    if values:
        assert len(managing) == 2 and "ClusterRole" not in kinds
        assert env["PAGODA_OPERATOR_NAMESPACES"] == "serving,staging"
    else:
        assert "ClusterRole" in kinds and not managing and env["PAGODA_OPERATOR_NAMESPACES"] == ""
    # Leader election: a standby replica, and the Lease in the release namespace only.
    (lease_role,) = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"].endswith("-leader-election")]
    assert lease_role["rules"] == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                                    "verbs": ["get", "create", "update"]}]
    assert deployment["spec"]["replicas"] == 2 and deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    assert env["PAGODA_OPERATOR_LEADER_ELECTION"] == "true"
    assert "CustomResourceDefinition" in kinds


def test_rbac_is_least_privilege():
    result = helm("template", "pagoda", str(CHART))
    role = next(d for d in yaml.safe_load_all(result.stdout) if d and d["kind"] == "ClusterRole")
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"]}
    # What pagoda_operator.kube.Cluster and kopf actually call; nothing else.
    expected = {("pagoda.dev", "llmdeployments", v) for v in ("get", "list", "watch")} | {
        ("pagoda.dev", "llmdeployments/status", v) for v in ("get", "patch")} | {
        ("pagoda.dev", "llmdeployments/finalizers", "update")} | {
        ("apps", "statefulsets", v) for v in ("get", "list", "watch", "create", "patch", "delete")} | {
        ("", "services", v) for v in ("get", "create", "patch", "delete")} | {
        ("policy", "poddisruptionbudgets", v) for v in ("get", "create", "patch")} | {
        ("", "pods", v) for v in ("list", "watch", "delete")} | {("", "events", v) for v in ("create", "list")} | {
        ("", "persistentvolumeclaims", v) for v in ("get", "create", "patch")} | {
        ("batch", "jobs", v) for v in ("get", "list", "watch", "create", "delete")} | {
        ("keda.sh", "scaledobjects", v) for v in ("get", "create", "patch", "delete")} | {
        ("autoscaling", "horizontalpodautoscalers", v) for v in ("get", "create", "patch", "delete")} | {
        ("scheduling.volcano.sh", "podgroups", v) for v in ("get", "list", "create", "patch", "delete")} | {
        ("apps", "deployments", v) for v in ("get", "create", "patch", "delete")} | {
        ("", "serviceaccounts", v) for v in ("get", "create", "patch", "delete")} | {
        ("rbac.authorization.k8s.io", r, v) for r in ("roles", "rolebindings")
        for v in ("get", "create", "patch", "delete")} | {
        ("discovery.k8s.io", "endpointslices", v) for v in ("get", "list", "watch")} | {
        ("inference.networking.k8s.io", "inferencepools", v) for v in ("get", "create", "patch")} | {
        ("", "secrets", "get")}  # the runtime's API key for the adapter calls (rbac.readApiKeySecrets)
    assert granted == expected
    assert not any("*" in x for g in granted for x in g)
    without = helm("template", "pagoda", str(CHART), "--set", "rbac.readApiKeySecrets=false")
    role = next(d for d in yaml.safe_load_all(without.stdout) if d and d["kind"] == "ClusterRole")
    assert not any("secrets" in rule["resources"] for rule in role["rules"])


def test_bad_values_are_rejected_by_the_values_schema():
    result = helm("template", "pagoda", str(CHART), "--set", "logLevel=LOUD")
    assert result.returncode != 0 and "logLevel" in result.stderr
