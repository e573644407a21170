"""spec.autoscaling and spec.scheduling, pure: parsing, the ScaledObject / HPA / PodGroup builders and the
pods' placement fields, each checked against its real schema (Kubernetes' OpenAPI for the HPA and pods;
the upstream KEDA and Volcano CRD schemas vendored in schemas/ for ScaledObjects and PodGroups)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import promql_parser
import pytest
import yaml
from test_monitoring import PODMONITOR_SCHEMA, exported_metrics, matches, render
from test_schemas import CHART, CRD, VERSIONS, crd_schema, helm

from pagoda_operator import autoscaling as a
from pagoda_operator import builders as b
from pagoda_operator import scheduling as s
from pagoda_operator.spec import InvalidSpec, parse_spec
from pagoda_operator.status import build_status, with_spec_unrealised

pytestmark = pytest.mark.operator

SCHEMAS = Path(__file__).parent / "schemas"
OWNER = {"apiVersion": b.API_VERSION, "kind": b.KIND, "metadata": {"name": "llama", "namespace": "serving",
                                                                   "uid": "uid-llama"}}
PROMETHEUS = "http://prometheus.monitoring.svc:9090"


def closed(schema: dict) -> dict:
    """A CRD schema as the API server applies it with strict field validation: an object that lists its
    properties (and does not preserve unknown fields) rejects any other field."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if node.get("properties") is not None and "additionalProperties" not in node \
                    and not node.get("x-kubernetes-preserve-unknown-fields"):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
    walk(schema)
    return schema


def vendored(name: str) -> jsonschema.Draft4Validator:
    return jsonschema.Draft4Validator(closed(yaml.safe_load((SCHEMAS / name).read_text())))


SCALED_OBJECT_SCHEMA = vendored("keda.sh_v1alpha1_scaledobject.yaml")
POD_GROUP_SCHEMA = vendored("scheduling.volcano.sh_v1beta1_podgroup.yaml")


def parse(spec: dict):
    return parse_spec({**OWNER, "spec": spec}, default_image="pagoda-runtime:test")


def manifests_json(spec: dict) -> str:
    """Every manifest, except the recorded spec text on the headless Service (and so its applied hash)."""
    manifests = b.build_all(parse(spec), {**OWNER, "spec": spec})
    for manifest in manifests:
        for key in (b.ANNOTATION_VALID_SPEC, b.ANNOTATION_APPLIED_HASH):
            manifest["metadata"].get("annotations", {}).pop(key, None)
    return json.dumps(manifests, sort_keys=True)


# ----- autoscaling: parsing -----

@pytest.mark.parametrize("autoscaling,needle", [
    ({"minReplicas": 1}, "maxReplicas is required"),
    ({"minReplicas": 3, "maxReplicas": 2}, "autoscaling.maxReplicas must be an integer >= 3"),
    ({"maxReplicas": 0}, "autoscaling.maxReplicas must be an integer >= 1"),
    ({"maxReplicas": 2, "minReplicas": -1}, "autoscaling.minReplicas"),
    ({"maxReplicas": 2, "metric": "kvcache"}, "did you mean kvCache"),
    ({"maxReplicas": 2, "metric": ""}, "autoscaling.metric"),
    ({"maxReplicas": 2, "metric": "sum(rate(http_requests_total[1m]))"}, "autoscaling.target is required"),
    ({"maxReplicas": 2, "target": 0}, "autoscaling.target must be a number > 0"),
    ({"maxReplicas": 2, "target": True}, "autoscaling.target must be a number > 0"),
    ({"maxReplicas": 2, "metric": "kvCache", "target": 80}, "fraction of KV-cache blocks"),
    ({"maxReplicas": 2, "minReplicas": 0}, "could never scale up again"),
    ({"maxReplicas": 2, "minReplicas": 0, "metric": "kvCache"}, "could never scale up again"),
    ({"maxReplicas": 2, "prometheusAddress": "prometheus:9090"}, "prometheusAddress must be an http(s) URL"),
])
def test_bad_autoscaling_is_refused_with_the_field_named(autoscaling, needle):
    with pytest.raises(InvalidSpec, match=needle.replace("(", r"\(").replace(")", r"\)")):
        parse({"autoscaling": autoscaling})


def test_autoscaling_defaults():
    scaling = parse({"autoscaling": {"maxReplicas": 4}}).autoscaling
    assert (scaling.min_replicas, scaling.max_replicas, scaling.metric, scaling.target) == (1, 4, "queue", 5.0)
    assert parse({"autoscaling": {"maxReplicas": 4, "metric": "kvCache"}}).autoscaling.target == 0.8
    assert parse({}).autoscaling is None


