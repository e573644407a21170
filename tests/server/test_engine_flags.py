"""`pagoda serve` with the vLLM engine flags: swap under memory pressure seen in /metrics, the periodic
stats line in the log, and a refused value named by its flag before anything loads."""

import concurrent.futures
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from live_server import API_KEY

pytestmark = pytest.mark.server

BLOCK_BYTES = 8192  # the tiny llama's KV block of 16 tokens, float32


def test_swap_and_stats_flags_take_effect(server_factory):
    server = server_factory("--api-key", API_KEY, "--dtype", "float32", "--max-model-len", "160",
                            "--kv-cache-memory", str(10 * BLOCK_BYTES / 2**30), "--swap-space", "0.001",  # 131 blocks
                            "--preemption-mode", "swap", "--stats-log-interval", "0.2", "--enforce-eager",
                            "--kv-cache-dtype", "auto", "--log-level", "info")
    client = server.client(API_KEY, timeout=120)
    prompts = ["Hello, my name is", "The quick brown fox jumps over the lazy dog", "a", "Paris is the capital of"]

    def complete(prompt):
        return client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=100,
                                         temperature=0, extra_body={"ignore_eos": True})

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(complete, prompts))
    assert all(r.usage.completion_tokens == 100 for r in results)
    metrics = httpx.get(server.url + "/metrics").text
    swapped_out = float(re.search(r'^pagoda:num_swapped_out_total\{[^}]*\} (\S+)$', metrics, re.M).group(1))
    swapped_in = float(re.search(r'^pagoda:num_swapped_in_total\{[^}]*\} (\S+)$', metrics, re.M).group(1))
    assert swapped_out > 0 and swapped_in == swapped_out
    assert re.search(r'^pagoda:swap_space_total_blocks\{[^}]*\} 131\.0$', metrics, re.M)
    deadline = time.monotonic() + 10
    while "Avg generation throughput" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "Avg generation throughput" in server.log() and "Swapped:" in server.log()


def test_a_refused_engine_value_names_its_flag(tiny_llama_dir):
    pagoda = str(Path(sys.executable).parent / "pagoda")
    # (--kv-cache-dtype fp8, refused here before, is served now: calibrated scales without an fp8 cache are not)
    done = subprocess.run([pagoda, "serve", str(tiny_llama_dir), "--calculate-kv-scales"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "--calculate-kv-scales" in done.stderr
