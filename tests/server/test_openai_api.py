"""The official openai client (sync and async) and httpx against one live `pagoda serve`."""

import asyncio
import time

import httpx
import openai
import pytest
from live_server import API_KEY, PATCHED_LAUNCHER
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.server

MODEL = "tiny"
PROMPT = "Hello, my name is"
LONG = {"max_tokens": 400, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server(server_factory):
    # the API key from the environment, the model name from a flag that beats the environment
    return server_factory("--served-model-name", MODEL,
                          env={"PAGODA_API_KEY": API_KEY, "PAGODA_SERVED_MODEL_NAME": "loses-to-the-flag"})


@pytest.fixture(scope="module")
def slow_http(server_factory):
    """A server whose steps take 10 ms (the patched launcher): a 400-token request stays in flight for 4 s,
    where the tiny model's takes ~0.2 s, so a test can disconnect before it ends."""
    server = server_factory("--served-model-name", MODEL, launcher=PATCHED_LAUNCHER,
                            env={"PAGODA_API_KEY": API_KEY, "TEST_SERVE_STEP_DELAY": "0.01"})
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    return server.client(API_KEY, timeout=60)


@pytest.fixture
def async_client(server):
    return server.client(API_KEY, timeout=120, asynchronous=True)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c


def metrics(http) -> dict[str, float]:
    """Samples by name (+ sorted labels other than model_name and engine), parsed by prometheus_client; the
    data-parallel ranks' series (label engine, vLLM's) summed."""
    text = http.get("/metrics").text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "engine"))
            key = s.name + (f"{{{labels}}}" if labels else "")
            values[key] = values.get(key, 0.0) + s.value
    return values


