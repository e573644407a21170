"""Start and stop live `pagoda serve` replicas and `pagoda router` processes on loopback ports."""

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from live_server import API_KEY, PATCHED_LAUNCHER, LiveServer, free_port

MODEL = "tiny"
STEP_DELAY = "0.01"  # 10 ms steps: a 400-token request stays in flight for ~4 s (the tiny model's takes 0.2 s)


def start_replica(model: Path, log_dir: Path, port: int | None = None, *flags: str,
                  kv_cache_memory: str = "0.02") -> LiveServer:
    port = port or free_port()
    log_path = log_dir / f"serve-{port}.log"
    command = PATCHED_LAUNCHER + ["serve", str(model), "--host", "127.0.0.1", "--port", str(port),
                                  "--served-model-name", MODEL, "--kv-cache-memory", kv_cache_memory,
                                  "--log-level", os.environ.get("TEST_ROUTER_LOG", "warning"), *flags]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PAGODA_API_KEY": API_KEY,
           "TEST_SERVE_STEP_DELAY": STEP_DELAY, "OMP_NUM_THREADS": "1",
           "PAGODA_CPU_KERNELS": "0"}  # the torch path: no C++ build at start-up (routing is what is tested)
    with open(log_path, "ab") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    return LiveServer(process, port, log_path)


@dataclass
class RouterProcess:
    process: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, timeout: float = 60, asynchronous: bool = False):
        import openai

        cls = openai.AsyncOpenAI if asynchronous else openai.OpenAI
        return cls(base_url=self.url + "/v1", api_key=API_KEY, timeout=timeout, max_retries=0)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def metrics(self) -> dict[str, float]:
        return scrape(self.url)

    def healthy_backends(self) -> set[str]:
        head = "pagoda_router:backend_healthy{backend="
        return {name[len(head):-1] for name, value in self.metrics().items()
                if name.startswith(head) and value == 1}

    def wait_ready(self, backends: int, timeout: float = 60) -> None:
        """Until the router answers and `backends` backends are in its rotation."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"pagoda router exited with {self.process.returncode}:\n{self.log()}")
            try:
                if len(self.healthy_backends()) >= backends:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"pagoda router not ready:\n{self.log()}")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        return self.process.returncode


def scrape(url: str) -> dict[str, float]:
    """A server's or router's /metrics: samples by name (+ sorted labels other than model_name and engine),
    the data-parallel ranks' series (label engine) summed."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=5).text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "engine"))
            key = s.name + (f"{{{labels}}}" if labels else "")
            values[key] = values.get(key, 0.0) + s.value
    return values


def start_router(log_dir: Path, *flags: str, env: dict | None = None) -> RouterProcess:
    port = free_port()
    log_path = log_dir / f"router-{port}.log"
    command = [sys.executable, "-m", "pagoda.entrypoints.cli", "router", "--host", "127.0.0.1", "--port",
               str(port), "--log-level", "warning", *flags]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, **(env or {})})
    return RouterProcess(process, port, log_path)
