"""The chart's monitoring pack: the Grafana dashboard's queries name only metrics the runtime exports (read
from the runtime's own metrics module) and labels the PodMonitor provides; `helm template` with the pack on
renders a PodMonitor valid against the vendored CRD schema that selects the pods the operator builds, and a
valid dashboard ConfigMap; with it off, nothing."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from test_schemas import helm

from pagoda.entrypoints.openai.metrics import ServerMetrics
from pagoda_operator import builders as b
from pagoda_operator.spec import parse_spec

pytestmark = pytest.mark.operator

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "pagoda"
DASHBOARD = CHART / "dashboards" / "pagoda.json"
PODMONITOR_SCHEMA = Path(__file__).parent / "schemas" / "monitoring.coreos.com_v1_podmonitor.yaml"
ON = ["--set", "monitoring.podMonitor.enabled=true", "--set", "monitoring.dashboards.enabled=true"]
# Labels Prometheus puts on every target of a PodMonitor, before the chart's relabelings add more.
PROMETHEUS_TARGET_LABELS = {"namespace", "pod", "container", "endpoint", "job", "instance"}
# Grafana's built-in interval variables, replaced by a duration so the query parses as plain PromQL.
GRAFANA_INTERVALS = re.compile(r"\$(__rate_interval|__interval|__range)\b")


def render(*values: str) -> list[dict]:
    result = helm("template", "pagoda", str(CHART), "--namespace", "pagoda-system", *values)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def exported_metrics() -> tuple[set[str], set[str]]:
    """Sample names and label names the runtime's /metrics serves, from the runtime's own registry."""
    text = ServerMetrics("m", lambda: None).render().decode()
    names, labels = set(), set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            names.add(sample.name)
            labels.update(sample.labels)
    return names, labels


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queries(board: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable (label_values(SELECTOR, label))."""
    found = [(f"panel {p['title']!r}", t["expr"]) for p in board["panels"] for t in p.get("targets", [])]
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            text = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", text)
            assert match, f"variable {var['name']}: expected label_values(selector, label), got {text!r}"
            found.append((f"variable {var['name']!r}", match[1]))
    return found


def selectors_and_labels(expr: str) -> tuple[list, set[str]]:
    """The vector selectors of a query and every label name it matches on or groups by."""
    tree = promql_parser.parse(GRAFANA_INTERVALS.sub("5m", expr))
    selectors, labels = [], set()

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            selectors.append(node)
            labels.update(m.name for m in node.matchers.matchers)
        elif isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            labels.update(node.modifier.labels)

    promql_parser.walk(tree, visit)
    return selectors, labels


def relabel_target_labels(podmonitor: dict) -> set[str]:
    return {r["targetLabel"] for e in podmonitor["spec"]["podMetricsEndpoints"] for r in e.get("relabelings", [])}


def test_dashboard_is_valid_json_with_unique_panels():
    board = dashboard()
    assert board["uid"] and board["title"] and board["schemaVersion"] >= 36
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    graphs = [p for p in board["panels"] if p["type"] != "row"]
    assert all(p["targets"] and p["datasource"]["uid"] == "${datasource}" for p in graphs)
    for panel in graphs:
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
    variables = {v["name"] for v in board["templating"]["list"]}
    assert {"datasource", "namespace", "deployment", "group"} <= variables


def test_every_query_names_only_metrics_the_runtime_exports():
    exported, _ = exported_metrics()
    assert "pagoda:time_to_first_token_seconds_bucket" in exported  # the registry was read, not empty
    used = set()
    for where, expr in queries(dashboard()):
        selectors, _ = selectors_and_labels(expr)
        assert selectors, f"{where}: no metric in {expr!r}"
        for selector in selectors:
            assert selector.name, f"{where}: a selector without a metric name in {expr!r}"
            assert selector.name in exported, f"{where}: {selector.name} is not exported by the runtime"
            used.add(selector.name)
    # the list: latency histograms, tokens, requests by reason, load, KV and prefix cache, preemptions;
    # and the 503s at the admission limits
    wanted = {f"pagoda:{h}_bucket" for h in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                                              "e2e_request_latency_seconds", "request_queue_time_seconds")}
    wanted |= {f"pagoda:{n}" for n in ("generation_tokens_total", "prompt_tokens_total", "request_success_total",
                                       "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                                       "prefix_cache_hits_total", "prefix_cache_queries_total",
                                       "num_preemptions_total", "admission_rejections_total")}
    assert wanted <= used, f"no panel shows {sorted(wanted - used)}"


