"""P/D disaggregation through the OpenAI server (issue 55): two `pagoda serve` processes on the tiny Llama, a
NIXL producer (its engine core in a process of its own: kv_transfer_params cross engine/wire.py) and a consumer,
driven by the official openai client as a vLLM P/D proxy drives vLLM: the prefill request (max_tokens 1,
kv_transfer_params {do_remote_decode: true}) answers the params the decode request sends. Greedy text equals a
plain server's; the decode server's /metrics count the bytes it pulled (vLLM's NIXL names), the idle prefill
server frees the pulled blocks on its own, an unreachable prefill peer is recomputed and counted, and malformed
kv_transfer_params are a 400 naming the field."""

import json
import time

import httpx
import openai
import pytest
from live_server import API_KEY, free_port
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("nixl_cu12")

PROMPTS = ["the quick brown fox jumps over the lazy dog " * 3, "a b c d e f g h i j k l m n o p q r s t u v w x y z"]
CHAT = [{"role": "user", "content": "count the letters: " + "abc " * 10}]
MAX_TOKENS = 8
PRODUCER = {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}
CONSUMER = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}
KEYS = ("do_remote_decode", "do_remote_prefill", "remote_engine_id", "remote_block_ids", "remote_host",
        "remote_port", "remote_request_id", "tp_size")


@pytest.fixture(scope="module")
def servers(server_factory):
    """(prefill, decode, plain): started together, so their model loads overlap."""
    producer = {**PRODUCER, "kv_connector_extra_config": {"side_channel_port": free_port()}}
    # the torch path (no C++ kernel build at start-up), one thread each: three servers share the cores
    env = {"PAGODA_CPU_KERNELS": "0", "OMP_NUM_THREADS": "1"}
    started = [
        server_factory("--kv-transfer-config", json.dumps(producer), wait=False,
                       env={**env, "PAGODA_ENABLE_ENGINE_CORE_PROCESS": "1"}),
        # no prefix cache: a prompt decoded before is pulled again, not found here
        server_factory("--kv-transfer-config", json.dumps(CONSUMER), "--no-enable-prefix-caching",
                       "--metrics-vllm-names", wait=False, env=env),
        server_factory(wait=False, env=env),
    ]
    for server in started:
        server.wait_ready()
    return started


@pytest.fixture(scope="module")
def clients(servers):
    return [server.client(API_KEY, timeout=120) for server in servers]


@pytest.fixture(scope="module")
def plain_texts(clients):
    plain = clients[2]
    return [plain.completions.create(model=plain.models.list().data[0].id, prompt=p, max_tokens=MAX_TOKENS,
                                     temperature=0).choices[0].text for p in PROMPTS]


def model_of(client) -> str:
    return client.models.list().data[0].id


def metrics(server) -> dict[str, float]:
    """Samples by name (labels model_name and engine dropped)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "engine"))
            key = s.name + (f"{{{labels}}}" if labels else "")
            values[key] = values.get(key, 0.0) + s.value
    return values


# what vLLM's disaggregated proxy examples send the prefill server
PROXY_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}


def prefill(client, prompt: str, params: dict | None = None) -> dict:
    out = client.completions.create(model=model_of(client), prompt=prompt, max_tokens=1, temperature=0,
                                    extra_body={"kv_transfer_params": params or {"do_remote_decode": True}})
    return out.model_extra["kv_transfer_params"]


def streamed_prefill(client, prompt: str) -> dict:
    chunks = list(client.completions.create(model=model_of(client), prompt=prompt, max_tokens=1, temperature=0,
                                            stream=True, extra_body={"kv_transfer_params": PROXY_PREFILL}))
    carrying = [c.model_extra["kv_transfer_params"] for c in chunks if (c.model_extra or {}).get("kv_transfer_params")]
    assert len(carrying) == 1 and chunks[-1].choices[0].finish_reason == "length"
    return carrying[0]


def decode(client, prompt: str, params: dict) -> str:
    return client.completions.create(model=model_of(client), prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"kv_transfer_params": params}).choices[0].text


def wait_for(predicate, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def test_prefill_then_decode_equals_a_plain_server(servers, clients, plain_texts):
    prefill_client, decode_client, _ = clients
    before = metrics(servers[1])
    for prompt, plain, ask in zip(PROMPTS, plain_texts, (prefill, streamed_prefill), strict=True):
        params = ask(prefill_client, prompt)
        assert set(KEYS) <= set(params), params  # vLLM's NixlConnector's shape
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        assert params["remote_block_ids"] and params["remote_port"] > 0 and params["tp_size"] == 1
        assert decode(decode_client, prompt, params) == plain
    after = metrics(servers[1])
    for prefix in ("pagoda:", "vllm:"):  # vLLM's NIXL families, and their vllm: twins (--metrics-vllm-names)
        assert after[prefix + "nixl_bytes_transferred_sum"] > before.get(prefix + "nixl_bytes_transferred_sum", 0)
        assert after[prefix + "nixl_xfer_time_seconds_count"] - before.get(
            prefix + "nixl_xfer_time_seconds_count", 0) == len(PROMPTS)
        assert after[prefix + "nixl_num_descriptors_sum"] > 0
    assert after["pagoda:nixl_num_failed_transfers_total"] == before.get("pagoda:nixl_num_failed_transfers_total", 0)


def test_an_idle_prefill_server_frees_the_pulled_blocks(servers, clients):
    """After the decode pulled, the prefill server (no request since) shows its KV cache empty again: the
    engine's idle loop frees what was pulled, it does not wait for a next step."""
    prefill_client, decode_client, _ = clients
    params = prefill(prefill_client, PROMPTS[0])
    assert metrics(servers[0])["pagoda:kv_cache_usage_perc"] > 0  # held for the decode
    decode(decode_client, PROMPTS[0], params)
    assert wait_for(lambda: metrics(servers[0])["pagoda:kv_cache_usage_perc"] == 0), metrics(servers[0])
    assert metrics(servers[0])["pagoda:kv_cache_used_blocks"] == 0


