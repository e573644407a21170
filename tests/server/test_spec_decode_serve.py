"""`pagoda serve --speculative-config`: the official client gets the same greedy answer as without
speculation, streaming included, and /metrics and the stats line report the drafts."""

import json
import re
import time

import httpx
import pytest
from live_server import API_KEY

pytestmark = pytest.mark.server

PROMPT = "Continuous batching lets new requests join between steps. " * 3


@pytest.fixture(scope="module")
def plain_answer(tiny_llama_dir) -> str:
    """The greedy answer without speculation."""
    from pagoda import LLM, SamplingParams

    plain = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory=0.02)
    want = plain.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].text
    plain.shutdown()
    return want


def check_same_answer_and_drafts(server, want: str) -> str:
    """The served greedy answer, plain and streamed, equals want and drafts were verified; the metrics."""
    client = server.client(API_KEY, timeout=120)
    model = client.models.list().data[0].id
    kwargs = dict(model=model, prompt=PROMPT, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    assert client.completions.create(**kwargs).choices[0].text == want
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(stream=True, **kwargs)
                       if chunk.choices)
    assert streamed == want
    metrics = httpx.get(server.url + "/metrics").text
    drafts = float(re.search(r'^pagoda:spec_decode_num_drafts_total\{[^}]*\} (\S+)$', metrics, re.M).group(1))
    assert drafts > 0
    return metrics


def test_ngram_speculation_over_http(server_factory, plain_answer):
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    server = server_factory("--api-key", API_KEY, "--dtype", "float32", "--speculative-config", json.dumps(config),
                            "--stats-log-interval", "0.2", "--log-level", "info")
    metrics = check_same_answer_and_drafts(server, plain_answer)
    assert re.search(r'^pagoda:spec_decode_num_accepted_tokens_per_pos_total\{[^}]*position="2"[^}]*\} ', metrics,
                     re.M)
    deadline = time.monotonic() + 10
    while "Spec decode: mean acceptance length" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "Spec decode: mean acceptance length" in server.log()


def test_draft_model_speculation_with_tensor_parallelism_over_http(server_factory, plain_answer, tiny_model_factory):
    """A draft model beside a target split over 2 TP ranks (local processes): the same greedy answer."""
    config = {"model": str(tiny_model_factory("llama", seed=1, num_layers=1)), "num_speculative_tokens": 3}
    server = server_factory("--api-key", API_KEY, "--dtype", "float32", "--tensor-parallel-size", "2",
                            "--speculative-config", json.dumps(config))
    check_same_answer_and_drafts(server, plain_answer)
