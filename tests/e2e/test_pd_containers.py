"""Prefill/decode disaggregation over pods (issue 55): an LLMDeployment with spec.prefill, run by the real operator
and pod_runner's containers: one prefill pod (kv_producer), one decode pod (kv_consumer) and the router in P/D
mode. Greedy text through the router equals one process's; the decode pod's metrics show the KV cache it pulled
over NIXL; killing the prefill pod keeps requests succeeding (the router's decode-only fallback, the decode side's
recompute) until the operator has it back.

    make images && make e2e-containers

Skipped only where the e2e fixture skips (no podman, images not built); an image built before the runtime had
--kv-transfer-config or the router its P/D mode fails, naming the stale image, rather than skipping."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from conftest import E2E
from pod_runner import podman
from prometheus_client.parser import text_string_to_metric_families
from test_containers import CPU, PROMPTS, _replaced, client, single_process_reference, write_tiny_claim

pytestmark = [pytest.mark.e2e, pytest.mark.kmock(host="0.0.0.0")]

PREFILL_POD, DECODE_POD = "pd-p0-head-0", "pd-g0-head-0"
# what the decode side pulled over NIXL (vLLM's NixlPromMetrics names under pagoda:)
BYTES_TRANSFERRED = "pagoda:nixl_bytes_transferred"
RECOMPUTED = "pagoda:nixl_num_recomputed_prompts"
PREFILL_BACKEND_HEADER = "x-pagoda-prefill-backend"  # the router names the prefill backend on a P/D answer


async def help_text(image: str, *command: str) -> str:
    return await podman("run", "--rm", "--runtime", "runc", "--ulimit", "nofile=1024:1024", "--ulimit",
                        "nproc=1024:1024", "--entrypoint", "pagoda", image, *command, "--help", check=False,
                        timeout=120)


async def metric(host: str, name: str, suffix: str = "") -> float:
    """A family's value summed over its series (a histogram's `_sum` or `_count` with suffix)."""
    async with httpx.AsyncClient(timeout=30) as http:
        text = (await http.get(f"http://{host}:8000/metrics")).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name + suffix:
                total += sample.value
    return total


async def greedy_with_prefill(router: str, model: str = "pd") -> tuple[list[str], set[str]]:
    """The prompts' greedy completions through the router, and the prefill backends it named."""
    async def one(prompt: str):
        raw = await client(router).completions.with_raw_response.create(
            model=model, prompt=prompt, temperature=0, max_tokens=24)
        return raw.parse().choices[0].text, raw.headers.get(PREFILL_BACKEND_HEADER)
    answers = await asyncio.gather(*(one(p) for p in PROMPTS))
    return [text for text, _ in answers], {backend for _, backend in answers if backend}


async def prefill_ready(e2e: E2E) -> bool:
    status = await e2e.cluster.status("pd")
    return (status.get("prefill") or {}).get("ready") == "1/1"


