"""Overload (429), graceful shutdown on SIGTERM, engine death, and CLI errors."""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from live_server import PATCHED_LAUNCHER, free_port

from pagoda.entrypoints.openai.worker_server import build_worker_app

pytestmark = pytest.mark.server

LONG = {"prompt": "Hello", "max_tokens": 480, "ignore_eos": True, "stream": True}


def data_lines(response: httpx.Response):
    return (line for line in response.iter_lines() if line.startswith("data:"))


@pytest.fixture(scope="module")
def small_server(server_factory):
    """One running request at a time and one waiting: easy to fill. Steps take 5 ms or more, so a LONG request
    stays in flight 2.4 s (the tiny model's own steps, ~0.3 ms, would end it before a test's next request)."""
    return server_factory("--max-num-seqs", "1", "--max-queued-requests", "1", "--shutdown-timeout", "60",
                          launcher=PATCHED_LAUNCHER, env={"TEST_SERVE_LOAD_DELAY": "3", "TEST_SERVE_STEP_DELAY": "0.005"})


def test_503_while_loading(small_server):
    assert 503 in small_server.statuses_while_starting
    assert 503 in small_server.v1_statuses_while_starting


def test_start_up_heap_is_frozen_and_collections_are_back_on(small_server):
    """A full collection over what start-up built stalls every request (~200 ms on the default model)."""
    state = re.search(r"TEST gc enabled=(\w+) frozen=(\d+)", small_server.log_path.read_text())
    assert state is not None, small_server.log()
    assert state[1] == "True" and int(state[2]) > 50_000


def test_full_queue_is_429_with_retry_after(small_server):
    url = small_server.url + "/v1/completions"
    with httpx.Client(timeout=30) as c, c.stream("POST", url, json=LONG) as first, \
            c.stream("POST", url, json=LONG) as second:
        assert first.status_code == second.status_code == 200
        r = httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error"
    # the two streams were abandoned: their places free up and requests are admitted again
    deadline = time.monotonic() + 20
    while (r := httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}, timeout=30)).status_code == 429:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert r.status_code == 200


def test_sigterm_drains_running_requests_then_exits_0(small_server):
    url = small_server.url
    result: dict = {}

    def stream_to_the_end() -> None:
        with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/completions",
                                                     json={**LONG, "stream_options": {"include_usage": True}}) as r:
            lines = data_lines(r)
            next(lines)
            result["started"] = time.monotonic()
            started.set()
            result["events"] = list(lines)

    started = threading.Event()
    reader = threading.Thread(target=stream_to_the_end)
    reader.start()
    assert started.wait(30)
    small_server.process.send_signal(signal.SIGTERM)
    # the same stop again a moment later, as `make serve` stopped through its process group delivers it (make
    # forwards SIGTERM to the server, which got its own): still one drain, no forced stop (sent at once, the
    # kernel would merge the two)
    time.sleep(0.2)
    small_server.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while httpx.get(url + "/health", timeout=5).status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    refused = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=5)
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    reader.join(60)
    assert small_server.process.wait(60) == 0
    events = result["events"]
    assert events[-1] == "data: [DONE]" and '"completion_tokens":480' in events[-2]
    log = small_server.log()
    assert "stopping now" not in log and "Traceback" not in log, log[-3000:]


def test_sigterm_aborts_what_outlives_the_shutdown_timeout(server_factory):
    server = server_factory("--shutdown-timeout", "1", launcher=PATCHED_LAUNCHER,
                            env={"TEST_SERVE_STEP_DELAY": "0.05"})  # 480 tokens would take 24 s
    received: list[str] = []

    def stream() -> None:
        try:
            with httpx.Client(timeout=60) as c, c.stream("POST", server.url + "/v1/completions", json=LONG) as r:
                for line in data_lines(r):
                    received.append(line)
        except httpx.HTTPError:
            pass  # the server cut the stream: expected

    reader = threading.Thread(target=stream)
    reader.start()
    deadline = time.monotonic() + 30
    while not received:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    started = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(30) == 0
    assert time.monotonic() - started < 15
    reader.join(30)
    assert "data: [DONE]" not in received and len(received) < 480


