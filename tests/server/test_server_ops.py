"""The operational surface against live `pagoda serve` processes: CORS, X-Request-Id, cached_tokens, vLLM's
metric families (and their `vllm:` names behind --metrics-vllm-names), and /v1/embeddings vs transformers."""

import json
import re
import threading
import time

import httpx
import openai
import pytest
import torch
from checkpoints import load_hf_reference
from live_server import PATCHED_LAUNCHER, same_connection_after_idle
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

pytestmark = pytest.mark.server

MODEL = "tiny"
ORIGIN = "https://app.example"
# three blocks of 16 tokens and more: a repeat of it finds whole blocks in the prefix cache
LONG_PROMPT = "Paged attention keeps keys and values in fixed-size blocks, so memory is not wasted. " * 4
NEW_FAMILIES = ("request_time_per_output_token_seconds", "request_prompt_tokens", "request_generation_tokens",
                "request_params_n", "request_params_max_tokens", "iteration_tokens_total",
                "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds")


@pytest.fixture(scope="module")
def vllm_server(server_factory):
    """CORS restricted to one origin, every metric also under vllm: names."""
    return server_factory("--served-model-name", MODEL, "--allowed-origins", json.dumps([ORIGIN]),
                          "--allowed-methods", '["GET", "POST"]', "--metrics-vllm-names")


@pytest.fixture(scope="module")
def server(server_factory):
    """Default flags (prefix caching on, CORS open as vLLM's defaults); float32 to compare with transformers."""
    return server_factory("--served-model-name", MODEL, "--dtype", "float32")


@pytest.fixture(scope="module")
def slow_server(server_factory):
    """Steps slowed to 20 ms: a request of 200 tokens stays in flight for 4 s (the tiny model's take 0.2 s)."""
    return server_factory("--served-model-name", MODEL, launcher=PATCHED_LAUNCHER,
                          env={"TEST_SERVE_STEP_DELAY": "0.02"})


@pytest.fixture(scope="module")
def client(server):
    return server.client("unused", timeout=60)


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    return AutoTokenizer.from_pretrained(tiny_llama_dir), load_hf_reference(tiny_llama_dir)


def samples(url: str) -> list:
    families = text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text)
    return [s for family in families for s in family.samples]


def value(url: str, name: str, **labels) -> float:
    found = [s.value for s in samples(url) if s.name == name and labels.items() <= s.labels.items()]
    assert found, f"{name} {labels} not exported"
    return sum(found)


# --- CORS ------------------------------------------------------------------------------------------

def preflight(url: str, origin: str) -> httpx.Response:
    return httpx.options(url + "/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"}, timeout=30)


def test_cors_preflight_allows_the_configured_origin_only(vllm_server):
    ok = preflight(vllm_server.url, ORIGIN)
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == ORIGIN
    assert set(ok.headers["access-control-allow-methods"].replace(" ", "").split(",")) == {"GET", "POST"}
    assert "access-control-allow-credentials" not in ok.headers
    refused = preflight(vllm_server.url, "https://evil.example")
    assert refused.status_code == 400
    assert "access-control-allow-origin" not in refused.headers


def test_cors_defaults_allow_any_origin_and_expose_the_request_id(server):
    assert preflight(server.url, "https://anywhere.example").headers["access-control-allow-origin"] == "*"
    r = httpx.get(server.url + "/v1/models", headers={"Origin": "https://anywhere.example"}, timeout=30)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "*"
    assert r.headers["access-control-expose-headers"].lower() == "x-request-id"


def test_cors_flags_are_checked(tmp_path):
    from pagoda.entrypoints.cli import main

    for bad in ('"*"', "[1]", "not json"):
        with pytest.raises(SystemExit) as exit_info:
            main(["serve", "--allowed-origins", bad])
        assert exit_info.value.code == 2


# --- keep-alive ------------------------------------------------------------------------------------

def test_an_idle_connection_is_kept_past_a_client_pools_idle_time(server):
    # a server that closes an idle connection first races the client's next request on it (aiohttp's pool keeps
    # idle connections 15 s; uvicorn's default closed them at 5): the same connection answers after 6 s idle
    assert same_connection_after_idle(server.port, 6) == 200


# --- X-Request-Id ----------------------------------------------------------------------------------