async def test_prefill_and_decode_pods_behind_the_router_answer_as_one_engine(e2e: E2E):
    assert "--kv-transfer-config" in await help_text(e2e.image, "serve"), \
        f"the runtime image {e2e.image} has no `pagoda serve --kv-transfer-config`: built before issue 55, run make images"
    assert "--prefill-k8s-service" in await help_text(e2e.image, "router"), \
        f"the runtime image {e2e.image} has no P/D router (`--prefill-k8s-service`): run make images"
    tiny = write_tiny_claim(e2e, "weights")
    reference = await single_process_reference(e2e, "weights")
    await e2e.cluster.create("pd", {**CPU, **tiny, "router": {"enabled": True, "policy": "prefix"},
                                    "prefill": {"replicas": 1}})
    status = await e2e.ready("pd")
    await e2e.until(lambda: prefill_ready(e2e), "the prefill group Ready")
    assert sorted(p for p in await e2e.pods("pd") if not p.startswith("pd-router-")) == [DECODE_POD, PREFILL_POD]
    assert status["endpoint"] == "http://pd-router.serving.svc:8000/v1"
    # Service pd: the decode head only; Service pd-prefill: the prefill head only
    decode, prefill = e2e.runner.pod_ip(DECODE_POD), e2e.runner.pod_ip(PREFILL_POD)
    assert await e2e.resolve("pd.serving.svc.cluster.local") == [decode]
    assert await e2e.resolve("pd-prefill.serving.svc.cluster.local") == [prefill]
    # the side channel's host is the pod's own address (downward API)
    assert (await e2e.runner.env(PREFILL_POD))["VLLM_NIXL_SIDE_CHANNEL_HOST"] == prefill
    [router] = await e2e.resolve("pd-router.serving.svc.cluster.local")

    # the router has both roles once their EndpointSlices say Ready: P/D answers name the prefill pod
    async def pd_path_taken() -> bool:
        try:
            _, backends = await greedy_with_prefill(router)
        except Exception:  # noqa: BLE001 - the router may not have discovered a backend yet
            return False
        return backends == {f"http://{prefill}:8000"}
    await e2e.until(pd_path_taken, "the router sending prompts to the prefill pod", timeout=120)
    before = [await metric(decode, BYTES_TRANSFERRED, suffix) for suffix in ("_sum", "_count")]
    recomputed = await metric(decode, RECOMPUTED)
    texts, backends = await greedy_with_prefill(router)
    assert texts == reference and backends == {f"http://{prefill}:8000"}  # greedy through P/D equals one engine
    # the decode pod pulled these prompts' KV over NIXL, and computed none of them itself
    assert await metric(decode, BYTES_TRANSFERRED, "_sum") > before[0]
    assert await metric(decode, BYTES_TRANSFERRED, "_count") >= before[1] + len(PROMPTS)
    assert await metric(decode, RECOMPUTED) == recomputed

    # the prefill pod dies: every request still succeeds (decode alone) until the operator has it back
    old = (await e2e.pods("pd"))[PREFILL_POD]["metadata"]["uid"]
    decode_uid = (await e2e.pods("pd"))[DECODE_POD]["metadata"]["uid"]
    await e2e.runner.kill_container(PREFILL_POD)
    answered, deadline = 0, time.monotonic() + 600
    while not (await _replaced(e2e, "pd", PREFILL_POD, old) and await prefill_ready(e2e)):
        assert time.monotonic() < deadline, "the prefill group was not back in 600 s"
        texts, _ = await greedy_with_prefill(router)
        assert texts == reference
        answered += 1
    assert answered > 0
    assert "RecreatingGroup" in await e2e.cluster.event_reasons("pd")
    assert (await e2e.pods("pd"))[DECODE_POD]["metadata"]["uid"] == decode_uid  # the decode group untouched

    # back: P/D again, through the new prefill pod
    prefill = e2e.runner.pod_ip(PREFILL_POD)

    async def pd_again() -> bool:
        texts, backends = await greedy_with_prefill(router)
        assert texts == reference
        return backends == {f"http://{prefill}:8000"}
    pulled = await metric(decode, BYTES_TRANSFERRED, "_count")
    await e2e.until(pd_again, "P/D through the new prefill pod", timeout=120)
    assert await metric(decode, BYTES_TRANSFERRED, "_count") > pulled


async def test_prefill_and_decode_groups_of_two_tensor_ranks_move_each_ranks_shard(e2e: E2E):
    # TP=2 on both roles, each group one pod of two rank processes (their NIXL agents): decode rank r READs
    # prefill rank r's KV heads, pod to pod
    tiny = write_tiny_claim(e2e, "weights-tp")
    reference = await single_process_reference(e2e, "weights-tp")
    await e2e.cluster.create("pdtp", {**CPU, **tiny, "tensorParallelSize": 2,
                                      "router": {"enabled": True, "policy": "prefix"},
                                      "prefill": {"replicas": 1, "parallelism": {"tensor": 2}}})
    await e2e.ready("pdtp")

    async def prefill_group_ready() -> bool:
        return ((await e2e.cluster.status("pdtp")).get("prefill") or {}).get("ready") == "1/1"
    await e2e.until(prefill_group_ready, "the prefill group Ready")
    assert sorted(p for p in await e2e.pods("pdtp") if not p.startswith("pdtp-router-")) == [
        "pdtp-g0-head-0", "pdtp-p0-head-0"]
    for pod in ("pdtp-g0-head-0", "pdtp-p0-head-0"):
        assert "tensor_parallel_size=2" in await e2e.runner.logs(pod, 400)
    decode, prefill = e2e.runner.pod_ip("pdtp-g0-head-0"), e2e.runner.pod_ip("pdtp-p0-head-0")
    [router] = await e2e.resolve("pdtp-router.serving.svc.cluster.local")

    async def pd_path_taken() -> bool:
        try:
            _, backends = await greedy_with_prefill(router, "pdtp")
        except Exception:  # noqa: BLE001 - the router may not have discovered a backend yet
            return False
        return backends == {f"http://{prefill}:8000"}
    await e2e.until(pd_path_taken, "the router sending prompts to the prefill group", timeout=180)
    pulled = await metric(decode, BYTES_TRANSFERRED, "_count")
    recomputed = await metric(decode, RECOMPUTED)
    texts, _ = await greedy_with_prefill(router, "pdtp")
    assert texts == reference
    # both ranks pulled their shard of every prompt (transfers are counted per rank), none was recomputed
    assert await metric(decode, BYTES_TRANSFERRED, "_count") >= pulled + 2 * len(PROMPTS)
    assert await metric(decode, RECOMPUTED) == recomputed
