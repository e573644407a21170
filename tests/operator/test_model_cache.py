"""Models from the Hub, without a cluster: spec.model.name parsed and checked, the cache claim and the
download Job built (and valid Kubernetes), the Job's state read into ModelReady and the status."""

from __future__ import annotations

from pathlib import Path

import celpy
import jsonschema
import kubernetes_validate
import pytest
import yaml

from pagoda_operator import builders as b
from pagoda_operator import model_cache as mc
from pagoda_operator.spec import InvalidSpec, parse_spec
from pagoda_operator.status import GroupObservation, build_status

pytestmark = pytest.mark.operator

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "pagoda.dev_llmdeployments.yaml"
VERSIONS = ["1.30", kubernetes_validate.utils.latest_version()]
HUB_SPEC = {"model": {"name": "org/tiny", "revision": "v1", "tokenSecret": "hf",
                      "cache": {"size": "20Gi", "storageClassName": "fast"}},
            "env": [{"name": "HF_ENDPOINT", "value": "http://mirror:8080"}, {"name": "OTHER", "value": "x"}],
            "resources": {"requests": {"cpu": "1"}}}


def llmd(spec: dict, name: str = "demo") -> dict:
    return {"apiVersion": b.API_VERSION, "kind": b.KIND,
            "metadata": {"name": name, "namespace": "serving", "uid": "1234"}, "spec": spec}


def parse(spec: dict):
    body = llmd(spec)
    return parse_spec(body, default_image="pagoda-runtime:default"), body


