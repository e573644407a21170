"""vLLM's admission limits and stream pacing on a live `pagoda serve`: --max-num-queued-reqs and
--max-num-queued-tokens (503, so a client or router retries elsewhere), --stream-interval."""

import contextlib
import json
import os
import subprocess
import sys
import time

import httpx
import pytest
from live_server import PATCHED_LAUNCHER
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.server

QUEUED_REQS = 4
QUEUED_TOKENS = 8
LONG_PROMPT = [5] * 20  # token ids: a prompt longer than --max-num-queued-tokens by itself
# 480 tokens at >= 10 ms a step: in flight for seconds, long past what a test does meanwhile (they are aborted)
HOLD = {"max_tokens": 480, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def limited(server_factory):
    """Two running sequences at most, so that a request with n=2 keeps the next ones waiting (no token yet),
    and vLLM's two limits. Steps take 10 ms or more (the tiny model's own take ~0.3 ms)."""
    server = server_factory("--max-num-seqs", "2", "--max-num-queued-reqs", str(QUEUED_REQS),
                            "--max-num-queued-tokens", str(QUEUED_TOKENS), "--metrics-vllm-names",
                            launcher=PATCHED_LAUNCHER,
                            env={"TEST_SERVE_STEP_DELAY": "0.01"})
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def first_event(response: httpx.Response) -> None:
    """Waits for a stream's first data event (with completions, the first token's chunk). The rest of its
    lines stay on the response: a line iterator collected would close the stream."""
    response.lines_left = response.iter_lines()
    next(line for line in response.lines_left if line.startswith("data: {"))


def admitted_eventually(http: httpx.Client, stream: bool = False, deadline_s: float = 20.0) -> httpx.Response:
    """A short request (or, stream: a long one, its response open), again until it is not refused with 503: a
    stream the client left is aborted when the server sees the disconnect, a moment later."""
    body = {"prompt": "Hi", **HOLD} if stream else {"prompt": "Hi", "max_tokens": 2}
    deadline = time.monotonic() + deadline_s
    while True:
        r = http.send(http.build_request("POST", "/v1/completions", json=body), stream=stream)
        if r.status_code != 503:
            return r
        r.close()
        assert time.monotonic() < deadline, "still refused"
        time.sleep(0.05)


def rejections(http: httpx.Client) -> dict[tuple[str, str], float]:
    """(metric prefix, reason) -> the 503s counted at that limit so far, from /metrics, under both names."""
    text = http.get("/metrics").text
    return {(s.name.split(":")[0], s.labels["reason"]): s.value for family in text_string_to_metric_families(text)
            if family.name in ("pagoda:admission_rejections", "vllm:admission_rejections")
            for s in family.samples if s.name.endswith("_total")}


def test_each_limit_counts_its_503s_in_the_metrics(limited):
    """vLLM's vllm:admission_rejections: each refusal counted under the limit it met, each reason exported
    before its first; a 400 (a request that could never fit) is not a rejection at a queue limit."""
    before = rejections(limited)
    assert set(before) == {(p, r) for p in ("pagoda", "vllm")
                           for r in ("max_num_queued_reqs", "max_num_queued_tokens")}
    with contextlib.ExitStack() as streams:
        running = streams.enter_context(limited.stream("POST", "/v1/completions", json={"prompt": "Hi", "n": 2, **HOLD}))
        first_event(running)
        with limited.stream("POST", "/v1/completions", json={"prompt": LONG_PROMPT, **HOLD}) as waiting:
            assert waiting.status_code == 200
            # the backlog is over --max-num-queued-tokens; three sequences are in flight, so one more with n=2
            # meets --max-num-queued-reqs first
            assert_busy(limited.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "n": 2}),
                        "--max-num-queued-reqs")
            for _ in range(2):
                assert_busy(limited.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}),
                            "--max-num-queued-tokens")
            assert limited.post("/v1/completions", json={"prompt": ["a"] * 5, "max_tokens": 2}).status_code == 400
            after = rejections(limited)
    for prefix in ("pagoda", "vllm"):
        assert after[prefix, "max_num_queued_reqs"] - before[prefix, "max_num_queued_reqs"] == 1
        assert after[prefix, "max_num_queued_tokens"] - before[prefix, "max_num_queued_tokens"] == 2
    admitted_eventually(limited)


def assert_busy(r: httpx.Response, flag: str) -> None:
    assert r.status_code == 503, r.text
    assert int(r.headers["retry-after"]) >= 1
    error = r.json()["error"]
    assert error["type"] == "service_unavailable" and flag in error["message"]
    assert "try again later or on a different instance" in error["message"]  # vLLM's words


def test_requests_beyond_max_num_queued_reqs_get_503(limited):
    with contextlib.ExitStack() as streams:
        # n=2 runs two sequences and counts two, as vLLM's child requests: with the next, four in flight
        running = streams.enter_context(limited.stream("POST", "/v1/completions", json={"prompt": "Hi", "n": 2, **HOLD}))
        assert running.status_code == 200
        first_event(running)
        waiting = streams.enter_context(limited.stream("POST", "/v1/completions", json={"prompt": "Hi", "n": 2, **HOLD}))
        assert waiting.status_code == 200
        assert_busy(limited.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}), "--max-num-queued-reqs")
        assert_busy(limited.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                               "max_tokens": 2}), "--max-num-queued-reqs")
    # a request that could never fit is a 400, not a 503 to retry forever
    r = limited.post("/v1/completions", json={"prompt": ["a", "b", "c", "d", "e"], "max_tokens": 2})
    assert r.status_code == 400 and "--max-num-queued-reqs" in r.json()["error"]["message"]
    # the two streams were left: their places come back and requests are admitted again
    assert admitted_eventually(limited).status_code == 200


