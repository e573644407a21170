"""Embedding requests through the engine (`LLM.embed`) equal transformers' final hidden states (float32), with
chunked prefill, the prefix cache, and generating requests in the same batches; no KV blocks are kept."""

import pytest
import torch
from checkpoints import load_hf_reference
from transformers import AutoTokenizer

from pagoda import LLM, PoolingParams, SamplingParams

pytestmark = pytest.mark.model

PROMPTS = ["Hello, my name is", "The quick brown fox jumps over the lazy dog. " * 5, "a"]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = load_hf_reference(tiny_llama_dir)
    hidden = {}
    for prompt in PROMPTS:
        with torch.no_grad():
            hidden[prompt] = model.model(tokenizer(prompt, return_tensors="pt").input_ids).last_hidden_state[0]
    return hidden  # prompt -> [tokens, hidden_size], after the final norm


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    # a 16-token step budget: the long prompt's prefill runs in chunks
    with LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory=0.02, max_num_batched_tokens=16,
             block_size=8) as llm:
        yield llm


@pytest.mark.parametrize("pooling_type", ["last", "mean"])
def test_embed_matches_transformers(llm, reference, pooling_type):
    # generate first: the prompts' blocks are then in the prefix cache (mean pooling must not use them)
    llm.generate(PROMPTS, SamplingParams(max_tokens=2), use_tqdm=False)
    outs = llm.embed(PROMPTS, PoolingParams(pooling_type), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        hidden = reference[prompt]
        want = torch.nn.functional.normalize(hidden[-1] if pooling_type == "last" else hidden.mean(0), dim=0)
        assert len(out.prompt_token_ids) == hidden.shape[0]
        assert torch.allclose(torch.tensor(out.outputs.embedding), want, atol=1e-5), prompt
    llm.engine.block_manager.check_no_leaks()


def test_embed_beside_generation(llm, reference):
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), PoolingParams(normalize=False)] * 3
    alone = llm.generate(PROMPTS[1], params[0], use_tqdm=False)[0].outputs[0].token_ids
    outs = llm.generate([PROMPTS[1]] * 6, params, use_tqdm=False)
    for out, p in zip(outs, params):
        if isinstance(p, PoolingParams):
            assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "stop"
            assert torch.allclose(torch.tensor(out.embedding), reference[PROMPTS[1]][-1], atol=2e-4)
        else:
            assert out.embedding is None and out.outputs[0].token_ids == alone
    llm.engine.block_manager.check_no_leaks()


def test_embed_input_errors(llm):
    with pytest.raises(ValueError, match="maximum context length"):
        llm.embed({"prompt_token_ids": [5] * 513}, use_tqdm=False)
    assert len(llm.embed({"prompt_token_ids": [5] * 512}, use_tqdm=False)[0].outputs.embedding) == 64
