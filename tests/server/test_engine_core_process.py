"""The engine core in its own process (engine/core_proc.py): the server's child runs the model, the server
streams; stop strings found by the server free the core's blocks; the core's death is a 500 for the
request in flight and /health 503 at once, never a hang. PAGODA_ENABLE_ENGINE_CORE_PROCESS=1 turns it on
(on a CPU it is off by default); 0 keeps the engine in the server process."""

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from live_server import PATCHED_LAUNCHER

pytestmark = pytest.mark.server

MODEL = "tiny"


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # that thread ended meanwhile
            pass
    return found


def engine_core_pid(server) -> int | None:
    """The server's child that runs the engine core (spawned: its command line says so)."""
    for pid in children(server.process.pid):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"multiprocessing.spawn" in cmdline and b"resource_tracker" not in cmdline:
            return pid
    return None


def metric(server, name: str) -> float:
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    return float(next(line for line in metrics.splitlines() if line.startswith(name)).split()[-1])


@pytest.fixture(scope="module")
def server(server_factory):
    """Steps of 10 ms or more (the tiny model's own take ~0.3 ms): a long request stays in flight for seconds.
    The hook is patched_serve's, in the core process (spawn runs the launcher's top level there too)."""
    return server_factory("--served-model-name", MODEL, launcher=PATCHED_LAUNCHER,
                          env={"TEST_SERVE_STEP_DELAY": "0.01", "PAGODA_ENABLE_ENGINE_CORE_PROCESS": "1"})


def test_the_engine_core_runs_in_a_child_process_and_stop_strings_free_its_blocks(server):
    assert engine_core_pid(server) is not None
    client = server.client("none", timeout=60)
    free = client.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=0.0,
                                     extra_body={"ignore_eos": True})
    text = free.choices[0].text
    stop = text[3:5]  # two characters inside the text: the server finds them, the core stops the sequence
    assert len(stop) == 2, text
    stopped = client.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=0.0, stop=[stop],
                                        extra_body={"ignore_eos": True})
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop" and choice.text == text[: text.index(stop)]
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=12, temperature=0.0, stop=[stop], stream=True,
        extra_body={"ignore_eos": True}))
    assert streamed == choice.text
    # the final output came once the core had freed the sequence's blocks; the core's stats cross too
    assert metric(server, "pagoda:kv_cache_used_blocks") == 0.0
    assert metric(server, "pagoda:engine_steps_total") >= 12  # the first request alone ran 12 steps


def test_async_scheduling_in_the_core_process_streams_the_same_text(server, server_factory):
    """--async-scheduling: the core schedules a step while the one before runs (the runner on its own thread);
    the server's answers, stop strings and streams included, are the synchronous core's."""
    fast = server_factory("--served-model-name", MODEL, "--async-scheduling",
                          env={"PAGODA_ENABLE_ENGINE_CORE_PROCESS": "1"})
    asks = [dict(prompt="Hello", max_tokens=12, temperature=0.0, extra_body={"ignore_eos": True}),
            dict(prompt="Paris is", max_tokens=9, temperature=1.0, seed=4, stop=["e"],
                 extra_body={"ignore_eos": True})]
    for ask in asks:
        want = server.client("none", timeout=60).completions.create(model=MODEL, **ask).choices[0]
        got = fast.client("none", timeout=60).completions.create(model=MODEL, **ask).choices[0]
        streamed = "".join(chunk.choices[0].text for chunk in fast.client("none", timeout=60).completions.create(
            model=MODEL, stream=True, **ask))
        assert (got.text, got.finish_reason) == (want.text, want.finish_reason) and streamed == want.text
    assert metric(fast, "pagoda:kv_cache_used_blocks") == 0.0
    assert metric(fast, "pagoda:engine_steps_total") >= 12


def test_a_priority_needs_the_priority_policy(server):
    with pytest.raises(openai.BadRequestError) as refused:
        server.client("none", timeout=60).completions.create(model=MODEL, prompt="Hello", max_tokens=2,
                                                             extra_body={"priority": 3})
    error = refused.value.response.json()["error"]
    assert error["param"] == "priority" and "--scheduling-policy priority" in error["message"]


def test_killing_the_engine_core_is_a_500_and_health_503_not_a_hang(server):
    core = engine_core_pid(server)
    client = server.client("none", timeout=60)
    outcome: dict = {}
    streaming = threading.Event()

    def streamed() -> None:
        try:
            for _ in client.completions.create(model=MODEL, prompt="Hello", max_tokens=400, stream=True,
                                               extra_body={"ignore_eos": True}):
                streaming.set()
            outcome["stream"] = "finished"
        except openai.APIError as e:
            outcome["stream"] = e
        finally:
            streaming.set()

    def whole() -> None:
        try:
            client.completions.create(model=MODEL, prompt="Hello", max_tokens=400, extra_body={"ignore_eos": True})
            outcome["whole"] = "finished"
        except openai.APIStatusError as e:
            outcome["whole"] = e

    threads = [threading.Thread(target=streamed), threading.Thread(target=whole)]
    for thread in threads:
        thread.start()
    assert streaming.wait(60)
    deadline = time.monotonic() + 60
    while metric(server, "pagoda:num_requests_running") < 2:  # both are in the core
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(core, signal.SIGKILL)
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive()
    # the stream under way ends with an error event; the request not yet answered gets a 500
    assert isinstance(outcome["stream"], openai.APIError) and "engine" in str(outcome["stream"]), outcome
    whole_error = outcome["whole"]
    assert isinstance(whole_error, openai.APIStatusError), outcome
    assert whole_error.status_code == 500 and whole_error.response.json()["error"]["code"] == "engine_dead"
    health = httpx.get(server.url + "/health", timeout=10)
    assert health.status_code == 503 and "not running" in health.json()["error"]["message"]
    with pytest.raises(openai.APIStatusError) as refused:  # new requests: 503 until the server is restarted
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    assert refused.value.status_code == 503


def test_the_switch_keeps_the_engine_in_the_server_process(server_factory):
    # with the latency target and the priority policy, which the in-process engine honours alike
    server = server_factory("--served-model-name", MODEL, "--target-itl-ms", "50", "--scheduling-policy", "priority",
                            env={"PAGODA_ENABLE_ENGINE_CORE_PROCESS": "0"})
    assert engine_core_pid(server) is None
    client = server.client("none", timeout=60)
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, extra_body={"ignore_eos": True,
                                                                                          "priority": -1})
    assert out.usage.completion_tokens == 3
    assert metric(server, "pagoda:engine_steps_total") >= 3  # the engine's step timer