def wait_idle(http, timeout: float = 20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(http)
        idle = m["pagoda:num_requests_running"] == 0 and m["pagoda:num_requests_waiting"] == 0
        if idle and m["pagoda:kv_cache_used_blocks"] == 0:
            return m
        assert time.monotonic() < deadline, f"requests or blocks still held: {m}"
        time.sleep(0.1)


# --- start-up, discovery ---------------------------------------------------------------------------

def test_health_is_200_when_ready(http):
    assert http.get("/health").status_code == 200


def test_models_and_version(client, http):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    assert http.get("/version").json()["version"]


def test_tokenize_detokenize_roundtrip(http):
    tokens = http.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == 512
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == PROMPT
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > 3


# --- completions ----------------------------------------------------------------------------------

def test_completion_fields_and_usage(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == MODEL and r.created > 0
    assert len(r.choices) == 1 and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streamed_text_equals_non_streamed_under_greedy(client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_a_token_whose_text_is_held_back_still_gets_its_chunk(slow_http, tiny_llama_dir):
    """As vLLM's, a stream sends a chunk for the tokens of each step, with empty text while their text is held back
    (here every token is the byte 0xC3, which opens a two-byte character): clients such as `vllm bench serve` time
    the tokens by their chunks. A consumer that falls behind gets a later step's tokens in one chunk (as vLLM's), so
    the tokens are counted by their logprobs; the steps take 10 ms here, so that it keeps up."""
    import json

    from transformers import AutoTokenizer

    lead_byte = AutoTokenizer.from_pretrained(tiny_llama_dir).convert_tokens_to_ids("\u00c3")  # byte-level 0xC3
    body = dict(model=MODEL, max_tokens=6, temperature=0, logit_bias={str(lead_byte): 100}, stream=True,
                ignore_eos=True)

    def chunks(path: str, **extra) -> list[dict]:
        with slow_http.stream("POST", path, json={**body, **extra}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        return [e["choices"][0] for e in events if e.get("choices")]

    text = chunks("/v1/completions", prompt=PROMPT, logprobs=1)
    assert sum(len(c["logprobs"]["tokens"]) for c in text) == 6
    assert len(text) > 1 and [c["text"] for c in text[:-1]] == [""] * (len(text) - 1)  # before: the last only
    chat = chunks("/v1/chat/completions", messages=MESSAGES, logprobs=True)[1:]  # after the role's
    assert sum(len(c["logprobs"]["content"]) for c in chat) == 6
    assert len(chat) > 1 and [c["delta"]["content"] for c in chat[:-1]] == [""] * (len(chat) - 1)


def test_stream_interval_default_and_per_request(slow_http):
    """--stream-interval's default, 1: a chunk per token. vLLM's request field stream_interval asks for
    chunks of that many (the first token at once, the rest at the end), the same text."""
    import json

    body = dict(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, ignore_eos=True, logprobs=0, stream=True)

    def chunks(**extra) -> list[dict]:
        with slow_http.stream("POST", "/v1/completions", json={**body, **extra}) as r:
            assert r.status_code == 200
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        return [e["choices"][0] for e in events if e.get("choices")]

    each, paced = chunks(), chunks(stream_interval=4)
    assert len(each) > 4  # 10 chunks while the client keeps up; paced by 4: 4 chunks at most
    sizes = [len(c["logprobs"]["tokens"]) for c in paced]
    assert sum(sizes) == 10 and sizes[0] == 1 and all(s >= 4 for s in sizes[1:-1]) and len(sizes) <= 4, sizes
    assert "".join(c["text"] for c in paced) == "".join(c["text"] for c in each)
    assert slow_http.post("/v1/completions", json={**body, "stream_interval": 0}).status_code == 400


def test_token_id_and_batched_prompts(client):
    r = client.completions.create(model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=3, temperature=0, n=2)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 5


def test_n_choices_differ_with_sampling(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, n=3, temperature=1.0, seed=1,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert len({c.text for c in r.choices}) > 1
    assert r.usage.completion_tokens == 36


def test_seed_makes_sampling_reproducible(client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=7)
    assert client.completions.create(**kwargs).choices[0].text == client.completions.create(**kwargs).choices[0].text


def test_stop_string_cuts_the_text(client):
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[6:9]
    assert stop and base.index(stop) >= 1
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == base[: base.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_completion_logprobs_and_echo(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(v <= 0 for v in lp.token_logprobs)
    # greedy: the chosen token is the most likely one
    assert all(max(top.values()) == pytest.approx(chosen) for top, chosen in zip(lp.top_logprobs, lp.token_logprobs, strict=True))
    assert "".join(lp.tokens) == r.choices[0].text
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + r.choices[0].text


def test_vllm_sampling_extras_are_accepted(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0.8, presence_penalty=0.5,
                                  frequency_penalty=0.5, user="u1",
                                  extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1,
                                              "min_tokens": 6, "ignore_eos": False, "stop_token_ids": [3]})
    assert r.usage.completion_tokens == 6


# --- chat -----------------------------------------------------------------------------------------

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": " hi"}]},
            {"role": "assistant", "content": "hi"},
            {"role": "user", "content": "again"}]


def test_chat_streaming_matches_non_streaming(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_completion_tokens=20, temperature=0)
    full = client.chat.completions.create(**kwargs)
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    assert full.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == full.choices[0].finish_reason and not any(finishes[:-1])
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_chat_n_and_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, n=2, temperature=0,
                                       logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    for choice in r.choices:
        content = choice.logprobs.content
        assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
        assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)
    assert r.usage.completion_tokens == 8


# --- errors ---------------------------------------------------------------------------------------

def _error(exc_info) -> dict:
    return exc_info.value.response.json()["error"]


def test_invalid_field_is_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, top_p=1.5)
    assert _error(e)["param"] == "top_p" and "top_p" in _error(e)["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=-1)
    assert _error(e)["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], logprobs=True,
                                       top_logprobs=50)
    assert _error(e)["param"] == "top_logprobs"


def test_too_long_is_400_with_both_numbers(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=600)
    message = _error(e)["message"]
    assert "512" in message and "600" in message


def test_malformed_json_and_missing_field_are_400(http):
    r = http.post("/v1/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = http.post("/v1/completions", json={"max_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    assert _error(e)["code"] == "model_not_found"


def test_api_key_is_required_on_v1(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200  # probes need no key


# --- metrics, concurrency, disconnects ------------------------------------------------------------

def test_metrics_parse_and_count(client, http):
    before = metrics(http)
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    after = metrics(http)
    assert after["pagoda:generation_tokens_total"] - before["pagoda:generation_tokens_total"] == 5
    assert after["pagoda:prompt_tokens_total"] > before["pagoda:prompt_tokens_total"]
    assert after["pagoda:prefix_cache_queries_total"] >= before["pagoda:prefix_cache_queries_total"]
    assert (after["pagoda:request_success_total{finished_reason=length}"]
            == before["pagoda:request_success_total{finished_reason=length}"] + 1)
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert after[f"pagoda:{name}_count"] == before[f"pagoda:{name}_count"] + 1
    assert after["pagoda:inter_token_latency_seconds_count"] - before["pagoda:inter_token_latency_seconds_count"] == 4
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total",
                  "prefix_cache_hits_total", "prefix_cache_evicted_blocks_total"):
        assert f"pagoda:{gauge}" in after


async def test_async_client_200_concurrent_streams(async_client, http):
    async def one(i: int) -> str:
        stream = await async_client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"request {i}"}], max_tokens=8, temperature=0,
            stream=True, extra_body={"ignore_eos": True})
        pieces, reasons = [], []
        async for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
                reasons.append(chunk.choices[0].finish_reason)
        assert reasons[-1] == "length"
        return "".join(pieces)

    texts = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(200))), timeout=240)
    assert len(texts) == 200 and all(texts)
    await asyncio.to_thread(wait_idle, http)