def test_request_id_is_echoed_and_names_the_response(client):
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="Hello", max_tokens=2,
                                                      extra_headers={"X-Request-Id": "trace-42"})
    assert raw.headers["x-request-id"] == "trace-42"
    assert raw.parse().id == "cmpl-trace-42"
    chat = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        extra_headers={"X-Request-Id": "trace-43"})
    assert chat.headers["x-request-id"] == "trace-43"
    assert chat.parse().id == "chatcmpl-trace-43"


def test_request_id_is_generated_when_absent_on_every_response(client, server):
    first = client.completions.with_raw_response.create(model=MODEL, prompt="Hello", max_tokens=2)
    second = client.completions.with_raw_response.create(model=MODEL, prompt="Hello", max_tokens=2)
    ids = [first.headers["x-request-id"], second.headers["x-request-id"]]
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids) and ids[0] != ids[1]
    assert first.parse().id == f"cmpl-{ids[0]}"
    for path in ("/health", "/metrics", "/v1/models"):
        assert re.fullmatch(r"[0-9a-f]{32}", httpx.get(server.url + path, timeout=30).headers["x-request-id"])
    error = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -1},
                       headers={"X-Request-Id": "bad-1"}, timeout=30)
    assert error.status_code == 400 and error.headers["x-request-id"] == "bad-1"
    streamed = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                                "stream": True},
                          headers={"X-Request-Id": "stream-1"}, timeout=30)
    assert streamed.headers["x-request-id"] == "stream-1"
    assert '"id":"cmpl-stream-1"' in streamed.text


# --- cached tokens ---------------------------------------------------------------------------------

def test_cached_tokens_count_prefix_cache_hits(client):
    first = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < again.usage.prompt_tokens and cached % 16 == 0  # whole blocks, never the last token
    messages = [{"role": "user", "content": LONG_PROMPT}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    stream = list(client.completions.create(model=MODEL, prompt=[LONG_PROMPT, "unrelated"], max_tokens=2,
                                            stream=True, stream_options={"include_usage": True}))
    assert stream[-1].usage.prompt_tokens_details.cached_tokens == cached


# --- metrics ---------------------------------------------------------------------------------------

def test_new_metric_families_are_exported_and_move(client, server):
    before = {name: value(server.url, f"pagoda:{name}_count") for name in NEW_FAMILIES}
    prompt_sum = value(server.url, "pagoda:request_prompt_tokens_sum")
    out = client.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=5, n=2, temperature=1,
                                    extra_body={"ignore_eos": True})
    after = {name: value(server.url, f"pagoda:{name}_count") for name in NEW_FAMILIES}
    for name in NEW_FAMILIES:
        assert after[name] > before[name], name
    assert value(server.url, "pagoda:request_prompt_tokens_sum") - prompt_sum == out.usage.prompt_tokens
    assert value(server.url, "pagoda:request_params_n_bucket", le="1.0") < value(
        server.url, "pagoda:request_params_n_bucket", le="2.0")
    info = [s for s in samples(server.url) if s.name == "pagoda:cache_config_info"]
    assert len(info) == 1 and info[0].value == 1
    assert info[0].labels["block_size"] == "16" and info[0].labels["enable_prefix_caching"] == "True"
    assert not [s for s in samples(server.url) if s.name.startswith("vllm:")]  # without the switch


