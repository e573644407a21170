"""kopf running for real against KMock with spec.adapters: adapters from the Hub are downloaded by Jobs as the
base model is (the tests play the Job controller), pods start with the adapters ready then, and an edit of
the adapter list reaches a running group through a real `pagoda serve` (its /v1/load_lora_adapter and
/v1/unload_lora_adapter) without restarting it. That server requires an API key, which the LLMDeployment
gives its pods from a Secret (env PAGODA_API_KEY): the operator reads it there and sends it on those calls.

The one stand-in: the group's head pod exists only in KMock, so the reconciler's runtime_client maps that pod
to the real server on a loopback port (in a cluster it is the pod's IP and port 8000)."""

from __future__ import annotations

import base64
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from checkpoints import write_lora_adapter
from operator_harness import PODS, eventually

from pagoda_operator.adapters import AdapterCallError, RuntimeAdapters

pytestmark = pytest.mark.operator

JOBS = "/apis/batch/v1/namespaces/serving/jobs"
SECRETS = "/api/v1/namespaces/{ns}/secrets"
SUCCEEDED = {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}
HUB_SPEC = {
    "model": {"name": "org/base", "revision": "v1"},
    "adapters": [{"name": "sql", "model": {"name": "org/sql-lora", "tokenSecret": "hf"}},
                 {"name": "local", "model": {"path": "/models/adapters/local"}}],
    "image": "pagoda-runtime:test",
    "resources": {"requests": {"cpu": "1"}},
    "replicas": 1,
}


async def jobs(cluster) -> dict:
    return {j["metadata"]["name"]: j for j in (await cluster._json("GET", JOBS))["items"]}


async def set_job(cluster, name: str, status: dict) -> None:
    await cluster._json("PATCH", f"{JOBS}/{name}/status", {"status": status})


def head_args(statefulsets: dict, name: str) -> list[str]:
    return statefulsets[f"{name}-g0-head"]["spec"]["template"]["spec"]["containers"][0]["args"]


def lora_modules(args: list[str]) -> list[str]:
    if "--lora-modules" not in args:
        return []
    rest = args[args.index("--lora-modules") + 1:]
    return [a for a in rest[: next((i for i, a in enumerate(rest) if a.startswith("--")), len(rest))]]


async def adapter_states(cluster, name: str) -> dict:
    return {a["name"]: a for a in (await cluster.status(name)).get("adapters") or []}


