"""spec.adapters (LoRA), the pure parts: the spec's checks, the pods' flags, a group's revision that the adapter
list never changes, the adapters' download Jobs, and the plan that brings a running group in step."""

from __future__ import annotations

import pytest

from pagoda_operator import adapters as ad
from pagoda_operator import builders as b
from pagoda_operator import model_cache as mc
from pagoda_operator.spec import InvalidSpec, parse_spec

pytestmark = pytest.mark.operator

OWNER = {"apiVersion": b.API_VERSION, "kind": b.KIND}
HUB_BASE = {"name": "org/base", "revision": "v1"}


def body(spec: dict, name: str = "demo") -> dict:
    return {**OWNER, "metadata": {"name": name, "namespace": "serving", "uid": "1234"}, "spec": spec}


def parse(spec: dict, name: str = "demo"):
    return parse_spec(body(spec, name), default_image="pagoda-runtime:test")


def args_of(spec) -> list[str]:
    return b.build_args(spec, 0)


def test_adapters_become_lora_flags_and_hub_adapters_live_in_the_base_models_cache():
    spec = parse({"model": HUB_BASE, "adapters": [
        {"name": "sql", "model": {"name": "org/sql-lora", "revision": "r2", "tokenSecret": "hf"}},
        {"name": "chat", "model": {"path": "/models/adapters//chat/"}}]})
    sql, chat = spec.adapters
    assert sql.directory == "/models/org/sql-lora/r2" and sql.hub.claim_name == "demo-model"
    assert chat.directory == "/models/adapters/chat" and chat.hub is None
    args = args_of(spec)
    start = args.index("--enable-lora")
    assert args[start:start + 5] == ["--enable-lora", "--allow-runtime-lora-updating", "--lora-modules",
                                     "sql=/models/org/sql-lora/r2", "chat=/models/adapters/chat"]
    # present but empty: LoRA on, nothing loaded at start; absent: no LoRA flag at all
    assert b.lora_args(parse({"model": HUB_BASE, "adapters": []})) == ["--enable-lora",
                                                                       "--allow-runtime-lora-updating"]
    assert "--enable-lora" not in args_of(parse({"model": HUB_BASE}))


def test_the_adapter_list_is_no_part_of_a_groups_revision_but_lora_on_or_off_is():
    def revision(adapters):
        spec = {"model": HUB_BASE}
        if adapters is not None:
            spec["adapters"] = adapters
        return b.group_revision(parse(spec), 0, epoch=0)

    one = [{"name": "sql", "model": {"name": "org/sql-lora"}}]
    two = one + [{"name": "chat", "model": {"path": "/models/chat"}}]
    assert revision([]) == revision(one) == revision(two)
    assert revision(None) != revision([])
    # the StatefulSet itself follows the list (pods started later get it), without a new revision label
    one_sts, two_sts = (b.build_statefulset(parse({"model": HUB_BASE, "adapters": a}), body({}), 0, "head")
                        for a in (one, two))
    assert one_sts["metadata"]["labels"][b.LABEL_REVISION] == two_sts["metadata"]["labels"][b.LABEL_REVISION]
    assert one_sts["spec"]["template"] != two_sts["spec"]["template"]


@pytest.mark.parametrize("adapters,message", [
    ([{"name": "Sql", "model": {"path": "/a"}}], r"adapters\[0\].name 'Sql' must be a DNS label"),
    ([{"name": "a", "model": {"path": "/a"}}, {"name": "a", "model": {"path": "/b"}}], "given twice"),
    ([{"name": "demo", "model": {"path": "/a"}}], "the base model's served name"),
    ([{"name": "a", "model": {}}], "exactly one of name"),
    ([{"name": "a", "model": {"name": "org/x", "path": "/a"}}], "exactly one of name"),
    ([{"name": "a", "model": {"path": "relative"}}], "must be an absolute path"),
    ([{"name": "a", "model": {"path": "/a", "revision": "v1"}}], r"model.revision needs adapters\[0\].model.name"),
    ([{"name": "a", "model": {"name": "org/x", "cache": {}}}], r"adapters\[0\].model.cache is not a field"),
    ([{"name": "a", "model": {"name": "not a repo"}}], r"adapters\[0\].model.name 'not a repo' must be a Hugging"),
    ([{"name": "a" * 60, "model": {"path": "/a"}}], "too long"),
    ({"name": "a"}, "must be a list"),
])
def test_bad_adapters_are_refused_naming_the_field(adapters, message):
    with pytest.raises(InvalidSpec, match=message):
        parse({"model": HUB_BASE, "adapters": adapters})


