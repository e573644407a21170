"""`pagoda serve --enable-lora --lora-modules`: a request's `model` chooses the adapter (the official client
gets the offline engine's answer with that adapter), /v1/models lists the adapters with their parent, an
unknown model is a 404, and bad flags stop the server naming them."""

import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from checkpoints import write_lora_adapter
from live_server import API_KEY

from pagoda.router.model_server_metrics import read_model_server_metrics

pytestmark = pytest.mark.server

PROMPT = "Hello, my name is"


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-lora")
    return (write_lora_adapter(tiny_llama_dir, root / "sql", rank=8, seed=21),
            write_lora_adapter(tiny_llama_dir, root / "chat", rank=4, seed=22, targets=("q_proj", "down_proj")))


@pytest.fixture(scope="module")
def offline_answers(tiny_llama_dir, adapters):
    from pagoda import LLM, LoRARequest, SamplingParams

    with LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory=0.02, enable_lora=True, max_loras=2,
             max_lora_rank=8) as llm:
        loras = [None, LoRARequest("sql", 1, str(adapters[0])), LoRARequest("chat", 2, str(adapters[1]))]
        outs = llm.generate([PROMPT] * 3, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                            use_tqdm=False, lora_request=loras)
        embeddings = llm.embed([PROMPT] * 3, use_tqdm=False, lora_request=loras)
    # the texts; and .embeddings, each request's embedding (last token, normalised) under the same adapter
    answers = Answers(o.outputs[0].text for o in outs)
    answers.embeddings = [e.outputs.embedding for e in embeddings]
    return answers


class Answers(list):
    embeddings: list[list[float]]


def test_model_chooses_the_adapter(server_factory, adapters, offline_answers):
    sql, chat = adapters
    server = server_factory("--api-key", API_KEY, "--dtype", "float32", "--enable-lora", "--max-loras", "2",
                            "--max-lora-rank", "8", "--metrics-vllm-names", "--lora-modules", f"sql={sql}",
                            f'{{"name": "chat", "path": "{chat}", "base_model_name": "tiny"}}')
    client = server.client(API_KEY, timeout=120)
    models = client.models.list().data
    base = models[0].id
    assert [(m.id, getattr(m, "parent", None)) for m in models] == [(base, None), ("sql", base), ("chat", base)]
    assert client.models.retrieve("sql").parent == base

    def complete(model):
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text

    assert [complete(m) for m in (base, "sql", "chat")] == offline_answers
    chat_answer = client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, temperature=0)
    assert chat_answer.choices[0].message.content is not None
    assert chat_answer.model == "sql"  # a response names the adapter asked for, as vLLM's
    with pytest.raises(openai.NotFoundError) as err:
        complete("nope")
    assert "`sql`" in str(err.value) and "`chat`" in str(err.value)
    assert httpx.get(server.url + "/health").status_code == 200
    # lora_requests_info (vLLM's labels): the slots, and the adapter of a request still streaming
    assert 'pagoda:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}' in \
        httpx.get(server.url + "/metrics").text
    stream = client.completions.create(model="chat", prompt=PROMPT, max_tokens=400, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    seen = []
    for i, _ in enumerate(stream):
        if i == 3:
            seen.append(httpx.get(server.url + "/metrics").text)
    assert 'running_lora_adapters="chat"' in seen[0]
    # the same, under vLLM's names, read as the Gateway API Inference Extension's model-server protocol says
    gie = read_model_server_metrics(seen[0])
    assert (gie.max_lora, gie.running_lora_adapters, gie.waiting_lora_adapters) == (2, ["chat"], [])
    assert gie.waiting == 0 and 0 < gie.kv_usage <= 1
    metrics = httpx.get(server.url + "/metrics").text
    counts = sorted(line for line in metrics.splitlines() if line.startswith("pagoda:lora_requests_total"))
    assert counts == [f'pagoda:lora_requests_total{{lora_name="{name}",model_name="{base}"}} 2.0'
                      for name in ("chat", "sql")]  # sql: a completion and a chat; chat: two completions
    # /v1/embeddings: `model` chooses the adapter there too
    for model, expected in zip((base, "sql", "chat"), offline_answers.embeddings):
        assert client.embeddings.create(model=model, input=PROMPT).data[0].embedding == pytest.approx(expected, abs=1e-5)
    assert offline_answers.embeddings[0] != offline_answers.embeddings[1] != offline_answers.embeddings[2]
    assert client.completions.create(model="chat", prompt=PROMPT, max_tokens=1).model == "chat"
    assert client.completions.create(model=base, prompt=PROMPT, max_tokens=1).model == base


@pytest.mark.parametrize("flags,named", [
    (["--lora-modules", "sql=/x"], "--enable-lora"),
    (["--enable-lora", "--lora-modules", "sql"], "--lora-modules"),
    (["--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"], "--max-cpu-loras"),
])
def test_bad_lora_flags_are_named(tiny_llama_dir, flags, named):
    pagoda = str(Path(sys.executable).parent / "pagoda")
    done = subprocess.run([pagoda, "serve", str(tiny_llama_dir), *flags], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and named in done.stderr


def test_adapters_load_and_unload_at_runtime(server_factory, adapters, offline_answers):
    sql, chat = adapters
    server = server_factory("--api-key", API_KEY, "--dtype", "float32", "--enable-lora", "--max-lora-rank", "8",
                            "--allow-runtime-lora-updating")
    client = server.client(API_KEY, timeout=120)
    headers = {"Authorization": f"Bearer {API_KEY}"}

    def post(path, body):
        return httpx.post(f"{server.url}/v1/{path}", json=body, headers=headers, timeout=60)

    assert post("load_lora_adapter", {"lora_name": "sql", "lora_path": str(sql)}).status_code == 200
    assert [m.id for m in client.models.list().data][1:] == ["sql"]
    answer = client.completions.create(model="sql", prompt=PROMPT, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
    assert answer == offline_answers[1]
    bad = post("load_lora_adapter", {"lora_name": "bad", "lora_path": str(sql.parent / "missing")})
    assert bad.status_code == 400 and "missing" in bad.json()["error"]["message"]
    assert post("load_lora_adapter", {"lora_name": "sql", "lora_path": str(chat)}).status_code == 400
    assert post("unload_lora_adapter", {"lora_name": "sql"}).status_code == 200
    assert post("unload_lora_adapter", {"lora_name": "sql"}).status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="sql", prompt=PROMPT, max_tokens=2)
    # the same name again, another adapter: a fresh id, so it never meets the old one's slot or KV blocks
    assert post("load_lora_adapter", {"lora_name": "sql", "lora_path": str(chat)}).status_code == 200
    assert client.completions.create(model="sql", prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text == offline_answers[2]


def test_runtime_updating_is_off_by_default(server_factory, adapters):
    server = server_factory("--api-key", API_KEY, "--enable-lora")
    done = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(adapters[0])},
                      headers={"Authorization": f"Bearer {API_KEY}"})
    assert done.status_code == 404