def test_prompt_tokens_before_their_first_token_bound_admission(limited):
    def refused() -> None:
        assert_busy(limited.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}), "--max-num-queued-tokens")

    with contextlib.ExitStack() as streams:
        # two sequences take both running places: the requests after it wait, before their prefill
        running = streams.enter_context(limited.stream("POST", "/v1/completions", json={"prompt": "Hi", "n": 2, **HOLD}))
        assert running.status_code == 200
        first_event(running)  # its own prompt's share is given back at its first token
        # a prompt longer than the limit is admitted while the backlog is under it (as vLLM's): never refused
        # forever; then it holds the backlog over the limit
        with limited.stream("POST", "/v1/completions", json={"prompt": LONG_PROMPT, **HOLD}) as waiting:
            assert waiting.status_code == 200
            refused()
        # that client left before its first token: its share comes back
        left = admitted_eventually(limited, stream=True)
        assert left.status_code == 200
        left.close()
        prefilling = streams.enter_context(limited.stream("POST", "/v1/completions",
                                                          json={"prompt": LONG_PROMPT, **HOLD}))
        assert prefilling.status_code == 200
        refused()
        running.close()  # its places go to the waiting request, which starts decoding
        first_event(prefilling)
        # its first token is out, its share given back: a request is admitted while it decodes
        r = limited.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
    assert admitted_eventually(limited).status_code == 200


def test_embeddings_and_failed_requests_give_their_share_back(limited):
    """An embedding never makes a token: its share goes back when it finishes; a request that fails inside
    the engine (the patched server's FAIL_REQUEST) gives its share back too."""
    r = limited.post("/v1/embeddings", json={"input": [LONG_PROMPT, LONG_PROMPT]})
    assert r.status_code == 200, r.text
    r = limited.post("/v1/completions", json={"prompt": "FAIL_REQUEST " * 10, "max_tokens": 2})
    assert r.status_code == 500, r.text
    # either would have left the backlog over the limit
    r = limited.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200, r.text


# --- --stream-interval --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def paced(server_factory):
    """--stream-interval 4; steps take 10 ms, so the client keeps up (a client that falls behind gets the
    tokens that waited in one chunk, whatever the interval)."""
    server = server_factory("--stream-interval", "4", launcher=PATCHED_LAUNCHER, env={"TEST_SERVE_STEP_DELAY": "0.01"})
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def stream_events(http: httpx.Client, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def chunk_sizes(sizes: list[int], total: int) -> None:
    """vLLM's pacing at 4: the first token at once, then 4 at a time, the rest (fewer) at the end."""
    assert sum(sizes) == total and sizes[0] == 1, sizes
    assert all(s >= 4 for s in sizes[1:-1]) and len(sizes) <= 1 + -(-(total - 1) // 4), sizes


def test_stream_interval_sends_chunks_of_n_tokens(paced):
    body = {"prompt": "Hello, my name is", "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    whole = paced.post("/v1/completions", json=body).json()["choices"][0]
    events = stream_events(paced, "/v1/completions", {**body, "logprobs": 0, "n": 2,
                                                      "stream_options": {"include_usage": True}})
    for index in (0, 1):  # each choice paced on its own
        chunks = [c for e in events for c in e["choices"] if c["index"] == index]
        chunk_sizes([len(c["logprobs"]["tokens"]) for c in chunks], 10)
        assert "".join(c["text"] for c in chunks) == whole["text"]
        assert chunks[-1]["finish_reason"] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 20

    messages = [{"role": "user", "content": "Hi"}]
    chat = {"messages": messages, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    whole = paced.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]
    chunks = [e["choices"][0] for e in stream_events(paced, "/v1/chat/completions", {**chat, "logprobs": True})]
    assert chunks[0]["delta"]["role"] == "assistant"
    chunk_sizes([len(c["logprobs"]["content"]) for c in chunks[1:]], 10)
    assert "".join(c["delta"].get("content") or "" for c in chunks) == whole


@pytest.mark.parametrize("argv, flag", [
    (["--max-num-queued-reqs", "-1"], "--max-num-queued-reqs"),
    (["--max-num-queued-tokens", "many"], "--max-num-queued-tokens"),
    (["--max-num-queued-tokens", "1.5K"], "--max-num-queued-tokens"),
    (["--stream-interval", "0"], "--stream-interval"),
    (["--stream-interval", "2.5"], "--stream-interval"),
])
def test_bad_values_are_cli_errors(tiny_llama_dir, argv, flag):
    r = subprocess.run([sys.executable, "-m", "pagoda.entrypoints.cli", "serve", str(tiny_llama_dir), *argv],
                       capture_output=True, text=True, timeout=120, env=os.environ)
    assert r.returncode == 2
    assert flag in r.stderr and "Traceback" not in r.stderr


def test_the_start_up_log_names_the_limits_set():
    """What bounds a server beside max_num_seqs, in its start-up log: the knobs set, and only those."""
    from pagoda.config import SchedulerConfig
    from pagoda.entrypoints.openai.api_server import limits_set
    from pagoda.entrypoints.openai.cli_args import ServerArgs

    scheduler = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, enable_chunked_prefill=True,
                                max_model_len=2048)
    assert limits_set(scheduler, ServerArgs()) == []
    scheduler = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, enable_chunked_prefill=True,
                                max_model_len=2048, watermark=0.1, reserve_full_isl=False)
    assert limits_set(scheduler, ServerArgs(max_num_queued_tokens=32768, stream_interval=4)) == [
        "watermark=0.1", "reserve_full_isl=False", "max_num_queued_tokens=32768", "stream_interval=4"]
