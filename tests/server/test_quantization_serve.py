"""`pagoda serve --quantization` end to end: the official openai client gets the quantized engine's greedy
completion, and a GPTQ checkpoint serves without the flag."""

import pytest
from live_server import start_server
from quantized_checkpoints import write_quantized_model

from pagoda import LLM, SamplingParams

pytestmark = pytest.mark.server

PROMPT = "Paged attention stores keys and values in"


def offline_greedy(path, **kwargs) -> str:
    llm = LLM(str(path), kv_cache_memory=0.02, **kwargs)
    try:
        out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        return out[0].outputs[0].text
    finally:
        llm.engine.shutdown()


def served_greedy(server) -> str:
    client = server.client("unused", timeout=60)
    model = client.models.list().data[0].id
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text


def test_serve_int4_gives_the_offline_int4_completion(server_factory, tiny_llama_dir):
    server = server_factory("--quantization", "int4", "--quantization-group-size", "32")
    assert served_greedy(server) == offline_greedy(tiny_llama_dir, quantization="int4",
                                                   quantization_group_size=32)


def test_serve_finds_an_awq_checkpoint(tiny_llama_dir, tmp_path):
    awq = tmp_path / "awq"
    write_quantized_model(tiny_llama_dir, awq, tmp_path / "dequantized", "awq", 32)
    server = start_server(awq, tmp_path)
    try:
        assert served_greedy(server) == offline_greedy(awq) != offline_greedy(tiny_llama_dir)
    finally:
        server.stop()
