"""`pagoda serve -dp 2 --enable-expert-parallel`: one API server in front of two DP ranks (a tiny Mixtral, its
experts split over both). Both ranks take requests; greedy text equals one process's; streaming, abort and
structured outputs work whichever rank serves; /metrics has a series per engine; a dead rank turns /health
503 and fails the request it was serving, with no hang."""

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from live_server import API_KEY

from pagoda import LLM, SamplingParams

pytestmark = pytest.mark.distributed

PROMPTS = ["Hello, my name is", "The capital of France is", "one two three four", "Paged attention stores"]


@pytest.fixture(scope="module")
def mixtral(tiny_model_factory):
    return tiny_model_factory("mixtral")


@pytest.fixture(scope="module")
def one_process_answers(mixtral):
    llm = LLM(str(mixtral), dtype="float32", kv_cache_memory=0.02)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        return [o.outputs[0].text for o in outs]
    finally:
        llm.shutdown()


def metric(text: str, name: str, engine: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and f'engine="{engine}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} for engine {engine} in /metrics")


def child_pids(pid: int) -> list[int]:
    """Children of every thread of pid (the engine's thread starts the ranks)."""
    return [int(child) for task in Path(f"/proc/{pid}/task").iterdir()
            for child in (task / "children").read_text().split()]


def test_serve_dp2_with_expert_parallel(server_factory, mixtral, one_process_answers):
    server = server_factory("--api-key", API_KEY, "--dtype", "float32", "-dp", "2", "--enable-expert-parallel",
                            model=mixtral)
    client = server.client(API_KEY, timeout=120, asynchronous=True)

    async def complete(prompt):
        out = await client.completions.create(model=str(mixtral), prompt=prompt, max_tokens=8, temperature=0,
                                              extra_body={"ignore_eos": True})
        return out.choices[0].text

    async def requests():
        answers = await asyncio.gather(*(complete(p) for p in PROMPTS))
        # streaming, on whichever rank takes it
        stream = await client.chat.completions.create(model=str(mixtral), messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=6, temperature=0, stream=True)
        chunks = [c async for c in stream]
        # structured outputs: the grammar constrains the rank's sampling
        choice = await client.completions.create(model=str(mixtral), prompt="Yes or no?", max_tokens=5, temperature=0,
                                                 extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
        # abort: a client that stops listening mid-stream
        stream = await client.completions.create(model=str(mixtral), prompt=PROMPTS[0], max_tokens=200,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
        async for _ in stream:
            break
        await stream.close()
        return answers, chunks, choice.choices[0].text

    answers, chunks, choice = asyncio.run(requests())
    assert answers == one_process_answers
    assert chunks[-1].choices[0].finish_reason == "length"
    assert choice in ("yes", "no")
    text = httpx.get(server.url + "/metrics").text
    for engine in ("0", "1"):  # both ranks took requests
        assert metric(text, "pagoda:prompt_tokens_total", engine) > 0
        assert metric(text, "pagoda:kv_cache_total_blocks", engine) > 0
    deadline = time.monotonic() + 30  # the aborted request's blocks come back
    while sum(metric(httpx.get(server.url + "/metrics").text, "pagoda:kv_cache_used_blocks", e)
              for e in ("0", "1")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sum(metric(httpx.get(server.url + "/metrics").text, "pagoda:kv_cache_used_blocks", e)
               for e in ("0", "1")) == 0

    # a dead rank: the request it serves fails, /health says 503, nothing hangs
    sync = server.client(API_KEY, timeout=60)
    stream = sync.completions.create(model=str(mixtral), prompt=PROMPTS[1], max_tokens=400, temperature=0,
                                     stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    own = Path(f"/proc/{server.process.pid}/cmdline").read_bytes()
    ranks = [pid for pid in child_pids(server.process.pid)
             if (cmdline := Path(f"/proc/{pid}/cmdline").read_bytes()) == own or b"spawn_main" in cmdline]
    (rank1,) = ranks  # DP rank 1, forked or spawned (not the resource tracker)
    os.kill(rank1, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises((openai.APIError, httpx.HTTPError)):
        for _ in stream:
            pass
    statuses = set()
    while time.monotonic() - started < 20 and 503 not in statuses:
        try:
            statuses.add(httpx.get(server.url + "/health", timeout=2).status_code)
        except httpx.TransportError:
            break  # the server exits once a rank is gone (its group is recreated whole)
        time.sleep(0.1)
    assert 503 in statuses
    assert server.process.wait(30) != 0


def test_external_load_balancing_each_rank_its_own_endpoint(server_factory, tiny_llama_dir):
    """--data-parallel-rank R (vLLM's external load balancing): each DP rank its own `pagoda serve`, here
    independent engines of a dense model. Both answer as one process would, and each labels its series
    engine="R"."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory=0.02)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        reference = [o.outputs[0].text for o in outs]
    finally:
        llm.shutdown()
    ranks = [server_factory("--api-key", API_KEY, "--dtype", "float32", "--data-parallel-size", "2",
                            "--data-parallel-rank", str(rank)) for rank in (0, 1)]
    for rank, server in enumerate(ranks):
        client = server.client(API_KEY, timeout=120)
        answers = [client.completions.create(model=str(tiny_llama_dir), prompt=p, max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text for p in PROMPTS]
        assert answers == reference
        text = httpx.get(server.url + "/metrics").text
        assert metric(text, "pagoda:prompt_tokens_total", str(rank)) > 0
        assert metric(text, "pagoda:e2e_request_latency_seconds_count", str(rank)) == len(PROMPTS)
        success = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(f'pagoda:request_success_total{{engine="{rank}",finished_reason="length"')]
        assert success == [len(PROMPTS)]
        other = str(1 - rank)
        assert f'engine="{other}"' not in text  # this server runs its rank only


def test_external_load_balancing_refuses_experts_over_independent_ranks(mixtral):
    pagoda = str(Path(sys.executable).parent / "pagoda")
    done = subprocess.run([pagoda, "serve", str(mixtral), "--data-parallel-size", "2", "--data-parallel-rank", "1",
                           "--enable-expert-parallel"], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "--enable-expert-parallel with --data-parallel-rank" in done.stderr
