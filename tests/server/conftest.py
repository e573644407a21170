"""Fixtures: live `pagoda serve` processes on a tiny random Llama, for the openai client and httpx."""

import pytest
from live_server import API_KEY, LiveServer, start_server
from thinking_checkpoint import MAX_STORED_RESPONSES, SERVED_NAME, write_thinking_model


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


@pytest.fixture(scope="session")
def thinking_dir(tmp_path_factory):
    return write_thinking_model(tmp_path_factory.mktemp("thinker"))


@pytest.fixture(scope="session")
def thinking_server(thinking_dir, tmp_path_factory):
    """One `pagoda serve` of the checkpoint that thinks, shared by the reasoning, Responses and Messages
    tests: the qwen3 reasoning parser, hermes tool calls for tool_choice auto, and an API key (Anthropic's
    clients send it as x-api-key)."""
    server = start_server(thinking_dir, tmp_path_factory.mktemp("serve"), "--served-model-name", SERVED_NAME,
                          "--reasoning-parser", "qwen3", "--enable-reasoning", "--enable-auto-tool-choice",
                          "--tool-call-parser", "hermes", "--max-stored-responses", str(MAX_STORED_RESPONSES),
                          env={"PAGODA_API_KEY": API_KEY})
    yield server
    server.stop()
