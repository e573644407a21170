"""Start and stop live `pagoda serve` processes on loopback ports."""

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

HERE = Path(__file__).parent
START_TIMEOUT = 180.0
API_KEY = "sk-pagoda-test"
TINY_SERVER_FLAGS = ["--kv-cache-memory", "0.02", "--log-level", "warning"]
# `pagoda serve` with test hooks (a slow load, an engine that can be made to fail): see patched_serve.py
PATCHED_LAUNCHER = [sys.executable, str(Path(__file__).parent / "patched_serve.py")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def same_connection_after_idle(port: int, idle_seconds: float, path: str = "/health", body: dict | None = None,
                               headers: dict | None = None) -> int:
    """A request on one keep-alive connection, then another on it after `idle_seconds` idle: the second's status.
    Raises if the server closed the connection meanwhile (http.client reconnects only once its socket is gone)."""
    import http.client
    import json

    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request("GET", "/health")
        connection.getresponse().read()
        first_socket = connection.sock
        time.sleep(idle_seconds)
        connection.request("POST" if body is not None else "GET", path,
                           body=json.dumps(body) if body is not None else None,
                           headers={"Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()
        response.read()
        assert connection.sock is first_socket
        return response.status
    finally:
        connection.close()


@dataclass
class LiveServer:
    process: subprocess.Popen
    port: int
    log_path: Path
    statuses_while_starting: list[int] = field(default_factory=list)
    v1_statuses_while_starting: list[int] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, api_key: str, timeout: float, asynchronous: bool = False):
        """The official openai client for this server, without retries (a test sees the first answer)."""
        import openai

        client_class = openai.AsyncOpenAI if asynchronous else openai.OpenAI
        return client_class(base_url=self.url + "/v1", api_key=api_key, timeout=timeout, max_retries=0)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"pagoda serve exited with {self.process.returncode}:\n{self.log()}")
            try:
                status = httpx.get(self.url + "/health", timeout=2).status_code
            except httpx.TransportError:
                status = 0
            self.statuses_while_starting.append(status)
            if status == 503:
                try:  # a loaded machine can time this one out too: then the next round asks again
                    self.v1_statuses_while_starting.append(httpx.get(self.url + "/v1/models", timeout=2).status_code)
                except httpx.TransportError:
                    pass
            if status == 200:
                return
            time.sleep(0.2)
        raise TimeoutError(f"pagoda serve not ready after {START_TIMEOUT}s:\n{self.log()}")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        return self.process.returncode


def start_server(model: Path, tmp_path: Path, *flags: str, env: dict | None = None,
                 launcher: list[str] | None = None, wait: bool = True) -> LiveServer:
    port = free_port()
    log_path = tmp_path / f"serve-{port}.log"
    command = (launcher or [str(Path(sys.executable).parent / "pagoda")]) + [
        "serve", str(model), "--host", "127.0.0.1", "--port", str(port), *TINY_SERVER_FLAGS, *flags]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})})
    server = LiveServer(process, port, log_path)
    if wait:
        try:
            server.wait_ready()
        except BaseException:
            server.stop()
            raise
    return server