async def test_hub_adapters_download_before_pods_list_them_and_removed_ones_lose_their_job(cluster, operator):
    await cluster.create("lora", HUB_SPEC)
    made = await eventually(lambda: _has(jobs(cluster), {"lora-model", "lora-lora-sql"}), what="both Jobs")
    container = made["lora-lora-sql"]["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == ["download", "org/sql-lora", "--dir", "/models/org/sql-lora/main"]
    assert made["lora-lora-sql"]["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"] == {
        "claimName": "lora-model"}
    states = await eventually(lambda: adapter_states(cluster, "lora"), what="status.adapters")
    assert states["sql"]["state"] == "Downloading" and states["local"]["state"] == "Ready"
    assert (await cluster.status("lora"))["adaptersReady"] == "0/2"

    # the base model is there, the adapter not yet: the group starts with the path adapter only
    await set_job(cluster, "lora-model", SUCCEEDED)
    sts = await eventually(lambda: cluster.statefulsets("lora"), what="the group")
    args = head_args(sts, "lora")
    assert "--enable-lora" in args and "--allow-runtime-lora-updating" in args
    assert lora_modules(args) == ["local=/models/adapters/local"]
    revision = sts["lora-g0-head"]["metadata"]["labels"]["pagoda.dev/revision"]
    await cluster.converge("lora")
    pod_uid = (await cluster.pods("lora"))["lora-g0-head-0"]["metadata"]["uid"]

    # the adapter's Job succeeds: the StatefulSet lists it for pods started from now on; nothing restarts
    await set_job(cluster, "lora-lora-sql", SUCCEEDED)
    sts = await eventually(lambda: _with_modules(cluster, "lora", 2), what="the StatefulSet listing sql")
    assert lora_modules(head_args(sts, "lora")) == ["sql=/models/org/sql-lora/main", "local=/models/adapters/local"]
    assert sts["lora-g0-head"]["metadata"]["labels"]["pagoda.dev/revision"] == revision
    # the status is written after the StatefulSet in the same reconcile pass: a reader may see one before the other
    await eventually(lambda: _state(cluster, "lora", "sql", "Ready"), what="the sql adapter Ready in status")

    # a failed download says why, in the adapter's entry
    await cluster.update_spec("lora", {"adapters": HUB_SPEC["adapters"] + [
        {"name": "gated", "model": {"name": "org/gated-lora"}}]})
    await eventually(lambda: _has(jobs(cluster), {"lora-lora-gated"}), what="the gated adapter's Job")
    await set_job(cluster, "lora-lora-gated", {"failed": 4, "conditions": [
        {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded", "message": "Job has reached the "
         "specified backoff limit"}]})
    gated = await eventually(lambda: _state(cluster, "lora", "gated", "DownloadFailed"), what="DownloadFailed")
    assert "BackoffLimitExceeded" in gated["message"]
    assert "gated" not in " ".join(lora_modules(head_args(await cluster.statefulsets("lora"), "lora")))

    # removing adapters deletes their Jobs (their directories stay in the claim); the group was never replaced
    await cluster.update_spec("lora", {"adapters": [HUB_SPEC["adapters"][1]]})
    await eventually(lambda: _lacks(jobs(cluster), {"lora-lora-sql", "lora-lora-gated"}), what="Jobs deleted")
    assert "lora-model" in await jobs(cluster)
    sts = await eventually(lambda: _with_modules(cluster, "lora", 1), what="the StatefulSet without sql")
    assert sts["lora-g0-head"]["metadata"]["labels"]["pagoda.dev/revision"] == revision
    assert (await cluster.pods("lora"))["lora-g0-head-0"]["metadata"]["uid"] == pod_uid
    await eventually(lambda: _names(cluster, "lora", {"local"}), what="status.adapters without the removed ones")


async def _names(cluster, name: str, names: set[str]):
    return set(await adapter_states(cluster, name)) == names


async def _state(cluster, name: str, adapter: str, state: str) -> bool:
    return (await adapter_states(cluster, name)).get(adapter, {}).get("state") == state


async def _has(read, names: set[str]):
    items = await read
    return items if names <= set(items) else None


async def _lacks(read, names: set[str]):
    items = await read
    return items if not names & set(items) else None


async def _with_modules(cluster, name: str, count: int):
    sts = await cluster.statefulsets(name)
    return sts if sts and len(lora_modules(head_args(sts, name))) == count else None


async def _state(cluster, name: str, adapter: str, state: str):
    entry = (await adapter_states(cluster, name)).get(adapter) or {}
    return entry if entry.get("state") == state else None


# ----- a real runtime -----

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


API_KEY = "lora-operator-test-key"


@pytest.fixture
def runtime(tiny_llama_dir, tmp_path):
    """`pagoda serve` of the tiny Llama as a pod would run it before any adapter was added, with an API key."""
    port = _free_port()
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", str(tiny_llama_dir), "--host", "127.0.0.1",
               "--port", str(port), "--kv-cache-memory", "0.02", "--dtype", "float32", "--enable-lora",
               "--allow-runtime-lora-updating", "--max-loras", "2", "--max-lora-rank", "8"]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "PAGODA_API_KEY": API_KEY})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.3)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def served(url: str) -> dict[str, str]:
    return RuntimeAdapters(url, API_KEY).served()