def crd_schema() -> dict:
    return yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_a_hub_model_is_served_from_its_directory_in_the_cache_claim_mounted_read_only():
    spec, body = parse(HUB_SPEC)
    hub = spec.hub_model
    assert (hub.name, hub.revision, hub.token_secret, hub.claim_name, hub.existing_claim) == (
        "org/tiny", "v1", "hf", "demo-model", False)
    assert spec.model_path == hub.directory == "/models/org/tiny/v1"
    (sts,) = [m for m in b.build_all(spec, body) if m["kind"] == "StatefulSet"]
    pod = sts["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["args"][:2] == ["serve", "/models/org/tiny/v1"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "demo-model", "readOnly": True}} in pod["volumes"]


def test_the_cache_claim_and_the_download_job():
    spec, body = parse(HUB_SPEC)
    claim = mc.build_cache_claim(spec, body)
    assert claim["metadata"]["name"] == "demo-model"
    assert claim["spec"] == {"accessModes": ["ReadWriteMany"], "volumeMode": "Filesystem",
                             "resources": {"requests": {"storage": "20Gi"}}, "storageClassName": "fast"}
    job = mc.build_download_job(spec, body)
    assert job["metadata"]["name"] == "demo-model"
    for child in (claim, job):
        assert child["metadata"]["ownerReferences"][0]["uid"] == "1234"
        assert child["metadata"]["labels"][b.LABEL_DEPLOYMENT] == "demo"  # its events run the owner's pass
    assert job["metadata"]["labels"][mc.LABEL_MODEL_HASH] == mc.model_hash(spec.hub_model)
    pod = job["spec"]["template"]["spec"]
    # The download pod is no group's pod: not selected by the Services or the PodDisruptionBudget.
    assert b.LABEL_DEPLOYMENT not in job["spec"]["template"]["metadata"]["labels"]
    assert pod["restartPolicy"] == "Never" and job["spec"]["backoffLimit"] == mc.DOWNLOAD_BACKOFF_LIMIT
    (container,) = pod["containers"]
    assert container["image"] == "pagoda-runtime:default"
    assert container["args"] == ["download", "org/tiny", "--revision", "v1", "--dir", "/models/org/tiny/v1"]
    assert {"name": "model", "mountPath": "/models"} in container["volumeMounts"]  # read-write here
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "demo-model"}} in pod["volumes"]
    env = {e["name"]: e for e in container["env"]}
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert env["HF_ENDPOINT"]["value"] == "http://mirror:8080" and "OTHER" not in env
    assert pod["securityContext"]["fsGroup"] == b.RUNTIME_UID  # a new volume is root-owned
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert "nvidia.com/gpu" not in str(container["resources"])


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("spec", [
    HUB_SPEC,
    {"model": {"name": "gpt2"}},
    {"model": {"name": "org/m", "cache": {"claimName": "shared-models"}}, "imagePullSecrets": [{"name": "r"}],
     "serviceAccountName": "sa", "tolerations": [{"key": "k", "operator": "Exists"}],
     "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]},
    {"model": {"name": "org/m", "revision": "refs/pr/1", "cache": {"accessMode": "ReadWriteOnce"}},
     "podSecurityContext": {"runAsUser": 0}, "tensorParallelSize": 2, "pipelineParallelSize": 2, "replicas": 2},
], ids=range(4))
def test_every_model_manifest_is_valid_kubernetes(spec, version):
    jsonschema.Draft4Validator(crd_schema()).validate(llmd(spec))
    parsed, body = parse(spec)
    manifests = b.build_all(parsed, body) + [mc.build_download_job(parsed, body)]
    if not parsed.hub_model.existing_claim:
        manifests.append(mc.build_cache_claim(parsed, body))
    for manifest in manifests:
        kubernetes_validate.validate(manifest, version, strict=True)


def test_an_existing_claim_is_used_as_it_is():
    spec, body = parse({"model": {"name": "org/m", "cache": {"claimName": "shared-models"}}})
    assert spec.hub_model.existing_claim and spec.hub_model.claim_name == "shared-models"
    assert spec.model_volume == {"persistentVolumeClaim": {"claimName": "shared-models", "readOnly": True}}
    job = mc.build_download_job(spec, body)
    assert job["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"] == {"claimName": "shared-models"}


def test_defaults_and_the_revision_in_the_directory():
    spec, _ = parse({"model": {"name": "org/m"}})
    assert spec.hub_model.cache_size == "50Gi" and spec.hub_model.access_mode == "ReadWriteMany"
    assert spec.model_path == "/models/org/m/main" and "--revision" not in mc.build_download_args(spec)
    main, _ = parse({"model": {"name": "org/m", "revision": "main"}})
    assert mc.model_hash(main.hub_model) == mc.model_hash(spec.hub_model)  # the same directory
    branch, _ = parse({"model": {"name": "org/m", "revision": "refs/pr/1"}})
    assert branch.model_path == "/models/org/m/refs--pr--1"


@pytest.mark.parametrize("model,words", [
    ({"name": "org/tiny", "path": "/m"}, "model.name and model.path exclude"),
    ({"name": "org/tiny", "volume": {"emptyDir": {}}}, "model.name and model.volume exclude"),
    ({"name": "org/team/tiny"}, "model.name 'org/team/tiny' must be a Hugging Face Hub id"),
    ({"name": "org/ti--ny"}, "must be a Hugging Face Hub id"),
    ({"name": "x" * 97}, "at most 96"),
    ({"name": 7}, "must be a Hugging Face Hub id"),
    ({"name": "org/tiny", "revision": "../../etc"}, "model.revision"),
    ({"name": "org/tiny", "revision": ""}, "model.revision"),
    ({"name": "org/tiny", "tokenSecret": "Bad_Name"}, "model.tokenSecret"),
    ({"name": "org/tiny", "cache": {"claimName": "c", "size": "1Gi"}}, "model.cache.size applies only"),
    ({"name": "org/tiny", "cache": {"size": "lots"}}, "model.cache.size 'lots'"),
    ({"name": "org/tiny", "cache": {"size": "0Gi"}}, "model.cache.size"),
    ({"name": "org/tiny", "cache": {"accessMode": "ReadOnlyMany"}}, "model.cache.accessMode"),
    ({"name": "org/tiny", "cache": {"storageClassName": 3}}, "model.cache.storageClassName"),
    ({"name": "org/tiny", "cache": {"claimName": "UPPER"}}, "model.cache.claimName"),
    ({"revision": "v1"}, "model.revision needs model.name"),
    ({"path": "/m", "cache": {"size": "1Gi"}}, "model.cache needs model.name"),
])
def test_bad_model_specs_are_invalid_with_a_message_naming_the_field(model, words):
    with pytest.raises(InvalidSpec) as error:
        parse({"model": model})
    assert words in str(error.value)


@pytest.mark.parametrize("model", [
    {"name": "a/b/c"}, {"name": "org/tiny", "cache": {"accessMode": "ReadOnlyMany"}},
    {"name": "org/tiny", "cache": {"size": "lots"}}, {"name": ""},
])
def test_the_crd_schema_rejects_bad_model_fields(model):
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft4Validator(crd_schema()).validate(llmd({"model": model}))


def job_with(status: dict | None = None, spec: dict = HUB_SPEC, **meta) -> dict:
    parsed, body = parse(spec)
    job = mc.build_download_job(parsed, body)
    job["metadata"].update(meta)
    job["status"] = status or {}
    return job


SUCCEEDED = {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}
FAILED = {"failed": 4, "conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                                       "message": "Job has reached the specified backoff limit"}]}


def test_when_the_download_job_is_kept_replaced_or_created():
    wanted = job_with()
    assert mc.job_action(None, wanted) == "create"
    assert mc.job_action(job_with(), wanted) == "keep"  # running
    assert mc.job_action(job_with(SUCCEEDED), wanted) == "keep"
    assert mc.job_action(job_with(FAILED), wanted) == "keep"  # the same spec would fail the same way
    assert mc.job_action(job_with(deletionTimestamp="2026-01-01T00:00:00Z"), wanted) == "wait"
    new_revision = {**HUB_SPEC, "model": {**HUB_SPEC["model"], "revision": "v2"}}
    assert mc.job_action(job_with(SUCCEEDED), job_with(spec=new_revision)) == "replace"
    assert mc.job_action(job_with(SUCCEEDED, spec=new_revision), wanted) == "replace"
    new_token = {**HUB_SPEC, "model": {**HUB_SPEC["model"], "tokenSecret": "other"}}
    assert mc.job_action(job_with(FAILED), job_with(spec=new_token)) == "replace"  # a fix retries at once
    assert mc.job_action(job_with(), job_with(spec=new_token)) == "replace"
    assert mc.job_action(job_with(SUCCEEDED), job_with(spec=new_token)) == "keep"  # done: nothing to redo
    new_image = {**HUB_SPEC, "image": "pagoda-runtime:next"}
    assert mc.job_action(job_with(SUCCEEDED), job_with(spec=new_image)) == "keep"


def test_model_ready_follows_the_job():
    spec, _ = parse(HUB_SPEC)
    def ready(job, current=True, pod_message=None):
        c = mc.model_ready_condition(spec, job, current, pod_message)
        return c["status"], c["reason"], c["message"]
    assert ready(None, current=False)[:2] == ("False", "Downloading")
    assert ready(job_with())[:2] == ("False", "Downloading")
    status, reason, message = ready(job_with(SUCCEEDED))
    assert (status, reason) == ("True", "Downloaded") and "org/tiny@v1" in message and "demo-model" in message
    assert ready(job_with({"succeeded": 1}))[1] == "Downloaded"
    assert ready(job_with(SUCCEEDED), current=False)[1] == "Downloading"  # the old model's Job
    status, reason, message = ready(job_with(FAILED), pod_message="pagoda download: error: revision 'v1' not found")
    assert (status, reason) == ("False", "DownloadFailed")
    assert "BackoffLimitExceeded" in message and "revision 'v1' not found" in message
    plain, _ = parse({"model": {"path": "/m", "volume": {"emptyDir": {}}}})
    assert mc.model_ready_condition(plain, None, False)["reason"] == "NoDownload"


def test_the_failed_pods_last_line_is_the_reason():
    def pod(started, message, code=1):
        return {"status": {"startTime": started, "containerStatuses": [{"state": {"terminated": {
            "exitCode": code, "message": message}}}]}}
    pods = [pod("2026-01-01T00:00:00Z", "usage: ...\npagoda download: error: old\n"),
            pod("2026-01-01T00:05:00Z", "Fetching 3 files\npagoda download: error: model 'org/x' is gated\n\n"),
            {"status": {"startTime": "2026-01-01T00:09:00Z"}}]  # not started yet
    assert mc.pod_failure_message(pods) == "pagoda download: error: model 'org/x' is gated"
    assert mc.pod_failure_message([pod("t", "all good", code=0)]) is None
    assert mc.pod_failure_message([]) is None


def conditions(status):
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_status_while_the_model_downloads_fails_and_is_ready():
    spec, _ = parse(HUB_SPEC)
    missing = [GroupObservation(index=0, size=1, wanted_revision="r1", revision=None)]
    downloading = mc.model_ready_condition(spec, job_with(), True)
    status = build_status(spec, missing, generation=1, model_ready=downloading)
    assert conditions(status)["Progressing"] == ("True", "WaitingForModel")
    assert conditions(status)["ModelReady"] == ("False", "Downloading")
    assert status["phase"] == "Pending" and status["model"] == "org/tiny@v1"

    failed = mc.model_ready_condition(spec, job_with(FAILED), True, "error: gated")
    status = build_status(spec, missing, generation=1, model_ready=failed)
    assert conditions(status)["Degraded"] == ("True", "DownloadFailed") and status["phase"] == "Degraded"
    assert "gated" in next(c for c in status["conditions"] if c["type"] == "Degraded")["message"]

    # A new revision downloads while the old groups serve: they wait, and still count as Ready.
    ready_pod = {"metadata": {"name": "demo-g0-head-0", "labels": {b.LABEL_REVISION: "r0"}},
                 "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}
    stale = [GroupObservation(index=0, size=1, wanted_revision="r1", revision="r0", pods=[ready_pod])]
    status = build_status(spec, stale, generation=2, model_ready=downloading)
    assert conditions(status)["Progressing"] == ("True", "WaitingForModel")
    assert conditions(status)["Available"] == ("True", "GroupsReady") and status["phase"] == "Progressing"
    status = build_status(spec, stale, generation=2, model_ready=mc.model_ready_condition(spec, job_with(SUCCEEDED), True))
    assert conditions(status)["Progressing"] == ("True", "RollingUpdate")
    assert conditions(status)["ModelReady"] == ("True", "Downloaded")


def test_the_hub_sample_builds_valid_children():
    body = yaml.safe_load((ROOT / "crds" / "samples" / "cpu-hub-model.yaml").read_text())
    jsonschema.Draft4Validator(crd_schema()).validate(body)
    body["metadata"].update(namespace="default", uid="00000000-0000-0000-0000-000000000000")
    spec = parse_spec(body, default_image="pagoda-runtime:0.1.0")
    assert spec.hub_model.name == "HuggingFaceTB/SmolLM2-360M-Instruct" and spec.gpus_per_pod == 0
    for manifest in (mc.build_cache_claim(spec, body), mc.build_download_job(spec, body)):
        kubernetes_validate.validate(manifest, VERSIONS[0], strict=True)


def cel_failures(schema: dict, value) -> list[str]:
    """The messages of the CRD's x-kubernetes-validations rules that `value` breaks, as the API server
    evaluates them (each rule at its own node, with `self` bound to the value there)."""
    env = celpy.Environment()
    failed = []
    for rule in schema.get("x-kubernetes-validations") or []:
        program = env.program(env.compile(rule["rule"]))
        if not program.evaluate({"self": celpy.json_to_cel(value)}):
            failed.append(rule["message"])
    for key, child in (schema.get("properties") or {}).items():
        if isinstance(value, dict) and key in value:
            failed += cel_failures(child, value[key])
    return failed


@pytest.mark.parametrize("model,broken", [
    ({"name": "org/m"}, None),
    ({"name": "org/m", "cache": {"claimName": "c"}}, None),
    ({"name": "org/m", "cache": {"size": "1Gi", "storageClassName": "s", "accessMode": "ReadWriteOnce"}}, None),
    ({"path": "/m", "volume": {"emptyDir": {}}}, None),
    ({"name": "org/m", "path": "/m"}, "model.name (a Hub model"),
    ({"name": "org/m", "volume": {"emptyDir": {}}}, "model.name (a Hub model"),
    ({"name": "org/m", "cache": {"claimName": "c", "size": "1Gi"}}, "cache.claimName names an existing claim"),
    ({"name": "org/m", "cache": {"claimName": "c", "accessMode": "ReadWriteOnce"}}, "cache.claimName names"),
    ({"volume": {"emptyDir": {}}}, "model.volume needs model.path"),
])
def test_the_crds_cel_rules_on_model(model, broken):
    failures = cel_failures(crd_schema()["properties"]["spec"], {"model": model})
    if broken is None:
        assert failures == []
    else:
        assert len(failures) >= 1 and any(broken in f for f in failures), failures
