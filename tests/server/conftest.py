"""Fixtures: live `pagoda serve` processes on a tiny random Llama, for the openai client and httpx."""

import pytest
from live_server import LiveServer, start_server


@pytest.fixture(scope="module")
def server_factory(tiny_llama_dir, tmp_path_factory):
    started: list[LiveServer] = []

    def start(*flags: str, model=None, **kwargs) -> LiveServer:
        """model: a checkpoint directory other than the tiny Llama."""
        server = start_server(model or tiny_llama_dir, tmp_path_factory.mktemp("serve"), *flags, **kwargs)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