def test_vllm_names_mirror_every_metric(vllm_server):
    httpx.post(vllm_server.url + "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 3},
               timeout=60).raise_for_status()
    found = samples(vllm_server.url)
    pagoda = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in found if s.name.startswith("pagoda:")}
    vllm = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in found if s.name.startswith("vllm:")}
    for (name, labels), v in pagoda.items():
        twin = ("vllm:" + name.removeprefix("pagoda:"), labels)
        assert twin in vllm, twin
        if "lora_requests_info" not in name and "time" not in name and "latency" not in name:
            assert vllm[twin] == v, twin
    # what the Gateway API Inference Extension and KEDA triggers written for vLLM read
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc", "vllm:lora_requests_info", "vllm:request_success_total",
                 "vllm:time_to_first_token_seconds_bucket"):
        assert any(s.name == name for s in found), name
    waiting = [s for s in found if s.name == "vllm:num_requests_waiting"]
    assert waiting[0].labels == {"model_name": MODEL, "engine": "0"}  # vLLM labels each engine core's series
    lora = [s for s in found if s.name == "vllm:lora_requests_info"][0]
    assert lora.labels == {"max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""}


# --- embeddings ------------------------------------------------------------------------------------

def reference_embedding(hf, text: str | None = None, ids: list[int] | None = None, pooling: str = "last"):
    tokenizer, model = hf
    input_ids = torch.tensor([ids]) if ids is not None else tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        hidden = model.model(input_ids).last_hidden_state[0]  # [tokens, hidden], after the final norm
    vector = hidden[-1] if pooling == "last" else hidden.mean(0)
    return torch.nn.functional.normalize(vector, dim=-1)


def close(got, want) -> bool:
    return torch.allclose(torch.tensor(got, dtype=torch.float32), want, atol=2e-4)


def test_embeddings_match_transformers(client, hf):
    texts = ["Hello, my name is", LONG_PROMPT, "a"]
    out = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert [d.index for d in out.data] == [0, 1, 2]
    for text, d in zip(texts, out.data):
        assert close(d.embedding, reference_embedding(hf, text)), text
    tokenizer = hf[0]
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(len(tokenizer(t).input_ids) for t in texts)
    assert out.id.startswith("embd-")
    # the openai client asks for base64 by default and decodes it
    single = client.embeddings.create(model=MODEL, input="Hello, my name is")
    assert close(single.data[0].embedding, reference_embedding(hf, "Hello, my name is"))
    assert abs(float(torch.tensor(single.data[0].embedding).norm()) - 1) < 1e-4


def test_embeddings_of_token_ids_and_mean_pooling(client, hf):
    ids = [[5, 17, 33, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58]]
    one = client.embeddings.create(model=MODEL, input=ids[0], encoding_format="float")
    assert close(one.data[0].embedding, reference_embedding(hf, ids=ids[0]))
    many = client.embeddings.create(model=MODEL, input=ids, encoding_format="float",
                                    extra_body={"pooling_type": "mean"})
    for row, d in zip(ids, many.data):
        assert close(d.embedding, reference_embedding(hf, ids=row, pooling="mean"))
    raw = client.embeddings.create(model=MODEL, input=ids[0], encoding_format="float",
                                   extra_body={"normalize": False})
    tokenizer, model = hf
    with torch.no_grad():
        want = model.model(torch.tensor([ids[0]])).last_hidden_state[0, -1]
    assert close(raw.data[0].embedding, want)


def test_embeddings_with_generation_in_flight_and_no_blocks_kept(client, server):
    stream = client.completions.create(model=MODEL, prompt="Hello", max_tokens=40, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    for _ in range(3):
        client.embeddings.create(model=MODEL, input=[LONG_PROMPT, "b c d"], encoding_format="float",
                                 extra_body={"pooling_type": "mean"})
    assert sum(1 for _ in stream) > 0
    deadline = time.monotonic() + 20
    while value(server.url, "pagoda:kv_cache_used_blocks") != 0:
        assert time.monotonic() < deadline, "an embedding request kept its KV blocks"
        time.sleep(0.2)


def test_embeddings_errors(client, server, hf):
    hidden = hf[1].config.hidden_size
    assert len(client.embeddings.create(model=MODEL, input="x", dimensions=hidden,
                                        encoding_format="float").data[0].embedding) == hidden
    cases = [
        ({"input": "x", "dimensions": 8}, "dimensions"),
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [10**9]}, "input"),
        ({"input": "word " * 3000}, "input"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "pooling_type": "max"}, "pooling_type"),
    ]
    for body, param in cases:
        r = httpx.post(server.url + "/v1/embeddings", json={"model": MODEL, **body}, timeout=60)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.text)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="x")


def test_a_request_id_in_flight_twice_is_refused(slow_server):
    url = slow_server.url
    first: list[httpx.Response] = []
    long = threading.Thread(target=lambda: first.append(httpx.post(
        url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 200, "ignore_eos": True},
        headers={"X-Request-Id": "twice"}, timeout=120)))
    long.start()
    try:
        deadline = time.monotonic() + 30
        while value(url, "pagoda:num_requests_running") == 0:
            assert time.monotonic() < deadline, "the first request never ran"
            time.sleep(0.05)
        second = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "y", "max_tokens": 2},
                            headers={"X-Request-Id": "twice"}, timeout=60)
        assert second.status_code == 400
        assert "already running" in second.json()["error"]["message"]
    finally:
        long.join()
    assert first[0].status_code == 200 and first[0].json()["usage"]["completion_tokens"] == 200