def test_a_hub_adapter_needs_a_hub_base_model_and_lora_flags_stay_the_operators():
    with pytest.raises(InvalidSpec, match=r"adapters\[0\].model.name: an adapter from the Hub .* needs model.name"):
        parse({"model": {"path": "/models/base"}, "adapters": [{"name": "a", "model": {"name": "org/a"}}]})
    assert parse({"model": {"path": "/models/base"}, "adapters": [{"name": "a", "model": {"path": "/m/a"}}]})
    with pytest.raises(InvalidSpec, match="must not set --lora-modules with spec.adapters"):
        parse({"model": HUB_BASE, "adapters": [], "engine": {"extraArgs": ["--lora-modules", "x=/y"]}})
    # without spec.adapters the user's own flags pass through as before
    plain = parse({"model": HUB_BASE, "engine": {"extraArgs": ["--enable-lora", "--lora-modules", "x=/y"]}})
    assert args_of(plain)[-3:] == ["--enable-lora", "--lora-modules", "x=/y"]


def test_a_hub_adapters_download_job_is_the_base_models_job_for_its_repository():
    spec = parse({"model": {**HUB_BASE, "tokenSecret": "base-token"}, "adapters": [
        {"name": "sql", "model": {"name": "org/sql-lora", "revision": "r2", "tokenSecret": "hf"}}]})
    job = ad.build_adapter_job(spec, body({}), spec.adapters[0])
    base = mc.build_download_job(spec, body({}))
    assert job["metadata"]["name"] == "demo-lora-sql" and base["metadata"]["name"] == "demo-model"
    assert job["metadata"]["labels"][ad.LABEL_ADAPTER] == "sql"
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == ["download", "org/sql-lora", "--revision", "r2", "--dir", "/models/org/sql-lora/r2"]
    token = next(e for e in container["env"] if e["name"] == "HF_TOKEN")
    assert token["valueFrom"]["secretKeyRef"]["name"] == "hf"  # the adapter's own Secret, not the base's
    assert job["spec"]["template"]["spec"]["volumes"] == base["spec"]["template"]["spec"]["volumes"]
    assert job["metadata"]["labels"][mc.LABEL_MODEL_HASH] != base["metadata"]["labels"][mc.LABEL_MODEL_HASH]