def test_latency_panels_show_p50_p95_p99():
    for histogram in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                      "e2e_request_latency_seconds", "request_queue_time_seconds"):
        exprs = [e for _, e in queries(dashboard()) if f"pagoda:{histogram}_bucket" in e]
        quantiles = sorted(float(q) for e in exprs for q in re.findall(r"histogram_quantile\(([0-9.]+)", e))
        assert quantiles == [0.5, 0.95, 0.99], histogram


def test_queries_use_only_labels_the_metrics_and_the_podmonitor_provide():
    _, metric_labels = exported_metrics()
    podmonitor = next(d for d in render(*ON) if d["kind"] == "PodMonitor")
    available = metric_labels | PROMETHEUS_TARGET_LABELS | relabel_target_labels(podmonitor)
    for where, expr in queries(dashboard()):
        _, labels = selectors_and_labels(expr)
        assert labels <= available, f"{where}: labels {sorted(labels - available)} exist on no series"


def test_monitoring_is_off_by_default():
    kinds = {d["kind"] for d in render()}
    assert "PodMonitor" not in kinds and "ConfigMap" not in kinds


@pytest.mark.parametrize("values", [[], ["--set", "watchNamespaces={serving,staging}"]],
                         ids=["clusterwide", "namespaced"])
def test_helm_template_renders_a_valid_podmonitor_and_dashboard_configmap(values):
    docs = render(*ON, "--set", "monitoring.podMonitor.labels.release=kube-prometheus-stack",
                  "--set", "monitoring.dashboards.annotations.grafana_folder=LLM", *values)
    podmonitor = next(d for d in docs if d["kind"] == "PodMonitor")
    jsonschema.Draft4Validator(yaml.safe_load(PODMONITOR_SCHEMA.read_text())).validate(podmonitor)
    assert podmonitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    selector = podmonitor["spec"]["namespaceSelector"]
    assert selector == ({"matchNames": ["serving", "staging"]} if values else {"any": True})

    configmap = next(d for d in docs if d["kind"] == "ConfigMap")
    kubernetes_validate.validate(configmap, "1.30", strict=True)
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    assert json.loads(configmap["data"]["pagoda.json"]) == dashboard()


def test_podmonitor_selects_the_head_and_worker_pods_the_operator_builds():
    podmonitor = next(d for d in render(*ON) if d["kind"] == "PodMonitor")
    body = {"apiVersion": b.API_VERSION, "kind": b.KIND,
            "metadata": {"name": "demo", "namespace": "serving", "uid": "u"},
            "spec": {"pipelineParallelSize": 2, "replicas": 2}}
    pods = [m["spec"]["template"] for m in b.build_all(parse_spec(body, default_image="x"), body)
            if "template" in m.get("spec", {})]
    roles = set()
    for pod in pods:
        labels = pod["metadata"]["labels"]
        assert matches(podmonitor["spec"]["selector"], labels), labels
        roles.add(labels[b.LABEL_ROLE])
        ports = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        assert {e["port"] for e in podmonitor["spec"]["podMetricsEndpoints"]} <= ports
        # the relabelings read exactly these pod labels (Prometheus turns '.' and '/' into '_')
        for label in (b.LABEL_DEPLOYMENT, b.LABEL_GROUP, b.LABEL_ROLE):
            meta = "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", label)
            assert any(meta in r["sourceLabels"] for e in podmonitor["spec"]["podMetricsEndpoints"]
                       for r in e["relabelings"]), meta
    assert roles == {"head", "worker"}
    assert not matches(podmonitor["spec"]["selector"], {"app.kubernetes.io/component": "operator"})


def matches(selector: dict, labels: dict[str, str]) -> bool:
    ok = all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok &= {"Exists": key in labels, "DoesNotExist": key not in labels,
               "In": labels.get(key) in values, "NotIn": labels.get(key) not in values}[op]
    return ok


def test_the_vendored_schema_catches_a_misspelled_field():
    podmonitor = next(d for d in render(*ON) if d["kind"] == "PodMonitor")
    podmonitor["spec"]["podMetricEndpoints"] = podmonitor["spec"].pop("podMetricsEndpoints")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft4Validator(yaml.safe_load(PODMONITOR_SCHEMA.read_text())).validate(podmonitor)


@pytest.mark.parametrize(("flag", "field"), [("monitoring.podMonitor.interval=15", "interval"),
                                             ("monitoring.dashboards.enabled=yes", "enabled"),
                                             ("monitoring.podMonitor.scrape=1s", "scrape")])
def test_bad_monitoring_values_are_rejected_by_the_values_schema(flag, field):
    result = helm("template", "pagoda", str(CHART), "--set", flag)
    assert result.returncode != 0 and field in result.stderr, result.stderr