async def test_async_completion(async_client):
    r = await async_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert r.choices[0].text


def test_disconnect_aborts_streaming_request(slow_http):
    body = {"model": MODEL, "prompt": PROMPT, "stream": True, "max_tokens": 400, "ignore_eos": True}
    with slow_http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert metrics(slow_http)["pagoda:num_requests_running"] == 1
    m = wait_idle(slow_http)
    assert m["pagoda:request_success_total{finished_reason=abort}"] >= 1


def test_disconnect_aborts_non_streaming_request(slow_http):
    aborted = metrics(slow_http)["pagoda:request_success_total{finished_reason=abort}"]
    # the client gives up long before the 480 tokens are done (4.8 s)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 480, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        slow_http.post("/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.05))
    # the engine may not have seen the request yet when the client gives up: wait for the abort, then idle
    deadline = time.monotonic() + 20
    while metrics(slow_http)["pagoda:request_success_total{finished_reason=abort}"] == aborted:
        assert time.monotonic() < deadline, "the abandoned request was never aborted"
        time.sleep(0.05)
    m = wait_idle(slow_http)
    assert m["pagoda:request_success_total{finished_reason=abort}"] == aborted + 1


def test_bench_serve_reports_every_request(server, tmp_path):
    import json

    from pagoda.bench.serve import main as bench_main

    out = tmp_path / "bench.json"
    argv = ["--base-url", server.url, "--api-key", API_KEY, "--num-prompts", "12", "--max-concurrency", "4",
            "--input-len", "32", "--output-len", "8", "--range-ratio", "0.5", "--warmup", "1",
            "--result-json", str(out)]
    assert bench_main(argv) == 0
    summary = json.loads(out.read_text())
    assert summary["completed"] == 12 and summary["failed"] == 0 and summary["total_output_tokens"] >= 12 * 4
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert 0 < summary[key]["median"] <= summary[key]["p90"] <= summary[key]["p99"]
    assert summary["preemptions"] >= 0  # read from the server's /metrics before and after
    # Poisson arrivals and a JSONL dataset, through chat
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "Hello there"}\n{"messages": [{"role": "user", "content": "Hi"}], "output_len": 3}\n')
    argv = ["--base-url", server.url, "--api-key", API_KEY, "--dataset", "jsonl", "--dataset-path", str(data),
            "--request-rate", "20", "--output-len", "4", "--warmup", "0", "--result-json", str(out)]
    assert bench_main(argv) == 0
    assert json.loads(out.read_text())["total_output_tokens"] == 7
