"""Multi-node groups over TCP: a head and a worker node of one group (`--nnodes 2`), and how a group
fails: a dead worker, a missing worker, mismatched settings."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from hosts import make_two_hosts, remove_two_hosts

from pagoda import LLM, SamplingParams

pytestmark = pytest.mark.distributed

PROMPT = "The quick brown fox jumps over the lazy dog. Paged attention"
BASE_FLAGS = ["--dtype", "float32", "--kv-cache-memory", "0.02", "--log-level", "info",
              "--pipeline-parallel-size", "2", "--nnodes", "2"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    def __init__(self, model: Path, log_dir: Path, node_rank: int, master_addr: str, master_port: int,
                 host: str = "127.0.0.1", prefix: list[str] | None = None, env: dict | None = None, *extra: str):
        self.port = free_port()
        self.host = host
        self.log_path = log_dir / f"node{node_rank}-{self.port}.log"
        command = (prefix or []) + [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", str(model),
                                    "--host", "0.0.0.0", "--port", str(self.port), *BASE_FLAGS,
                                    "--node-rank", str(node_rank), "--master-addr", master_addr,
                                    "--master-port", str(master_port), *extra]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})})

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def health(self) -> int:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code
        except httpx.TransportError:
            return 0

    def wait_healthy(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"node exited with {self.process.returncode}:\n{self.log()}")
            if self.health() == 200:
                return
            time.sleep(0.3)
        raise TimeoutError(f"node not healthy after {timeout}s:\n{self.log()}")

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"node still running after {timeout}s:\n{self.log()}") from None

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


@pytest.fixture
def nodes():
    started: list[Node] = []
    yield started
    for node in started:
        node.stop()


@pytest.fixture(scope="module")
def two_hosts():
    try:
        hosts = make_two_hosts()
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        pytest.skip(f"cannot make network namespaces here: {detail.strip()}")
    yield hosts
    remove_two_hosts(hosts)


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama", num_layers=3)


@pytest.fixture(scope="module")
def expected_text(model):
    llm = LLM(str(model), dtype="float32", kv_cache_memory=0.02)
    return llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text


def test_two_hosts_serve_one_group_and_a_dead_worker_fails_it(two_hosts, model, expected_text, nodes,
                                                               tmp_path):
    master_port = free_port()
    worker = Node(model, tmp_path, 1, two_hosts.head_ip, master_port, host=two_hosts.worker_ip,
                  prefix=two_hosts.exec_prefix(), env={"GLOO_SOCKET_IFNAME": two_hosts.worker_ifname})
    head = Node(model, tmp_path, 0, two_hosts.head_ip, master_port,
                env={"GLOO_SOCKET_IFNAME": two_hosts.head_ifname})
    nodes += [worker, head]
    head.wait_healthy()
    worker.wait_healthy(30)
    response = httpx.post(head.url + "/v1/completions", timeout=60, json={
        "model": str(model), "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == expected_text
    assert httpx.get(worker.url + "/metrics", timeout=5).status_code == 200

    worker.process.kill()
    started = time.monotonic()
    while head.health() == 200:
        assert time.monotonic() - started < 10, "head /health still 200 10 s after the worker died"
        time.sleep(0.2)
    assert head.wait_exit(30) != 0
    assert "stopped responding" in head.log() or "exited" in head.log() or "closed" in head.log()


def test_expert_parallel_moe_over_two_hosts_equals_one_process(two_hosts, tiny_model_factory, nodes, tmp_path):
    """A Mixtral of 2 layers and 4 experts, TP=2 x PP=2 with --enable-expert-parallel over two hosts: each
    host runs one stage (one MoE layer) and splits its experts over its two ranks, two whole experts each.
    Greedy text equals one process's, and the head's metrics count the routing done on the worker host."""
    model = tiny_model_factory("mixtral")
    llm = LLM(str(model), dtype="float32", kv_cache_memory=0.02)
    expected = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].text
    llm.shutdown()
    extra = ("--tensor-parallel-size", "2", "--enable-expert-parallel")
    master_port = free_port()
    worker = Node(model, tmp_path, 1, two_hosts.head_ip, master_port, two_hosts.worker_ip, two_hosts.exec_prefix(),
                  {"GLOO_SOCKET_IFNAME": two_hosts.worker_ifname}, *extra)
    head = Node(model, tmp_path, 0, two_hosts.head_ip, master_port, "127.0.0.1", None,
                {"GLOO_SOCKET_IFNAME": two_hosts.head_ifname}, *extra)
    nodes += [worker, head]
    head.wait_healthy()
    response = httpx.post(head.url + "/v1/completions", timeout=120, json={
        "model": str(model), "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == expected
    metrics = httpx.get(head.url + "/metrics", timeout=5).text
    counts = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              if line.startswith('pagoda:moe_expert_tokens_total{') and 'layer="1"' in line]
    assert len(counts) == 4 and sum(counts) > 0, metrics[-3000:]


def test_head_alone_times_out_naming_the_missing_rank(model, nodes, tmp_path):
    head = Node(model, tmp_path, 0, "127.0.0.1", free_port(), "127.0.0.1", None, None,
                "--distributed-timeout", "5")
    nodes.append(head)
    assert head.wait_exit(120) != 0
    assert "rank 1 (node 1) never joined" in head.log()


def test_mismatched_settings_fail_fast_naming_the_setting(model, nodes, tmp_path):
    master_port = free_port()
    head = Node(model, tmp_path, 0, "127.0.0.1", master_port, "127.0.0.1", None, None,
                "--distributed-timeout", "60")
    worker = Node(model, tmp_path, 1, "127.0.0.1", master_port, "127.0.0.1", None, None,
                  "--distributed-timeout", "60", "--tensor-parallel-size", "2")
    nodes += [head, worker]
    assert head.wait_exit(30) != 0
    assert worker.wait_exit(30) != 0
    for node in (head, worker):
        assert "tensor_parallel_size=2" in node.log() and "the head has tensor_parallel_size=1" in node.log()


@pytest.mark.heavy  # make test: TP x PP in test_parallel_llm, pagoda serve over a group in the two-host test
def test_pagoda_serve_with_tp2_and_pp2_on_one_machine(model, expected_text, nodes, tmp_path):
    server = Node(model, tmp_path, 0, "127.0.0.1", 29500, "127.0.0.1", None, None,
                  "--nnodes", "1", "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2")
    nodes.append(server)
    server.wait_healthy()
    response = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": str(model), "prompt": [PROMPT, PROMPT], "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    assert [c["text"] for c in response.json()["choices"]] == [expected_text, expected_text]
    server.stop()
    assert server.process.returncode == 0