# ----- autoscaling: the ScaledObject (KEDA) -----

def test_scaled_object_targets_the_scale_subresource_with_a_prometheus_trigger():
    spec = parse({"autoscaling": {"minReplicas": 1, "maxReplicas": 6, "metric": "queue", "target": 4}})
    plan = a.plan_autoscaler(spec, OWNER, keda=True, prometheus_address=PROMETHEUS)
    assert plan.kind == "ScaledObject" and plan.error is None
    so = plan.manifest
    SCALED_OBJECT_SCHEMA.validate(so)
    assert so["metadata"]["name"] == "llama" and so["metadata"]["ownerReferences"][0]["uid"] == "uid-llama"
    assert so["spec"]["scaleTargetRef"] == {"apiVersion": "pagoda.dev/v1alpha1", "kind": "LLMDeployment",
                                            "name": "llama"}
    assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]) == (1, 6)
    (trigger,) = so["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert trigger["metadata"] == {
        "serverAddress": PROMETHEUS, "threshold": "4",
        "query": 'sum(pagoda:num_requests_waiting{namespace="serving",llmdeployment="llama",role="head"})'}


def test_scaled_object_kv_cache_custom_query_and_per_deployment_prometheus():
    kv = parse({"autoscaling": {"maxReplicas": 3, "metric": "kvCache", "target": 0.75}})
    (trigger,) = a.build_scaled_object(kv, OWNER, PROMETHEUS)["spec"]["triggers"]
    assert trigger["metadata"]["query"].startswith("sum(pagoda:kv_cache_usage_perc{")
    assert trigger["metadata"]["threshold"] == "0.75"
    custom = parse({"autoscaling": {"minReplicas": 0, "maxReplicas": 3, "target": 50,
                                    "metric": 'sum(rate(nginx_ingress_controller_requests{service="llama"}[1m]))',
                                    "prometheusAddress": "http://team-prometheus.ml:9090"}})
    so = a.build_scaled_object(custom, OWNER, PROMETHEUS)
    SCALED_OBJECT_SCHEMA.validate(so)
    assert so["spec"]["minReplicaCount"] == 0  # scale to zero, with KEDA
    assert so["spec"]["triggers"][0]["metadata"] == {
        "serverAddress": "http://team-prometheus.ml:9090", "threshold": "50",
        "query": 'sum(rate(nginx_ingress_controller_requests{service="llama"}[1m]))'}


def test_the_vendored_keda_schema_is_strict():
    so = a.build_scaled_object(parse({"autoscaling": {"maxReplicas": 2}}), OWNER, PROMETHEUS)
    so["spec"]["minReplicas"] = 1  # the HPA's name for it, not KEDA's
    with pytest.raises(jsonschema.ValidationError, match="minReplicas"):
        SCALED_OBJECT_SCHEMA.validate(so)


def test_built_in_queries_name_metrics_and_labels_the_runtime_and_podmonitor_provide():
    """The queries parse as PromQL, their metric names are the runtime's own (read from its registry) and
    their label matchers are labels every scraped sample has: the runtime's, Prometheus' target labels
    and the chart's PodMonitor relabelings."""
    names, runtime_labels = exported_metrics()
    (podmonitor,) = [d for d in render("--set", "monitoring.podMonitor.enabled=true")
                     if d["kind"] == "PodMonitor" and d["metadata"]["name"].endswith("-runtime")]
    relabelled = {r["targetLabel"] for e in podmonitor["spec"]["podMetricsEndpoints"] for r in e["relabelings"]}
    available = runtime_labels | relabelled | {"namespace", "pod"}
    for metric in ("queue", "kvCache"):
        spec = parse({"autoscaling": {"maxReplicas": 2, "metric": metric}})
        expr = promql_parser.parse(a.query(spec))
        selector = expr.expr
        assert selector.name == a.METRIC_NAMES[metric] and selector.name in names
        assert {m.name for m in selector.matchers.matchers} <= available


# ----- autoscaling: the HPA (no KEDA) -----