def test_streamed_prefill_and_decode_chat(clients):
    prefill_client, decode_client, plain_client = clients
    model = model_of(plain_client)
    plain = plain_client.chat.completions.create(model=model, messages=CHAT, max_tokens=MAX_TOKENS,
                                                 temperature=0).choices[0].message.content
    # the prefill streamed: its params ride on the chunk that finishes the choice
    chunks = list(prefill_client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=1, temperature=0, stream=True,
        extra_body={"kv_transfer_params": {"do_remote_decode": True}}))
    carrying = [c.model_extra["kv_transfer_params"] for c in chunks if (c.model_extra or {}).get("kv_transfer_params")]
    assert len(carrying) == 1 and carrying[0]["do_remote_prefill"] is True
    assert chunks[-1].choices[0].finish_reason == "length"
    stream = decode_client.chat.completions.create(model=model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                                   stream=True, extra_body={"kv_transfer_params": carrying[0]})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == plain
    # the non-streamed chat answer carries them at the top level too
    out = prefill_client.chat.completions.create(model=model, messages=CHAT, max_tokens=1, temperature=0,
                                                 extra_body={"kv_transfer_params": {"do_remote_decode": True}})
    params = out.model_extra["kv_transfer_params"]
    assert decode_client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"kv_transfer_params": params}).choices[0].message.content == plain


def test_an_unreachable_prefill_peer_is_recomputed_and_counted(servers, clients, plain_texts):
    decode_client = clients[1]
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "gone",
              "remote_block_ids": [0, 1, 2], "remote_host": "127.0.0.1", "remote_port": free_port(),
              "remote_request_id": "cmpl-gone", "tp_size": 1}
    before = metrics(servers[1])
    assert decode(decode_client, PROMPTS[0], params) == plain_texts[0]
    after = metrics(servers[1])
    for name in ("pagoda:nixl_num_failed_transfers_total", "vllm:nixl_num_failed_transfers_total",
                 "pagoda:nixl_num_recomputed_prompts_total"):
        assert after[name] == before.get(name, 0) + 1, name
    assert after["pagoda:kv_cache_usage_perc"] == 0


def _error(call) -> dict:
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    return caught.value.response.json()["error"]


@pytest.mark.parametrize("params, field", [
    ("yes", "kv_transfer_params"),
    ({"do_remote_decode": "yes"}, "kv_transfer_params.do_remote_decode"),
    ({"do_remote_prefill": True, "remote_engine_id": "e", "remote_host": "127.0.0.1", "remote_port": 5600,
      "remote_block_ids": ["x"]}, "kv_transfer_params.remote_block_ids"),
    ({"do_remote_prefill": True, "remote_engine_id": "e", "remote_host": "127.0.0.1", "remote_port": 0,
      "remote_block_ids": [1]}, "kv_transfer_params.remote_port"),
    ({"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 5600, "remote_block_ids": [1]},
     "kv_transfer_params.remote_engine_id"),
])
def test_malformed_kv_transfer_params_are_a_400_naming_the_field(clients, params, field):
    for client in clients:  # with a connector or without
        model = model_of(client)
        error = _error(lambda client=client, model=model: client.completions.create(
            model=model, prompt="hi", max_tokens=2, extra_body={"kv_transfer_params": params}))
        assert error["param"] == field and field in error["message"], error
        error = _error(lambda client=client, model=model: client.chat.completions.create(
            model=model, messages=CHAT, max_tokens=2, stream=True, extra_body={"kv_transfer_params": params}))
        assert error["param"] == field, error


def test_a_server_without_a_kv_connector_says_so(clients):
    plain = clients[2]
    error = _error(lambda: plain.completions.create(model=model_of(plain), prompt="hi", max_tokens=1,
                                                    extra_body={"kv_transfer_params": {"do_remote_decode": True}}))
    assert error["param"] == "kv_transfer_params.do_remote_decode" and "--kv-transfer-config" in error["message"]
    # nothing asked (vLLM's proxies may send an empty object): a plain answer
    out = plain.completions.create(model=model_of(plain), prompt="hi", max_tokens=1,
                                   extra_body={"kv_transfer_params": {}})
    assert out.choices[0].text is not None and out.model_extra.get("kv_transfer_params") is None


def test_each_role_refuses_the_other_half(clients, plain_texts):
    prefill_client, decode_client, _ = clients
    params = prefill(prefill_client, PROMPTS[0])
    error = _error(lambda: prefill_client.completions.create(  # a producer cannot pull
        model=model_of(prefill_client), prompt=PROMPTS[0], max_tokens=2, extra_body={"kv_transfer_params": params}))
    assert error["param"] == "kv_transfer_params.do_remote_prefill" and "kv_producer" in error["message"]
    error = _error(lambda: decode_client.completions.create(  # a consumer holds nothing for others
        model=model_of(decode_client), prompt=PROMPTS[0], max_tokens=1,
        extra_body={"kv_transfer_params": {"do_remote_decode": True}}))
    assert error["param"] == "kv_transfer_params.do_remote_decode" and "kv_consumer" in error["message"]
    assert decode(decode_client, PROMPTS[0], params) == plain_texts[0]  # the params still serve their decode


def test_one_prompt_per_prefill(clients):
    prefill_client = clients[0]
    error = _error(lambda: prefill_client.completions.create(
        model=model_of(prefill_client), prompt=PROMPTS, max_tokens=1,
        extra_body={"kv_transfer_params": {"do_remote_decode": True}}))
    assert error["param"] == "kv_transfer_params"