def test_sigterm_while_the_model_loads_exits_at_once(server_factory):
    """A pod deleted while its model loads stops now, not once the load is done."""
    server = server_factory(launcher=PATCHED_LAUNCHER, env={"TEST_SERVE_LOAD_DELAY": "120"}, wait=False)
    deadline = time.monotonic() + 60
    while True:  # the port is open and says the model is loading
        assert server.process.poll() is None and time.monotonic() < deadline, server.log()
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 503:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    started = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(30) == 0
    assert time.monotonic() - started < 10
    assert "Traceback" not in server.log()


def test_engine_death_fails_requests_and_health(server_factory):
    server = server_factory(launcher=PATCHED_LAUNCHER)
    client = server.client("none", timeout=30)
    stream = client.completions.create(model=None, prompt="Hello", max_tokens=480, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=None, prompt="KILL_ENGINE", max_tokens=4)
    assert e.value.status_code == 500 and "engine" in e.value.message
    with pytest.raises(openai.APIError, match="engine"):
        for _ in stream:
            pass
    assert httpx.get(server.url + "/health", timeout=5).status_code == 503


@pytest.mark.parametrize("argv, env, flag", [
    (["--port", "abc"], {}, "--port"),
    (["--dtype", "float8"], {}, "--dtype"),
    ([], {"PAGODA_MAX_NUM_SEQS": "0"}, "--max-num-seqs"),
    ([], {"PAGODA_ENABLE_PREFIX_CACHING": "maybe"}, "--enable-prefix-caching"),
    ([], {"PAGODA_BLOCK_SIZE": "7"}, "--block-size"),
    (["--max-model-len", "100000"], {}, "--max-model-len"),
])
def test_bad_flag_values_are_cli_errors(tiny_llama_dir, argv, env, flag):
    r = subprocess.run([sys.executable, "-m", "pagoda.entrypoints.cli", "serve", str(tiny_llama_dir), *argv],
                       capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert r.returncode == 2
    assert flag in r.stderr and "Traceback" not in r.stderr


def test_load_failure_exits_1_naming_the_flag(tiny_llama_dir):
    r = subprocess.run([str(Path(sys.executable).parent / "pagoda"), "serve", str(tiny_llama_dir), "--port", "0",
                        "--host", "127.0.0.1", "--kv-cache-memory", "0.00001"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "--kv-cache-memory" in r.stderr and "Traceback" not in r.stderr


def test_worker_mode_serves_health_and_metrics():
    joined, stop = threading.Event(), threading.Event()

    def run_rank(mark_ready) -> None:
        joined.wait(10)
        mark_ready()
        stop.wait(10)

    exits: list[int] = []
    with TestClient(build_worker_app(run_rank, exits.append)) as c:
        assert c.get("/health").status_code == 503
        joined.set()
        deadline = time.monotonic() + 5
        while c.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert "pagoda:worker_joined 1.0" in c.get("/metrics").text
        stop.set()
        deadline = time.monotonic() + 5
        while not exits:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert exits == [0] and c.get("/health").status_code == 503


def test_a_drained_server_that_converted_the_default_model_ends_with_the_drain(tmp_path):
    """The first `make serve` on a machine: an empty $PAGODA_CACHE_DIR, so the default model is converted
    from GGUF first. After SIGTERM the output ends with the drain: no "nanobind: leaked ..." report (the
    conversion used to import triton into the server), no traceback."""
    from pagoda.config.default_model import cache_dir

    cache = tmp_path / "cache"
    cache.mkdir()
    kernels = cache_dir() / "cpu_kernels"
    if kernels.is_dir():  # the C++ kernels already built here: only the model is converted anew
        (cache / "cpu_kernels").symlink_to(kernels)
    port = free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "pagoda.entrypoints.cli", "serve", "--host", "127.0.0.1",
                                    "--port", str(port), "--kv-cache-memory", "0.05", "--max-model-len", "512"],
                                   stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PAGODA_CACHE_DIR": str(cache), "TOKENIZERS_PARALLELISM": "false"})
    try:
        deadline = time.monotonic() + 600
        while True:
            assert process.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        assert list((cache / "models").iterdir()), "the default model was not converted into the empty cache"
        process.send_signal(signal.SIGTERM)
        assert process.wait(120) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    output = log_path.read_text(errors="replace")
    tail = output[output.index("SIGTERM: draining"):]
    assert "nanobind" not in output and "leaked" not in output and "Traceback" not in output, tail
    assert re.fullmatch(r".*SIGTERM: draining.*\n.*Shutting down\n.*Waiting for application shutdown\.\n"
                        r".*Application shutdown complete\.\n.*Finished server process \[\d+\]\n", tail, re.S), tail
