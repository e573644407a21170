"""P/D end to end with real processes: two `pagoda serve` (a NIXL producer and a consumer, tiny random Llama)
behind `pagoda router --prefill-backend P --backend D`, driven by the official openai client. Greedy text
equals a plain engine's (the consumer asked directly, without kv_transfer_params, computes the prompt itself),
streamed or not; a short prompt under --pd-threshold skips the prefill; with the prefill server killed,
requests still answer (decode alone) and the router counts the fallback."""

import json
import time

import pytest
from live_router import MODEL, scrape, start_replica, start_router
from live_server import API_KEY, free_port

pytest.importorskip("nixl_cu12")

PROMPTS = ["the quick brown fox jumps over the lazy dog " * 4, "a b c d e f g h i j k l m n o p q r s t u v w x y z"]
CHAT = [{"role": "user", "content": "count the letters: " + "abc " * 12}]
SHORT = "hello world"  # 11 bytes: 2 tokens by llm-d's estimate
THRESHOLD = 10  # PROMPTS[1], the shortest P/D one, is 51 bytes: 12 tokens
MAX_TOKENS = 8
PREFILL_HEADER = "x-pagoda-prefill-backend"


@pytest.fixture(scope="module")
def servers(tiny_llama_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("pd")
    producer = {"kv_connector": "NixlConnector", "kv_role": "kv_producer",
                "kv_connector_extra_config": {"side_channel_port": free_port()}}
    consumer = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}
    # no prefix cache on the consumer: a prompt it computed (the reference) is pulled again, not found here
    started = [start_replica(tiny_llama_dir, log_dir, None, "--kv-transfer-config", json.dumps(producer)),
               start_replica(tiny_llama_dir, log_dir, None, "--kv-transfer-config", json.dumps(consumer),
                             "--no-enable-prefix-caching")]
    try:
        for server in started:
            server.wait_ready()
        yield started
    finally:
        for server in started:
            server.stop()


@pytest.fixture(scope="module")
def router(servers, tmp_path_factory):
    """One router for the module (each test reads its counters' growth): SHORT is under the threshold."""
    prefill, decode = servers
    router = start_router(tmp_path_factory.mktemp("pd-router"), "--prefill-backend", prefill.url, "--backend",
                          decode.url, "--pd-threshold", str(THRESHOLD), env={"PAGODA_API_KEY": API_KEY})
    try:
        router.wait_ready(1)
        deadline = time.monotonic() + 30
        while router.metrics().get(f"pagoda_router:prefill_backend_healthy{{backend={prefill.url}}}") != 1:
            assert time.monotonic() < deadline, router.log()
            time.sleep(0.1)
        yield router
    finally:
        router.stop()


@pytest.fixture(scope="module")
def reference(servers):
    """What a plain engine answers: the consumer, asked directly, with no kv_transfer_params."""
    client = servers[1].client(API_KEY, timeout=120)
    texts = [client.completions.create(model=MODEL, prompt=p, max_tokens=MAX_TOKENS, temperature=0).choices[0].text
             for p in PROMPTS]
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    short = client.completions.create(model=MODEL, prompt=SHORT, max_tokens=MAX_TOKENS, temperature=0)
    return texts, chat.choices[0].message.content, short.choices[0].text


def pd_counts(router) -> dict[str, float]:
    return {k: v for k, v in router.metrics().items() if k.startswith("pagoda_router:pd_") and "_total" in k}


def test_greedy_text_through_prefill_and_decode_equals_a_plain_engine(servers, router, reference):
    prefill, decode = servers
    client = router.client(timeout=120)
    texts, chat_text, _ = reference
    for prompt, expected in zip(PROMPTS, texts):
        raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                                          temperature=0)
        assert raw.headers[PREFILL_HEADER] == prefill.url and raw.headers["x-pagoda-backend"] == decode.url
        assert raw.parse().choices[0].text == expected
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    assert chat.choices[0].message.content == chat_text

    # streamed: the decode's chunks reach the client as they come
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True)
    pieces = [c.choices[0].text for c in stream if c.choices]
    assert len(pieces) > 1 and "".join(pieces) == texts[0]
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat_text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == MAX_TOKENS

    # every one went through the prefill server, none fell back (the test runs first on this router)
    assert pd_counts(router) == {"pagoda_router:pd_requests_total{path=prefill-decode}": 5}
    # the consumer pulled the KV rather than computing the prompt (vLLM's NIXL families, where it has them)
    metrics = scrape(decode.url)
    if "pagoda:nixl_num_recomputed_prompts_total" in metrics:
        assert metrics["pagoda:nixl_num_recomputed_prompts_total"] == 0
        assert metrics["pagoda:nixl_bytes_transferred_count"] >= 5 and metrics["pagoda:nixl_bytes_transferred_sum"] > 0


def test_a_short_prompt_skips_the_prefill(servers, router, reference):
    before = pd_counts(router)
    client = router.client(timeout=120)
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=SHORT, max_tokens=MAX_TOKENS,
                                                      temperature=0)
    assert PREFILL_HEADER not in raw.headers and raw.parse().choices[0].text == reference[2]
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=PROMPTS[1], max_tokens=MAX_TOKENS,
                                                      temperature=0)
    assert raw.headers[PREFILL_HEADER] == servers[0].url and raw.parse().choices[0].text == reference[0][1]
    after = pd_counts(router)
    key = "pagoda_router:pd_requests_total{path=%s}"
    assert after[key % "decode-only"] - before.get(key % "decode-only", 0) == 1
    assert after[key % "prefill-decode"] - before.get(key % "prefill-decode", 0) == 1


def test_with_the_prefill_server_killed_requests_still_answer(servers, router, reference):
    """Last in the module: it kills the producer."""
    prefill = servers[0]
    prefill.process.kill()
    prefill.process.wait(10)
    client = router.client(timeout=120)
    for prompt, expected in zip(PROMPTS, reference[0]):
        raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                                          temperature=0)
        assert PREFILL_HEADER not in raw.headers and raw.parse().choices[0].text == expected
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == reference[0][0]
    counts = pd_counts(router)
    assert counts["pagoda_router:pd_requests_total{path=fallback}"] == 3
    failures = {k: v for k, v in counts.items() if k.startswith("pagoda_router:pd_prefill_failures_total")}
    assert sum(failures.values()) == 3 and set(failures) <= {
        "pagoda_router:pd_prefill_failures_total{reason=connect}",
        "pagoda_router:pd_prefill_failures_total{reason=error}",
        "pagoda_router:pd_prefill_failures_total{reason=no-prefill-backend}"}, failures