async def test_adapter_edits_reach_a_running_group_through_the_runtime_without_a_restart(
        cluster, operator, runtime, tiny_llama_dir, tmp_path):
    import openai

    sql = write_lora_adapter(tiny_llama_dir, tmp_path / "sql", rank=8, seed=31)
    chat = write_lora_adapter(tiny_llama_dir, tmp_path / "chat", rank=4, seed=32, targets=("q_proj", "v_proj"))
    big = write_lora_adapter(tiny_llama_dir, tmp_path / "big", rank=16, seed=33, targets=("q_proj",))
    pod_ip = "10.0.0.7"
    # the key is whatever the reconcile read from the Secret: this stand-in only maps the pod to the server
    operator.memo.reconciler.runtime_client = \
        lambda pod, api_key: RuntimeAdapters(runtime, api_key) if (pod.get("status") or {}).get("podIP") == pod_ip \
        else None
    with pytest.raises(AdapterCallError, match="401"):  # the runtime refuses a call without its key
        RuntimeAdapters(runtime).served()
    await cluster._json("POST", SECRETS.format(ns=cluster.ns), {
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "runtime-key", "namespace": cluster.ns},
        "data": {"key": base64.b64encode(API_KEY.encode()).decode()}})

    await cluster.create("live", {"model": {"path": str(Path(tiny_llama_dir))}, "resources": {"requests": {"cpu": "1"}},
                                  "adapters": [{"name": "sql", "model": {"path": str(sql)}}], "replicas": 1,
                                  "env": [{"name": "PAGODA_API_KEY", "valueFrom": {"secretKeyRef": {
                                      "name": "runtime-key", "key": "key"}}}]})
    await cluster.converge("live")
    await cluster._json("PATCH", f"{PODS.format(ns=cluster.ns)}/live-g0-head-0/status", {"status": {"podIP": pod_ip}})
    uid = (await cluster.pods("live"))["live-g0-head-0"]["metadata"]["uid"]
    entry = await eventually(lambda: _groups(cluster, "live", "sql", [0]), timeout=30, what="sql loaded in group 0")
    assert entry["state"] == "Ready" and (await cluster.status("live"))["adaptersReady"] == "1/1"
    assert served(runtime) == {"sql": str(sql)}

    # swap sql for chat: unloaded and loaded in the running server; the pod stays
    await cluster.update_spec("live", {"adapters": [{"name": "chat", "model": {"path": str(chat)}}]})
    await eventually(lambda: _served_is(runtime, {"chat": str(chat)}), timeout=30, what="chat replaces sql")
    await eventually(lambda: _groups(cluster, "live", "chat", [0]), timeout=30, what="status: chat in group 0")
    client = openai.OpenAI(base_url=runtime + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    assert client.completions.create(model="chat", prompt="Hello", max_tokens=4, temperature=0).choices[0].text
    # an adapter the runtime refuses (rank 16 > --max-lora-rank 8) is named in the status; the others stay
    await cluster.update_spec("live", {"adapters": [{"name": "chat", "model": {"path": str(chat)}},
                                                    {"name": "big", "model": {"path": str(big)}}]})
    failed = await eventually(lambda: _state(cluster, "live", "big", "LoadFailed"), timeout=30, what="LoadFailed")
    assert "max_lora_rank" in failed["message"] and failed["groups"] == []
    assert "AdapterLoadFailed" in await cluster.event_reasons("live")
    assert served(runtime) == {"chat": str(chat)}
    assert (await cluster.status("live"))["adaptersReady"] == "1/2"
    # pods started from now on leave it out of their flags: the runtime would refuse it at start-up too
    sts = await eventually(lambda: _with_modules(cluster, "live", 1), timeout=30, what="flags without big")
    assert lora_modules(head_args(sts, "live")) == [f"chat={chat}"]
    pods = await cluster.pods("live")
    assert list(pods) == ["live-g0-head-0"] and pods["live-g0-head-0"]["metadata"]["uid"] == uid


async def _groups(cluster, name: str, adapter: str, groups: list[int]):
    entry = (await adapter_states(cluster, name)).get(adapter) or {}
    return entry if entry.get("groups") == groups else None


async def _served_is(url: str, wanted: dict[str, str]):
    import asyncio

    return (await asyncio.to_thread(served, url)) == wanted