@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("metric,target,average", [("queue", 4, "4"), ("kvCache", 0.8, "800m")])
def test_hpa_on_pods_metrics_is_valid_kubernetes(metric, target, average, version):
    spec = parse({"autoscaling": {"minReplicas": 2, "maxReplicas": 5, "metric": metric, "target": target}})
    plan = a.plan_autoscaler(spec, OWNER, keda=False, prometheus_address=PROMETHEUS)
    assert plan.kind == "HorizontalPodAutoscaler" and plan.error is None
    hpa = plan.manifest
    kubernetes_validate.validate(hpa, version, strict=True)
    assert hpa["metadata"]["name"] == "llama" and hpa["spec"]["scaleTargetRef"]["kind"] == "LLMDeployment"
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 5)
    (pods,) = hpa["spec"]["metrics"]
    name = pods["pods"]["metric"]["name"]
    assert name == a.METRIC_NAMES[metric]
    # The API server's rule for metric names (a URL path segment of the custom metrics API): the colon is fine.
    assert name not in (".", "..") and not {"/", "%"} & set(name)
    assert pods["pods"]["target"] == {"type": "AverageValue", "averageValue": average}


@pytest.mark.parametrize("autoscaling,needle", [
    ({"minReplicas": 0, "maxReplicas": 2, "metric": "sum(x)", "target": 1}, "scale to zero) needs KEDA"),
    ({"maxReplicas": 2, "metric": "sum(x)", "target": 1}, "PromQL autoscaling.metric needs KEDA"),
])
def test_without_keda_what_an_hpa_cannot_do_is_refused(autoscaling, needle):
    spec = parse({"autoscaling": autoscaling})
    plan = a.plan_autoscaler(spec, OWNER, keda=False, prometheus_address=PROMETHEUS)
    assert plan.manifest is None and needle in plan.error
    status = build_status(spec, [], generation=1)
    status = with_spec_unrealised(status, [("AutoscalingUnsupported", plan.error)], {}, "2026-01-01T00:00:00Z")
    spec_valid = next(c for c in status["conditions"] if c["type"] == "SpecValid")
    assert (spec_valid["status"], spec_valid["reason"]) == ("False", "AutoscalingUnsupported")
    assert needle in spec_valid["message"]


def test_no_autoscaling_plans_nothing():
    plan = a.plan_autoscaler(parse({}), OWNER, keda=True, prometheus_address=PROMETHEUS)
    assert (plan.kind, plan.manifest, plan.error) == (None, None, None)


# ----- scheduling -----

PLAIN_SPECS = [{}, {"model": {"path": "/models/llama"}, "pipelineParallelSize": 2, "tensorParallelSize": 4, "replicas": 2,
                    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchExpressions": [{"key": "g", "operator": "Exists"}]}]}}},
                    "podAnnotations": {"a": "b"}}]


@pytest.mark.parametrize("spec", PLAIN_SPECS, ids=range(len(PLAIN_SPECS)))
def test_without_scheduling_nothing_changes(spec):
    """An absent scheduling block and one that asks for nothing render the same bytes (so the same group
    revisions: adding `scheduling: {}` rolls no group)."""
    plain = manifests_json(spec)
    assert manifests_json({**spec, "scheduling": {}}) == plain
    assert manifests_json({**spec, "scheduling": {"gang": "none"}}) == plain
    assert "schedulerName" not in plain and "podAffinity" not in plain
    assert b.build_pod_groups(parse(spec), OWNER) == []


@pytest.mark.parametrize("version", VERSIONS)
def test_volcano_gang_pod_groups_and_pods(version):
    spec_dict = {"model": {"path": "/models/llama"}, "pipelineParallelSize": 2, "tensorParallelSize": 8, "replicas": 2,
                 "priorityClassName": "llm",
                 "resources": {"limits": {"nvidia.com/gpu": 8, "memory": "200Gi"}, "requests": {"cpu": "7500m"}},
                 "scheduling": {"gang": "volcano", "queue": "inference"}}
    spec = parse(spec_dict)
    groups = b.build_pod_groups(spec, OWNER)
    assert [g["metadata"]["name"] for g in groups] == ["llama-g0", "llama-g1"]
    for index, group in enumerate(groups):
        POD_GROUP_SCHEMA.validate(group)
        assert group["apiVersion"] == "scheduling.volcano.sh/v1beta1"
        assert group["metadata"]["ownerReferences"][0]["uid"] == "uid-llama"
        assert group["metadata"]["labels"][b.LABEL_GROUP] == str(index)
        assert group["spec"] == {"minMember": 2, "queue": "inference", "priorityClassName": "llm",
                                 "minResources": {"nvidia.com/gpu": "16", "memory": "429496729600", "cpu": "15"}}
    for manifest in b.build_all(spec, {**OWNER, "spec": spec_dict}):
        kubernetes_validate.validate(manifest, version, strict=True)
        if manifest["kind"] != "StatefulSet":
            continue
        template = manifest["spec"]["template"]
        group = manifest["metadata"]["labels"][b.LABEL_GROUP]
        assert template["spec"]["schedulerName"] == "volcano"
        assert template["metadata"]["annotations"][s.VOLCANO_GROUP_ANNOTATION] == f"llama-g{group}"


