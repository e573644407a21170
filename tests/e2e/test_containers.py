"""The shipped system run as users run it: the real operator (kopf) on KMock, every pod it describes started as a
container of the built runtime image by pod_runner.py, clients over the container network.

    make images && make e2e-containers
"""

from __future__ import annotations

import asyncio

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
