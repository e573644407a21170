"""Pure builders and spec validation: many specs in, manifests out, no cluster."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from pagoda_operator import builders as b
from pagoda_operator.settings import OperatorSettings
from pagoda_operator.spec import InvalidSpec, parse_spec

pytestmark = pytest.mark.operator

OWNER_META = {"name": "demo", "namespace": "serving", "uid": "1234"}


# a model of the user's: the built-in default has 9 attention heads, which 2, 4 or 8 ranks cannot split
MODEL = {"model": {"path": "/models/llama"}}


def llmd(spec: dict, name: str = "demo") -> dict:
    return {"apiVersion": b.API_VERSION, "kind": b.KIND, "metadata": {**OWNER_META, "name": name}, "spec": spec}


def build(spec: dict, **kwargs):
    body = llmd(spec)
    parsed = parse_spec(body, default_image="pagoda-runtime:default", **kwargs)
    return parsed, b.build_all(parsed, body)


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def containers_of(manifests, role=None):
    return [m["spec"]["template"]["spec"]["containers"][0] for m in manifests
            if m["kind"] == "StatefulSet" and (role is None or m["metadata"]["labels"][b.LABEL_ROLE] == role)]


@pytest.mark.parametrize("tp,pp,replicas", list(itertools.product([1, 2, 8], [1, 2, 4], [0, 1, 3])))
def test_topology_for_tp_pp_replicas(tp, pp, replicas):
    spec, manifests = build({**MODEL, "tensorParallelSize": tp, "pipelineParallelSize": pp, "replicas": replicas})
    statefulsets = [m for m in manifests if m["kind"] == "StatefulSet"]
    assert len(statefulsets) == replicas * (2 if pp > 1 else 1)
    pods = sum(s["spec"]["replicas"] for s in statefulsets)
    assert pods == replicas * pp
    for sts in statefulsets:
        group = sts["metadata"]["labels"][b.LABEL_GROUP]
        role = sts["metadata"]["labels"][b.LABEL_ROLE]
        assert sts["metadata"]["name"] == f"demo-g{group}-{role}"
        assert sts["spec"]["ordinals"]["start"] == (0 if role == "head" else 1)  # ordinal == node rank
        assert sts["spec"]["podManagementPolicy"] == "Parallel"
        assert sts["spec"]["updateStrategy"] == {"type": "OnDelete"}
        assert sts["spec"]["serviceName"] == "demo-headless"
        template_labels = sts["spec"]["template"]["metadata"]["labels"]
        assert sts["spec"]["selector"]["matchLabels"].items() <= template_labels.items()
        assert template_labels[b.LABEL_DEPLOYMENT] == "demo" and template_labels[b.LABEL_GROUP] == group
        args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
        assert flag(args, "--tensor-parallel-size") == str(tp)
        assert flag(args, "--pipeline-parallel-size") == str(pp) == flag(args, "--nnodes")
        assert flag(args, "--master-addr") == f"demo-g{group}-head-0.demo-headless.serving.svc.cluster.local"
        assert flag(args, "--master-port") == "29500" and flag(args, "--port") == "8000"
        assert sts["metadata"]["ownerReferences"] == [{
            "apiVersion": "pagoda.dev/v1alpha1", "kind": "LLMDeployment", "name": "demo", "uid": "1234",
            "controller": True, "blockOwnerDeletion": True}]
    for c in containers_of(manifests):
        assert c["resources"] == {"limits": {"nvidia.com/gpu": str(tp)}, "requests": {"nvidia.com/gpu": str(tp)}}


def test_node_rank_comes_from_the_pod_index_label():
    _, manifests = build({"pipelineParallelSize": 3})
    for c in containers_of(manifests):
        assert flag(c["args"], "--node-rank") == "$(PAGODA_NODE_RANK)"
        rank_env = next(e for e in c["env"] if e["name"] == "PAGODA_NODE_RANK")
        assert rank_env["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"


def test_services_select_heads_and_publish_not_ready_addresses():
    _, manifests = build({"replicas": 2, "service": {"type": "LoadBalancer", "port": 9000}})
    headless, head = (m for m in manifests if m["kind"] == "Service")
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert headless["spec"]["selector"] == {b.LABEL_DEPLOYMENT: "demo"}
    assert head["metadata"]["name"] == "demo" and head["spec"]["type"] == "LoadBalancer"
    assert head["spec"]["selector"] == {b.LABEL_DEPLOYMENT: "demo", b.LABEL_ROLE: "head"}
    assert head["spec"]["ports"][0]["port"] == 9000 and head["spec"]["ports"][0]["targetPort"] == "http"


def test_one_disruption_budget_lets_a_drain_break_one_group_at_a_time():
    _, manifests = build({"replicas": 3, "pipelineParallelSize": 2})
    (pdb,) = (m for m in manifests if m["kind"] == "PodDisruptionBudget")
    assert pdb["metadata"]["name"] == "demo" and pdb["metadata"]["ownerReferences"][0]["uid"] == "1234"
    # Every pod of every group, one at a time: after one eviction nothing more until all are Ready.
    assert pdb["spec"]["selector"] == {"matchLabels": {b.LABEL_DEPLOYMENT: "demo"}}
    assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"  # a crash loop never blocks a drain
    pods = [m["spec"]["template"]["metadata"]["labels"] for m in manifests if m["kind"] == "StatefulSet"]
    assert all(p.items() >= pdb["spec"]["selector"]["matchLabels"].items() for p in pods)


def restricted_violations(pod: dict) -> list[str]:
    """The checks of Kubernetes' `restricted` Pod Security Standard (v1.30) that a pod spec can fail."""
    problems = []
    psc = pod.get("securityContext") or {}
    allowed_volumes = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                       "projected", "secret"}
    for v in pod.get("volumes") or []:
        if not set(v) - {"name"} <= allowed_volumes:
            problems.append(f"volume {v['name']}")
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            problems.append(key)
    for c in pod["containers"]:
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            problems.append("privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append("allowPrivilegeEscalation")
        if not (sc.get("runAsNonRoot") or (psc.get("runAsNonRoot") and sc.get("runAsNonRoot") is not False)):
            problems.append("runAsNonRoot")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            problems.append("runAsUser 0")
        seccomp = (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            problems.append("seccompProfile")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []) or set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            problems.append("capabilities")
        if any(p.get("hostPort") for p in c.get("ports") or []):
            problems.append("hostPort")
    return problems


def test_pods_meet_the_restricted_pod_security_standard_by_default():
    _, manifests = build({"pipelineParallelSize": 2, "model": {
        "path": "/models/m", "volume": {"persistentVolumeClaim": {"claimName": "w"}}}})
    for sts in (m for m in manifests if m["kind"] == "StatefulSet"):
        pod = sts["spec"]["template"]["spec"]
        assert restricted_violations(pod) == []
        c = pod["containers"][0]
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        # Where the runtime writes: /tmp (library caches moved there) and the CPU kernel build directory.
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert {"/tmp", b.KERNELS_DIR, "/dev/shm"} <= mounts
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert all(env[k].startswith("/tmp/") for k in b.CACHE_ENV)
    # The checker does catch a violation.
    assert restricted_violations({"containers": [{"name": "x"}], "volumes": [{"name": "h", "hostPath": {}}]})


def test_the_runtime_image_runs_as_the_user_the_pods_ask_for():
    """Both runtime variants (cpu, cuda) come from one stage whose last USER is the pods' runAsUser."""
    dockerfile = (Path(__file__).resolve().parents[2] / "Dockerfile").read_text()
    stage = dockerfile.split("AS runtime\n", 1)[1]
    users = [line.split()[1] for line in stage.splitlines() if line.startswith("USER ")]
    assert users and users[-1] == str(b.RUNTIME_UID) != "0"
    assert "FROM" not in stage  # the runtime stage is the last: nothing switches the user back
    spec, _ = build({})
    assert b.pod_security_context(spec)["runAsUser"] == b.RUNTIME_UID


def test_no_pod_gets_service_links():
    """A Service named pagoda would give pods PAGODA_PORT=tcp://..., which the runtime reads as --port."""
    from pagoda_operator import model_cache, router

    spec, manifests = build({"pipelineParallelSize": 2, "router": {"enabled": True},
                             "model": {"name": "org/m", "cache": {"size": "1Gi"}}})
    templates = [m["spec"]["template"]["spec"] for m in manifests if m["kind"] == "StatefulSet"]
    templates.append(router.build_router_deployment(spec, llmd({}))["spec"]["template"]["spec"])
    templates.append(model_cache.build_download_job(spec, llmd({}))["spec"]["template"]["spec"])
    assert len(templates) == 4 and all(t["enableServiceLinks"] is False for t in templates)


def test_security_contexts_can_be_relaxed_and_cache_env_overridden():
    _, manifests = build({"podSecurityContext": {"runAsUser": 0}, "securityContext": {"privileged": True},
                          "env": [{"name": "XDG_CACHE_HOME", "value": "/cache"}]})
    pod = next(m for m in manifests if m["kind"] == "StatefulSet")["spec"]["template"]["spec"]
    assert pod["securityContext"] == {"runAsUser": 0}
    assert pod["containers"][0]["securityContext"] == {"privileged": True}
    env = [e for e in pod["containers"][0]["env"] if e["name"] == "XDG_CACHE_HOME"]
    assert env == [{"name": "XDG_CACHE_HOME", "value": "/cache"}]
    assert restricted_violations(pod)


def test_default_model_means_no_model_argument_and_no_volume():
    _, manifests = build({"resources": {"requests": {"cpu": "1"}}})
    c = containers_of(manifests)[0]
    assert c["args"][:2] == ["serve", "--served-model-name"] and flag(c["args"], "--served-model-name") == "demo"
    assert [m["name"] for m in c["volumeMounts"]] == ["dshm", "tmp", "kernels"]
    assert c["resources"] == {"requests": {"cpu": "1"}}  # CPU: no GPU asked for
    pod = next(m for m in manifests if m["kind"] == "StatefulSet")["spec"]["template"]["spec"]
    assert pod["topologySpreadConstraints"][0]["whenUnsatisfiable"] == "ScheduleAnyway"


def test_model_volume_is_mounted_read_only_at_the_path():
    _, manifests = build({"model": {"path": "/models/llama/", "servedName": "llama-3",
                                    "volume": {"persistentVolumeClaim": {"claimName": "w"}}}})
    sts = next(m for m in manifests if m["kind"] == "StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["args"][1] == "/models/llama" and flag(c["args"], "--served-model-name") == "llama-3"
    assert {"name": "model", "mountPath": "/models/llama", "readOnly": True} in c["volumeMounts"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "w"}} in pod["volumes"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert pod["topologySpreadConstraints"][0]["whenUnsatisfiable"] == "DoNotSchedule"


def test_engine_flags_and_extra_args_in_order():
    _, manifests = build({"engine": {"maxModelLen": 4096, "maxNumSeqs": 32, "blockSize": 32,
                                     "enablePrefixCaching": False, "gpuMemoryUtilization": 0.85,
                                     "dtype": "bfloat16", "extraArgs": ["--kv-cache-memory", "4"]}})
    args = containers_of(manifests)[0]["args"]
    assert flag(args, "--max-model-len") == "4096" and flag(args, "--max-num-seqs") == "32"
    assert flag(args, "--block-size") == "32" and flag(args, "--gpu-memory-utilization") == "0.85"
    assert flag(args, "--dtype") == "bfloat16" and "--no-enable-prefix-caching" in args
    assert args[-2:] == ["--kv-cache-memory", "4"]
    _, manifests = build({"engine": {"enablePrefixCaching": True}})
    args = containers_of(manifests)[0]["args"]
    assert "--enable-prefix-caching" in args and "--max-model-len" not in args


def test_pass_through_fields_and_user_env_cannot_override_the_rank():
    overrides = {
        "nodeSelector": {"gpu": "h100"}, "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
        "affinity": {"nodeAffinity": {}}, "priorityClassName": "high", "serviceAccountName": "llm",
        "imagePullSecrets": [{"name": "regcred"}], "podAnnotations": {"a": "b"},
        "podLabels": {"team": "ml", b.LABEL_ROLE: "hijack"},
        "env": [{"name": "PAGODA_NODE_RANK", "value": "7"}, {"name": "HF_HOME", "value": "/cache"}],
        "image": "my/runtime:1",
    }
    _, manifests = build(overrides)
    sts = next(m for m in manifests if m["kind"] == "StatefulSet")
    template = sts["spec"]["template"]
    pod = template["spec"]
    for key in ("nodeSelector", "tolerations", "affinity", "priorityClassName", "serviceAccountName",
                "imagePullSecrets"):
        assert pod[key] == overrides[key]
    assert template["metadata"]["annotations"] == {"a": "b"}
    assert template["metadata"]["labels"]["team"] == "ml" and template["metadata"]["labels"][b.LABEL_ROLE] == "head"
    env = pod["containers"][0]["env"]
    assert [e["name"] for e in env].count("PAGODA_NODE_RANK") == 1 and "valueFrom" in env[0]
    assert {"name": "HF_HOME", "value": "/cache"} in env
    assert pod["containers"][0]["image"] == "my/runtime:1"


def test_gpu_resource_name_is_a_spec_field():
    spec, manifests = build({**MODEL, "tensorParallelSize": 2, "gpuResourceName": "amd.com/gpu"})
    assert containers_of(manifests)[0]["resources"] == {"limits": {"amd.com/gpu": "2"}, "requests": {"amd.com/gpu": "2"}}
    spec, _ = build({"tensorParallelSize": 1, "gpuResourceName": "nvidia.com/mig-1g.10gb",
                     "resources": {"limits": {"nvidia.com/mig-1g.10gb": "1"}}})
    assert spec.gpus_per_pod == 1
    with pytest.raises(InvalidSpec, match="1 nvidia.com/mig-1g.10gb per pod"):
        build({**MODEL, "tensorParallelSize": 2, "gpuResourceName": "nvidia.com/mig-1g.10gb",
               "resources": {"limits": {"nvidia.com/mig-1g.10gb": 1}}})


def test_shutdown_outlasts_the_drain_and_the_service_stops_sending_first():
    spec, manifests = build({"pipelineParallelSize": 2})
    head, worker = (m for m in manifests if m["kind"] == "StatefulSet")
    pod = head["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 90
    drain = int(flag(pod["containers"][0]["args"], "--shutdown-timeout"))
    head_wait = int(pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][1])
    worker_wait = int(worker["spec"]["template"]["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][1])
    assert head_wait > 0 and head_wait + drain < 90  # the drain ends before the kubelet's SIGKILL
    assert worker_wait == head_wait + drain  # pipeline stages outlive the head's drain
    _, manifests = build({"terminationGracePeriodSeconds": 600})
    c = containers_of(manifests)[0]
    assert int(flag(c["args"], "--shutdown-timeout")) == 580


def test_explicit_gpu_resources_win():
    _, manifests = build({**MODEL, "tensorParallelSize": 4, "resources": {"limits": {"nvidia.com/gpu": 8, "memory": "400Gi"}}})
    assert containers_of(manifests)[0]["resources"] == {"limits": {"nvidia.com/gpu": 8, "memory": "400Gi"}}


def test_startup_probe_is_generous_and_probes_hit_health():
    spec, manifests = build({"startupTimeoutSeconds": 3600})
    c = containers_of(manifests)[0]
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 3600
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    _, default = build({})
    c = containers_of(default)[0]
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 1800  # 70B loads


def test_revision_is_the_hash_of_the_rendered_pod_templates(monkeypatch):
    def rev(spec, **kw):
        return b.group_revision(parse_spec(llmd(spec), default_image=kw.pop("image", "i")), 0, 0, **kw)
    base = rev({"replicas": 1})
    same = [rev({"replicas": 5}), rev({"replicas": 1, "service": {"port": 9000}}), rev({"restartPolicy": "None"})]
    changed = [rev({"engine": {"maxNumSeqs": 2}}), rev({}, image="other"), rev({"tensorParallelSize": 3}),
               rev({}, cluster_domain="example.org")]
    assert all(r == base for r in same)  # no pod changes: no restart
    assert len({base, *changed}) == len(changed) + 1
    spec = parse_spec(llmd({}), default_image="i")
    assert b.group_revision(spec, 0, 1) != b.group_revision(spec, 0, 0)  # recreating a group changes its pods
    # An operator upgrade that renders other probes changes the revision although the spec did not change.
    monkeypatch.setattr(b, "PROBE_PERIOD_SECONDS", 20)
    assert b.group_revision(spec, 0, 0) != base
    # Every pod of the group carries the group's revision.
    group = b.build_group(parse_spec(llmd({"pipelineParallelSize": 2}), default_image="i"), llmd({}), 0)
    revisions = {m["spec"]["template"]["metadata"]["labels"][b.LABEL_REVISION] for m in group}
    assert revisions == {m["metadata"]["labels"][b.LABEL_REVISION] for m in group} and len(revisions) == 1


def test_applied_hash_is_stable_and_tracks_content():
    spec, first = build({"replicas": 2})
    _, again = build({"replicas": 2})
    assert [m["metadata"]["annotations"][b.ANNOTATION_APPLIED_HASH] for m in first] == [
        m["metadata"]["annotations"][b.ANNOTATION_APPLIED_HASH] for m in again]
    record = b.GroupRecord(epoch=0, recreations=2, recreated_at="2026-01-01T00:00:00Z")
    head = b.build_statefulset(spec, llmd({}), 0, "head", record)
    assert head["metadata"]["annotations"][b.ANNOTATION_APPLIED_HASH] != first[2]["metadata"]["annotations"][
        b.ANNOTATION_APPLIED_HASH]
    assert b.GroupRecord.from_annotations(head["metadata"]["annotations"]) == record


@pytest.mark.parametrize("spec,message", [
    ({"tensorParallelSize": 16, "pipelineParallelSize": 32}, "exceeds the operator's limit"),
    ({"model": {"volume": {"persistentVolumeClaim": {"claimName": "w"}}}}, "model.path is not"),
    ({"model": {"path": "relative/dir"}}, "absolute path"),
    ({"model": {"path": "/"}}, "absolute path"),
    ({"model": {"path": "/dev/shm/m", "volume": {"emptyDir": {}}}}, "system directory"),
    ({"model": {"path": "/m", "volume": {"emptyDir": {}, "hostPath": {"path": "/x"}}}}, "exactly one volume source"),
    ({"model": {"path": "/m", "volume": {}}}, "exactly one volume source"),
    ({**MODEL, "tensorParallelSize": 8, "resources": {"limits": {"nvidia.com/gpu": 4}}},
     "one GPU per tensor-parallel rank"),
    ({"engine": {"extraArgs": ["--node-rank", "3"]}}, "must not set --node-rank"),
    ({"engine": {"extraArgs": ["--tensor-parallel-size=2"]}}, "must not set --tensor-parallel-size"),
    ({"engine": {"extraArgs": ["--shutdown-timeout", "5"]}}, "must not set --shutdown-timeout"),
    ({"terminationGracePeriodSeconds": 10}, "terminationGracePeriodSeconds must be"),
    ({"replicas": -1}, "replicas must be"),
    ({"tensorParallelSize": "8"}, "tensorParallelSize must be"),
    ({"resources": {"limits": {"nvidia.com/gpu": "1.5"}}}, r"resources.limits\[nvidia.com/gpu\] must be a whole"),
    ({"resources": {"requests": {"nvidia.com/gpu": "2k"}}}, "whole number of GPUs"),
    ({"gpuResourceName": "gpu"}, "extended resource name"),
    ({"model": {"path": 5}}, "wrong type or shape"),
    ({"engine": {"extraArgs": 5}}, "wrong type or shape"),
    ({"service": "LoadBalancer"}, "wrong type or shape"),
])
def test_invalid_specs_are_rejected_with_a_reason(spec, message):
    with pytest.raises(InvalidSpec, match=message):
        parse_spec(llmd(spec), default_image="i")


def test_names_too_long_for_derived_objects_are_rejected():
    with pytest.raises(InvalidSpec, match="at most 40"):
        parse_spec(llmd({}, name="x" * 41), default_image="i")
    parse_spec(llmd({}, name="x" * 40), default_image="i")


def test_world_size_limit_comes_from_settings():
    parse_spec(llmd({**MODEL, "tensorParallelSize": 8, "pipelineParallelSize": 4}), default_image="i",
               max_world_size=32)
    with pytest.raises(InvalidSpec):
        parse_spec(llmd({"tensorParallelSize": 8, "pipelineParallelSize": 8}), default_image="i", max_world_size=32)


def test_settings_from_env():
    s = OperatorSettings.from_env({"PAGODA_OPERATOR_NAMESPACES": "a, b,", "PAGODA_OPERATOR_LOG_LEVEL": "debug",
                                   "PAGODA_OPERATOR_RUNTIME_IMAGE": "r:1", "PAGODA_OPERATOR_LIVENESS_PORT": "9"})
    assert s.namespaces == ("a", "b") and not s.clusterwide and s.log_level == "DEBUG"
    assert s.runtime_image == "r:1" and s.liveness_port == 9
    assert OperatorSettings.from_env({}).clusterwide
    with pytest.raises(SystemExit, match="PAGODA_OPERATOR_"):
        OperatorSettings.from_env({"PAGODA_OPERATOR_RESYNC_SECONDS": "soon"})
    elected = OperatorSettings.from_env({"PAGODA_OPERATOR_LEADER_ELECTION": "true", "PAGODA_OPERATOR_IDENTITY": "pod-1",
                                         "PAGODA_OPERATOR_LEASE_NAMESPACE": "ops"})
    assert elected.leader_election and elected.identity == "pod-1" and elected.lease_namespace == "ops"
    assert not OperatorSettings.from_env({}).leader_election and OperatorSettings.from_env({}).identity
    with pytest.raises(SystemExit, match="LEADER_ELECTION"):
        OperatorSettings.from_env({"PAGODA_OPERATOR_LEADER_ELECTION": "yes please"})
