"""Data parallelism over pods (issue 53): an LLMDeployment with spec.parallelism {data: 2, dataLocal: 1, expert: true}
on a tiny mixture-of-experts model, run by the real operator and pod_runner's containers: two pods, the head's
API server in front of both ranks, the other pod `--headless`, the experts spread over both.

    make images && make e2e-containers

Skipped only where the e2e fixture skips (no podman, images not built); an image built before the runtime had
--headless fails, naming the stale image, rather than skipping."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from conftest import E2E
from pod_runner import podman
from test_containers import CPU, PROMPTS, _replaced, client, greedy, single_process_reference

pytestmark = [pytest.mark.e2e, pytest.mark.kmock(host="0.0.0.0")]


async def serves_multi_node_data_parallelism(image: str) -> bool:
    helped = await podman("run", "--rm", "--runtime", "runc", "--ulimit", "nofile=1024:1024", "--ulimit",
                          "nproc=1024:1024", "--entrypoint", "pagoda", image, "serve", "--help", check=False,
                          timeout=120)
    return "--headless" in helped and "--data-parallel-start-rank" in helped


def write_tiny_moe_claim(e2e: E2E, claim: str) -> dict:
    """A tiny random Mixtral (4 experts, top-2: two whole experts per rank at EP 2) on a claim; its spec fields.
    Mounted at /models/tiny, where single_process_reference reads it too."""
    from checkpoints import write_tiny_model

    directory = e2e.runner.base_dir / "claims" / claim
    write_tiny_model(directory, "mixtral", num_layers=2)
    for path in [directory, *directory.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return {"model": {"path": "/models/tiny", "volume": {"persistentVolumeClaim": {"claimName": claim}}},
            "engine": {"dtype": "float32", "maxModelLen": 256, "maxNumSeqs": 8}}


async def test_data_parallel_ranks_over_two_pods_with_experts_over_both(e2e: E2E):
    assert await serves_multi_node_data_parallelism(e2e.image), \
        f"the runtime image {e2e.image} has no `pagoda serve --headless`: built before issue 53, run make images"
    moe = write_tiny_moe_claim(e2e, "moe")
    reference = await single_process_reference(e2e, "moe")
    await e2e.cluster.create("dp", {**CPU, **moe, "parallelism": {"data": 2, "dataLocal": 1, "expert": True}})
    status = await e2e.ready("dp")
    assert status["parallelism"] == {"tensor": 1, "pipeline": 1, "data": 2, "dataLocal": 1, "expert": True,
                                     "podsPerGroup": 2}
    assert sorted(await e2e.pods("dp")) == ["dp-g0-head-0", "dp-g0-worker-1"]
    # the Service selects the head only: one endpoint for both ranks
    assert await e2e.resolve("dp.serving.svc.cluster.local") == [e2e.runner.pod_ip("dp-g0-head-0")]
    head = e2e.runner.pod_ip("dp-g0-head-0")
    # greedy tokens equal one process, whichever rank served each prompt
    assert await greedy(head, "dp") == reference
    many = await asyncio.gather(*(client(head).completions.create(model="dp", prompt=p, temperature=0, max_tokens=24)
                                  for p in PROMPTS * 4))
    assert [r.choices[0].text for r in many] == reference * 4
    # both ranks took requests: /metrics labels each series with its engine (rank)
    async with httpx.AsyncClient(timeout=30) as http:
        metrics = (await http.get(f"http://{head}:8000/metrics")).text
    assert 'engine="0"' in metrics and 'engine="1"' in metrics

    # the headless pod dies: its rank is gone, the operator recreates the whole group, it serves again
    old_head = (await e2e.pods("dp"))["dp-g0-head-0"]["metadata"]["uid"]
    await e2e.runner.kill_container("dp-g0-worker-1")
    await e2e.until(lambda: _replaced(e2e, "dp", "dp-g0-head-0", old_head), "the group recreated")
    await e2e.ready("dp")
    assert await greedy(e2e.runner.pod_ip("dp-g0-head-0"), "dp") == reference