def test_scheduler_name_is_the_users_and_cpu_groups_have_no_gpu_min_resources():
    spec = parse({"scheduling": {"gang": "volcano", "schedulerName": "volcano-gpu"},
                  "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}}, "pipelineParallelSize": 3})
    pod = b.build_all(spec, OWNER)[3]["spec"]["template"]
    assert pod["spec"]["schedulerName"] == "volcano-gpu"
    (group,) = b.build_pod_groups(spec, OWNER)
    assert group["spec"] == {"minMember": 3, "minResources": {"cpu": "1.5", "memory": "3221225472"}}
    only_name = parse({"scheduling": {"schedulerName": "my-scheduler"}})
    pod = b.build_all(only_name, OWNER)[3]["spec"]["template"]
    assert pod["spec"]["schedulerName"] == "my-scheduler" and "annotations" not in pod["metadata"]


@pytest.mark.parametrize("version", VERSIONS)
def test_kueue_pod_group_labels_and_annotations(version):
    spec_dict = {"pipelineParallelSize": 4, "replicas": 2, "podAnnotations": {"team": "ml"},
                 "scheduling": {"gang": "kueue", "queue": "gpu-queue"}}
    spec = parse(spec_dict)
    assert b.build_pod_groups(spec, OWNER) == []
    for manifest in b.build_all(spec, {**OWNER, "spec": spec_dict}):
        kubernetes_validate.validate(manifest, version, strict=True)
        if manifest["kind"] != "StatefulSet":
            continue
        meta = manifest["spec"]["template"]["metadata"]
        group = manifest["metadata"]["labels"][b.LABEL_GROUP]
        assert meta["labels"][s.KUEUE_GROUP_NAME] == f"llama-g{group}"
        assert meta["labels"][s.KUEUE_QUEUE_NAME] == "gpu-queue"
        assert meta["annotations"] == {"team": "ml", s.KUEUE_GROUP_NAME: f"llama-g{group}",
                                       s.KUEUE_GROUP_TOTAL_COUNT: "4", s.KUEUE_GROUP_SERVING: "true"}
        assert "schedulerName" not in manifest["spec"]["template"]["spec"]  # Kueue gates, the default scheduler places


@pytest.mark.parametrize("version", VERSIONS)
def test_topology_key_adds_a_required_pod_affinity_to_the_group(version):
    user_affinity = {"podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1,
                     "podAffinityTerm": {"labelSelector": {"matchLabels": {"x": "y"}}, "topologyKey": "zone"}}]}}
    spec_dict = {"pipelineParallelSize": 2, "replicas": 2, "affinity": user_affinity,
                 "scheduling": {"topologyKey": "network.example.com/nvlink-domain"}}
    spec = parse(spec_dict)
    for manifest in b.build_all(spec, {**OWNER, "spec": spec_dict}):
        kubernetes_validate.validate(manifest, version, strict=True)
        if manifest["kind"] != "StatefulSet":
            continue
        group = manifest["metadata"]["labels"][b.LABEL_GROUP]
        affinity = manifest["spec"]["template"]["spec"]["affinity"]
        assert affinity["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"] == \
            user_affinity["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
        (term,) = affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term == {"labelSelector": {"matchLabels": {b.LABEL_DEPLOYMENT: "llama", b.LABEL_GROUP: group}},
                        "matchLabelKeys": [b.LABEL_REVISION], "topologyKey": "network.example.com/nvlink-domain"}
    assert spec.affinity == user_affinity  # the user's spec is not modified


@pytest.mark.parametrize("scheduling,needle", [
    ({"gang": "slurm"}, "scheduling.gang must be one of"),
    ({"queue": "q"}, "needs gang volcano or kueue"),
    ({"gang": "kueue", "queue": "Bad_Queue"}, "scheduling.queue must be"),
    ({"schedulerName": "Not A Name"}, "scheduling.schedulerName"),
    ({"topologyKey": "bad key"}, "scheduling.topologyKey"),
])
def test_bad_scheduling_is_refused_with_the_field_named(scheduling, needle):
    with pytest.raises(InvalidSpec, match=needle):
        parse({"scheduling": scheduling})


def test_hostname_topology_key_conflicts_with_gpu_pipeline_stages_on_distinct_nodes():
    with pytest.raises(InvalidSpec, match="different nodes"):
        parse({"pipelineParallelSize": 2, "scheduling": {"topologyKey": "kubernetes.io/hostname"}})
    # One stage per group, or CPU pods (spread is only a preference there): allowed.
    parse({"scheduling": {"topologyKey": "kubernetes.io/hostname"}})
    parse({"pipelineParallelSize": 2, "resources": {"requests": {"cpu": "1"}},
           "scheduling": {"topologyKey": "kubernetes.io/hostname"}})


# ----- the CRD -----

def test_crd_schema_takes_the_new_fields_and_the_status_autoscaler():
    validator = jsonschema.Draft4Validator(closed(crd_schema()))
    body = {**OWNER, "spec": {"autoscaling": {"minReplicas": 0, "maxReplicas": 4, "metric": "sum(up)",
                                              "target": 2.5, "prometheusAddress": "http://p:9090"},
                              "scheduling": {"schedulerName": "volcano", "gang": "volcano", "queue": "q",
                                             "topologyKey": "topology.kubernetes.io/zone"}},
            "status": {"autoscaler": "ScaledObject"}}
    validator.validate(body)
    for bad in ({"autoscaling": {"minReplicas": 1}}, {"autoscaling": {"maxReplicas": 2, "target": 0}},
                {"scheduling": {"gang": "slurm"}}, {"autoscaling": {"maxReplicas": 2, "minReplica": 1}}):
        with pytest.raises(jsonschema.ValidationError):
            validator.validate({**OWNER, "spec": bad})
    crd = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]
    # The autoscalers scale through this subresource: the paths the operator reads and writes.
    assert crd["subresources"]["scale"] == {"specReplicasPath": ".spec.replicas",
                                            "statusReplicasPath": ".status.replicas",
                                            "labelSelectorPath": ".status.selector"}