def test_download_states_and_status():
    spec = parse({"model": HUB_BASE, "adapters": [{"name": "sql", "model": {"name": "org/sql-lora"}},
                                                   {"name": "chat", "model": {"path": "/m/chat"}}]})
    sql, chat = spec.adapters
    job = ad.build_adapter_job(spec, body({}), sql)
    assert ad.download_state(sql, None, current=False).state == "Downloading"
    failed = {**job, "status": {"conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                                                "message": "too many"}]}}
    state = ad.download_state(sql, failed, current=True, pod_message="401 Unauthorized")
    assert state.state == "DownloadFailed" and "401 Unauthorized" in state.message
    done = {**job, "status": {"succeeded": 1}}
    assert ad.download_state(sql, done, current=True).state == "Ready"
    assert ad.download_state(chat, None, current=False).state == "Ready"  # a path: nothing to download
    states = [ad.AdapterState(sql, groups=[0, 1]), ad.AdapterState(chat, groups=[1])]
    status = ad.adapters_status(states, groups=2)
    assert status["adaptersReady"] == "1/2"
    assert status["adapters"][1] == {"name": "chat", "model": "/m/chat", "state": "Ready", "groups": [1]}


def test_sync_plan_unloads_what_went_or_moved_and_loads_what_is_missing():
    plan = ad.plan_sync({"a": "/m/a", "b": "/m/b2", "c": "/m/c"}, {"a": "/m/a", "b": "/m/b1", "old": "/m/old"})
    assert plan.unload == ("b", "old")
    assert plan.load == (("b", "/m/b2"), ("c", "/m/c"))
    assert ad.plan_sync({"a": "/m/a"}, {"a": "/m/a"}) == ad.SyncPlan()


def test_runtime_url_is_the_head_pods_address():
    assert ad.runtime_url({"status": {"podIP": "10.1.2.3"}}) == f"http://10.1.2.3:{b.HTTP_PORT}"
    assert ad.runtime_url({"status": {}}) is None and ad.client_for_pod({}) is None


def test_the_runtimes_api_key_is_found_where_the_pods_get_it():
    def source(**spec):
        return ad.runtime_api_key(parse({"model": HUB_BASE, "adapters": [], **spec}))

    assert source() is None
    ref = {"name": "PAGODA_API_KEY", "valueFrom": {"secretKeyRef": {"name": "keys", "key": "runtime"}}}
    assert source(env=[{"name": "OTHER", "value": "x"}, ref]) == ad.ApiKeySource(secret="keys", secret_key="runtime")
    # Kubernetes' rule: of two entries with one name the last wins; argparse's: the last --api-key wins
    assert source(env=[ref, {"name": "PAGODA_API_KEY", "value": "plain"}]) == ad.ApiKeySource(value="plain")
    flags = {"extraArgs": ["--api-key", "one", "--api-key=two"]}
    assert source(env=[ref], engine=flags) == ad.ApiKeySource(value="two")  # a flag beats the variable
    optional = {"name": "PAGODA_API_KEY", "valueFrom": {"secretKeyRef": {"name": "k", "key": "v", "optional": True}}}
    assert source(env=[optional]).optional
    client = ad.client_for_pod({"status": {"podIP": "10.1.2.3"}}, "s3cret")
    assert client.api_key == "s3cret" and client.base_url == f"http://10.1.2.3:{b.HTTP_PORT}"


def test_enable_lora_keeps_the_pods_flags_so_adding_or_removing_adapters_never_restarts_a_group():
    one = [{"name": "sql", "model": {"name": "org/sql-lora"}}]

    def group(adapters, enable_lora):
        spec = {"model": HUB_BASE}
        if enable_lora is not None:
            spec["engine"] = {"enableLora": enable_lora, "extraArgs": ["--max-loras", "4"]}
        if adapters is not None:
            spec["adapters"] = adapters
        parsed = parse(spec)
        return b.group_revision(parsed, 0, epoch=0), b.lora_args(parsed), parsed.adapters

    # on: no field, an empty list, an adapter: one revision, LoRA flags throughout (the field's absence is an
    # empty list, so the reconcile unloads what the running groups still serve)
    revisions = {group(a, True)[0] for a in (None, [], one)}
    assert len(revisions) == 1
    assert group(None, True)[1] == ["--enable-lora", "--allow-runtime-lora-updating"] and group(None, True)[2] == ()
    assert group(one, True)[1][-1] == "sql=/models/org/sql-lora/main"
    # unset: as before, the field's presence turns LoRA on (a new revision); on with the field equals unset
    assert group(None, None)[0] != group([], None)[0] and group(None, None)[1] == []
    assert group(one, None)[1] == group(one, True)[1]
    # off: no LoRA; adapters with it are refused, and so are LoRA flags of the user's beside enableLora
    assert group(None, False)[1] == [] and group(None, False)[2] is None
    with pytest.raises(InvalidSpec, match="engine.enableLora is false"):
        group(one, False)
    with pytest.raises(InvalidSpec, match="must not set --enable-lora with spec.adapters or engine.enableLora"):
        parse({"model": HUB_BASE, "engine": {"enableLora": True, "extraArgs": ["--enable-lora"]}})
    with pytest.raises(InvalidSpec, match="engine.enableLora must be true or false"):
        parse({"model": HUB_BASE, "engine": {"enableLora": "yes"}})
