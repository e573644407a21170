"""The shipped system run as users run it: the real operator (kopf) on KMock, every pod it describes started as a
container of the built runtime image by pod_runner.py, clients over the container network.

    make images && make e2e-containers
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from conftest import E2E
from openai import AsyncOpenAI

pytestmark = [pytest.mark.e2e, pytest.mark.kmock(host="0.0.0.0")]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = ["The capital of France is", "Once upon a time, there was a", "def fibonacci(n):"]
CPU = {"resources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "6Gi"}},
       "engine": {"dtype": "float32", "maxModelLen": 1024, "maxNumSeqs": 8}}


def client(host: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"http://{host}:8000/v1", api_key="none", max_retries=0, timeout=120)


async def chat(host: str, model: str) -> str:
    reply = await client(host).chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=16)
    return reply.choices[0].message.content


async def greedy(host: str, model: str) -> list[str]:
    replies = await asyncio.gather(*(client(host).completions.create(
        model=model, prompt=p, temperature=0, max_tokens=24) for p in PROMPTS))
    return [r.choices[0].text for r in replies]


async def test_one_replica_answers_through_its_service(e2e: E2E):
    # named "pagoda": Kubernetes gives every pod PAGODA_PORT=tcp://... for a Service of that name
    await e2e.cluster.create("pagoda", CPU)
    status = await e2e.ready("pagoda")
    assert status["endpoint"] == "http://pagoda.serving.svc:8000/v1"
    addresses = await e2e.resolve("pagoda.serving.svc.cluster.local")
    assert addresses == [e2e.runner.pod_ip("pagoda-g0-head-0")]
    assert "Paris" in await chat(addresses[0], "pagoda")
    # the operator turns service links off: no PAGODA_PORT=tcp://... from the Service named pagoda
    assert "PAGODA_PORT" not in await e2e.runner.env("pagoda-g0-head-0")
    assert "PAGODA_PORT" in e2e.runner.service_links(list((await e2e.cluster.services()).values()))
    if e2e.operator_runner.pods:  # the operator from its image, installed by the chart (PAGODA_E2E_OPERATOR=chart)
        [operator] = e2e.operator_runner.pods.values()
        assert operator.pod["spec"]["containers"][0]["image"].startswith("pagoda-operator:") and operator.ready

    # (e) an engine edit rolls the group: new pods, started with the new flag
    old = (await e2e.pods("pagoda"))["pagoda-g0-head-0"]["metadata"]["uid"]
    await e2e.cluster.update_spec("pagoda", {"engine": {**CPU["engine"], "maxNumSeqs": 4}})
    await e2e.until(lambda: _replaced(e2e, "pagoda", "pagoda-g0-head-0", old), "the group rolled")
    await e2e.ready("pagoda")
    assert "max_num_seqs=4" in await e2e.runner.logs("pagoda-g0-head-0", 400)
    assert "Paris" in await chat(e2e.runner.pod_ip("pagoda-g0-head-0"), "pagoda")


async def _replaced(e2e: E2E, name: str, pod: str, old_uid: str) -> bool:
    current = (await e2e.pods(name)).get(pod)
    return current is not None and current["metadata"]["uid"] != old_uid


def write_tiny_claim(e2e: E2E, claim: str) -> dict:
    """A tiny random Llama (4 heads, 4 layers: TP=2 and PP=2 both divide it) on a claim; its spec fields."""
    from checkpoints import write_tiny_model

    directory = e2e.runner.base_dir / "claims" / claim
    write_tiny_model(directory, "llama", num_layers=4)
    for path in [directory, *directory.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return {"model": {"path": "/models/tiny", "volume": {"persistentVolumeClaim": {"claimName": claim}}},
            "engine": {"dtype": "float32", "maxModelLen": 256, "maxNumSeqs": 8}}


async def single_process_reference(e2e: E2E, claim: str) -> list[str]:
    """The same prompts through one process of the same image (LLM, no server), for greedy equality."""
    from pod_runner import podman

    code = ("import json; from pagoda import LLM, SamplingParams; "
            "llm = LLM('/models/tiny', dtype='float32', max_model_len=256); "
            f"outs = llm.generate({PROMPTS!r}, SamplingParams(temperature=0, max_tokens=24)); "
            "print(json.dumps([o.outputs[0].text for o in outs]))")
    out = await podman("run", "--rm", "--runtime", "runc", "--ulimit", "nofile=1024:1024", "--ulimit",
                       "nproc=1024:1024", "--volume", f"{e2e.runner.base_dir / 'claims' / claim}:/models/tiny:ro",
                       "--entrypoint", "python", e2e.image, "-c", code, timeout=600)
    return json.loads(out.strip().splitlines()[-1])


async def test_a_flag_the_model_cannot_honour_is_named_in_the_degraded_condition(e2e: E2E):
    # the default model has 9 attention heads: 2 ranks cannot split them, and the operator knows its heads, so
    # it refuses the spec (SpecValid) before any pod
    await e2e.cluster.create("uneven-default", {**CPU, "tensorParallelSize": 2})

    async def spec_refused() -> bool:
        status = await e2e.cluster.status("uneven-default")
        valid = next((c for c in status.get("conditions") or [] if c["type"] == "SpecValid"), {})
        return valid.get("status") == "False" and "9 attention heads" in valid.get("message", "")

    await e2e.until(spec_refused, "SpecValid names the default model's 9 heads", timeout=60)
    assert await e2e.pods("uneven-default") == {}

    # the tiny model's 4 heads on 3 ranks: the operator reads no model of the user's; the engine refuses at
    # start, and its last log line reaches the LLMDeployment's status
    await e2e.cluster.create("uneven", {**CPU, **write_tiny_claim(e2e, "uneven"), "tensorParallelSize": 3})

    async def degraded_says_why() -> bool:
        status = await e2e.cluster.status("uneven")
        degraded = next((c for c in status.get("conditions") or [] if c["type"] == "Degraded"), {})
        return degraded.get("reason") == "PodFailing" and "--tensor-parallel-size 3 does not split" in \
            degraded.get("message", "")

    await e2e.until(degraded_says_why, "Degraded names --tensor-parallel-size", timeout=300)
    assert (await e2e.cluster.status("uneven"))["phase"] == "Degraded"


async def test_tensor_and_pipeline_parallel_groups_form_over_the_container_network(e2e: E2E):
    tiny = write_tiny_claim(e2e, "tiny")
    reference = await single_process_reference(e2e, "tiny")
    await e2e.cluster.create("tp", {**CPU, **tiny, "tensorParallelSize": 2})
    await e2e.cluster.create("pp", {**CPU, **tiny, "pipelineParallelSize": 2})
    await e2e.ready("tp")
    await e2e.ready("pp")
    assert sorted(await e2e.pods("pp")) == ["pp-g0-head-0", "pp-g0-worker-1"]
    assert "tensor_parallel_size=2" in await e2e.runner.logs("tp-g0-head-0", 400)
    assert "pipeline_parallel_size=2" in await e2e.runner.logs("pp-g0-head-0", 400)
    assert await greedy(e2e.runner.pod_ip("tp-g0-head-0"), "tp") == reference
    assert await greedy(e2e.runner.pod_ip("pp-g0-head-0"), "pp") == reference

    # (c) a worker dies: the head's group fails, the operator recreates the whole group, it serves again
    old_head = (await e2e.pods("pp"))["pp-g0-head-0"]["metadata"]["uid"]
    await e2e.runner.kill_container("pp-g0-worker-1")
    await e2e.until(lambda: _replaced(e2e, "pp", "pp-g0-head-0", old_head), "the group recreated")
    await e2e.ready("pp")
    assert await greedy(e2e.runner.pod_ip("pp-g0-head-0"), "pp") == reference
    reasons = await e2e.cluster.event_reasons("pp")
    assert "RecreatingGroup" in reasons, reasons
    status = await e2e.cluster.status("pp")
    assert status["phase"] == "Ready" and status["readyReplicas"] == 1


async def test_the_router_discovers_both_heads_and_keeps_a_conversation_on_one(e2e: E2E):
    await e2e.cluster.create("chat", {**CPU, "replicas": 2, "router": {"enabled": True, "policy": "prefix"}})
    await e2e.ready("chat", groups=2)
    status = await e2e.cluster.status("chat")
    assert status["endpoint"] == "http://chat-router.serving.svc:8000/v1"
    [router] = await e2e.resolve("chat-router.serving.svc.cluster.local")
    heads = {e2e.runner.pod_ip("chat-g0-head-0"), e2e.runner.pod_ip("chat-g1-head-0")}
    router_client = client(router)

    async def served_by(messages) -> str:
        raw = await router_client.chat.completions.with_raw_response.create(
            model="chat", messages=messages, temperature=0, max_tokens=8)
        return raw.headers["x-pagoda-backend"]
    # the router has both heads once their EndpointSlice says Ready; a conversation grows turn by turn
    backends: set[str] = set()
    for i in range(8):
        backends.add(await served_by([{"role": "user", "content": f"Conversation {i}: tell me about towers."}]))
    assert {b.split("//")[1].split(":")[0] for b in backends} == heads
    system = {"role": "system", "content": "You are a helpful assistant who answers in one sentence. " * 8}
    conversation = [system, {"role": "user", "content": "Name a tall building."}]
    first = await served_by(conversation)
    for turn in range(3):
        conversation += [{"role": "assistant", "content": "The tower is tall."},
                         {"role": "user", "content": f"And another one ({turn})?"}]
        assert await served_by(conversation) == first


async def test_an_adapter_edit_reaches_running_pods_without_a_restart(e2e: E2E, tmp_path):
    claim = e2e.runner.base_dir / "claims" / "weights"
    write_weights_and_adapter(claim)
    spec = {**CPU, "model": {"path": "/models", "volume": {"persistentVolumeClaim": {"claimName": "weights"}}},
            "adapters": []}
    await e2e.cluster.create("lora", spec)
    await e2e.ready("lora")
    before = (await e2e.pods("lora"))["lora-g0-head-0"]["metadata"]["uid"]
    await e2e.cluster.update_spec("lora", {"adapters": [{"name": "sql", "model": {"path": "/models/adapters/sql"}}]})

    async def loaded():
        return (await e2e.cluster.status("lora")).get("adaptersReady") == "1/1"
    await e2e.until(loaded, "adapter sql Ready in status")
    head = e2e.runner.pod_ip("lora-g0-head-0")
    reply = await client(head).completions.create(model="sql", prompt="SELECT", max_tokens=8, temperature=0)
    assert reply.model == "sql" and reply.choices[0].text
    pods = await e2e.pods("lora")
    assert pods["lora-g0-head-0"]["metadata"]["uid"] == before  # loaded into the running pod
    assert pods["lora-g0-head-0"]["status"]["containerStatuses"][0]["restartCount"] == 0


def write_weights_and_adapter(claim: Path) -> None:
    """The default model's Hugging Face directory at the claim's root, and a PEFT adapter written by peft."""
    import shutil

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from pagoda.config.default_model import default_model_path

    shutil.copytree(default_model_path(), claim, dirs_exist_ok=True)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(claim, torch_dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(claim / "adapters" / "sql")
    for path in [claim, *claim.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)


async def test_precise_routing_reads_the_heads_kv_events_over_the_container_network(e2e: E2E):
    import httpx

    await e2e.cluster.create("exact", {**CPU, "replicas": 2, "router": {"enabled": True, "policy": "precise"}})
    await e2e.ready("exact", groups=2)
    [router] = await e2e.resolve("exact-router.serving.svc.cluster.local")
    for i in range(6):
        await client(router).chat.completions.create(
            model="exact", temperature=0, max_tokens=8,
            messages=[{"role": "user", "content": f"Question {i}: " + "tell me about towers and bridges. " * 6}])
    heads = {f"http://{e2e.runner.pod_ip(f'exact-g{g}-head-0')}:8000": g for g in (0, 1)}
    seen: dict = {}

    async def index_matches_engines():
        async with httpx.AsyncClient(timeout=10) as http:
            index = (await http.get(f"http://{router}:8000/debug/kv-index")).json()
            engines = {}
            for url in heads:
                metrics = (await http.get(f"{url}/metrics")).text
                engines[url] = next(float(line.split()[-1]) for line in metrics.splitlines()
                                    if line.startswith("pagoda:prefix_cache_blocks"))
        held = {url: index.get(url, {}).get("blocks", 0) for url in heads}  # no event yet: nothing held
        seen.update(index=index, engines=engines)
        return sum(engines.values()) > 0 and all(held[url] == engines[url] for url in heads)
    try:
        await e2e.until(index_matches_engines, "the router's KV index equal to each head's cached blocks", timeout=60)
    except AssertionError as e:
        router_pod = next(name for name in e2e.runner.pods if name.startswith("exact-router"))
        raise AssertionError(f"{e}: {seen}\n{await e2e.runner.logs(router_pod, 40)}") from None