# ----- the chart: the operator's /metrics, scraped by the monitoring pack -----

def test_chart_serves_and_scrapes_the_operator_metrics():
    docs = render("--set", "monitoring.podMonitor.enabled=true", "--set", "metricsPort=9102",
                  "--set", "prometheusAddress=http://prom.obs.svc:9090")
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["PAGODA_OPERATOR_METRICS_PORT"] == "9102"
    assert env["PAGODA_OPERATOR_PROMETHEUS_ADDRESS"] == "http://prom.obs.svc:9090"
    assert {"name": "metrics", "containerPort": 9102} in container["ports"]
    (operator_monitor,) = [d for d in docs if d["kind"] == "PodMonitor" and d["metadata"]["name"].endswith("-operator")]
    jsonschema.Draft4Validator(yaml.safe_load(PODMONITOR_SCHEMA.read_text())).validate(operator_monitor)
    assert matches(operator_monitor["spec"]["selector"], pod["metadata"]["labels"])
    assert operator_monitor["spec"]["namespaceSelector"] == {"matchNames": ["pagoda-system"]}
    assert [e["port"] for e in operator_monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]

    off = render("--set", "monitoring.podMonitor.enabled=true", "--set", "metricsPort=0")
    assert [d["metadata"]["name"] for d in off if d["kind"] == "PodMonitor"] == ["pagoda-runtime"]
    container = next(d for d in off if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert [p["name"] for p in container["ports"]] == ["health"]


@pytest.mark.parametrize("flag", ["metricsPort=-1", "prometheusAddress=prometheus:9090"])
def test_bad_values_for_the_new_settings_are_rejected(flag):
    result = helm("template", "pagoda", str(CHART), "--set", flag)
    assert result.returncode != 0 and flag.split("=")[0] in result.stderr, result.stderr


# ----- the samples -----

SAMPLES = sorted((CRD.parent / "samples").glob("*.yaml"))


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.name)
def test_samples_autoscalers_and_pod_groups_match_their_schemas(sample):
    body = yaml.safe_load(sample.read_text())
    body["metadata"].update(namespace="default", uid="00000000-0000-0000-0000-000000000000")
    spec = parse_spec(body, default_image="pagoda-runtime:0.1.0")
    if spec.autoscaling:
        SCALED_OBJECT_SCHEMA.validate(a.plan_autoscaler(spec, body, keda=True, prometheus_address=PROMETHEUS).manifest)
        hpa = a.plan_autoscaler(spec, body, keda=False, prometheus_address=PROMETHEUS).manifest
        kubernetes_validate.validate(hpa, VERSIONS[0], strict=True)
    for group in b.build_pod_groups(spec, body):
        POD_GROUP_SCHEMA.validate(group)


def test_there_are_samples_for_autoscaling_and_gang_scheduling():
    specs = [parse_spec(yaml.safe_load(p.read_text()), default_image="x") for p in SAMPLES]
    assert any(s.autoscaling for s in specs) and any(s.scheduling and s.scheduling.gang == "volcano" for s in specs)
