"""End to end: the engine with attention_backend="triton" (attention, KV write, RMSNorm and rotary kernels;
the interpreter on CPU) produces the same greedy tokens as attention_backend="torch" on a tiny random Llama
(GQA, Llama-3 rope scaling), over batches that mix chunked long prefills, prefix-cache hits and decodes."""

import pytest

from pagoda import LLM, SamplingParams
from pagoda.attention import triton_backend

pytestmark = pytest.mark.kernels

LONG = " ".join([
    "Paged attention stores keys and values in fixed-size blocks.",
    "Continuous batching lets new requests join between steps.",
    "The quick brown fox jumps over the lazy dog.",
] * 2)
FIRST = [LONG + " Hello, my name is", "Paris is the capital of", "a", "The quick brown fox"]
# same prefixes again: the long prompts hit the prefix cache, one of them mid-block
SECOND = [LONG + " San Francisco is a city", "Paris is the capital of", LONG[:150], "héllo wörld"]
MAX_TOKENS = 10


def generate(path, backend, device, **kwargs):
    llm = LLM(str(path), dtype="float32", attention_backend=backend, device=device, kv_cache_memory=0.01,
              max_num_batched_tokens=64, max_num_seqs=4, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tokens = [[o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
              for prompts in (FIRST, SECOND)]
    assert llm.engine.get_stats().prefix_cache_hits > 0
    llm.engine.block_manager.check_no_leaks()
    return tokens


@pytest.fixture(scope="module")
def tiny_path(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def torch_tokens(tiny_path):
    import torch

    return generate(tiny_path, "torch", "cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def batches(monkeypatch):
    """Records (query_lens, seq_lens) of every attention call through the Triton backend."""
    seen: list[tuple[list[int], list[int]]] = []
    real = triton_backend.paged_attention

    def recording(query, kv_cache, metadata, scale):
        seen.append((metadata.query_lens_cpu, metadata.seq_lens_cpu))
        return real(query, kv_cache, metadata, scale)

    monkeypatch.setattr(triton_backend, "paged_attention", recording)
    return seen


@pytest.fixture
def fused_op_calls(monkeypatch):
    """Counts calls of the RMSNorm and rotary kernels made through layers.custom_ops."""
    from pagoda.kernels import rmsnorm, rotary

    calls = {"rms_norm": 0, "fused_add_rms_norm": 0, "apply_rotary_": 0}
    for module in (rmsnorm, rotary):
        for name in calls:
            real = getattr(module, name, None)
            if real is not None:
                def counting(*args, _real=real, _name=name):
                    calls[_name] += 1
                    return _real(*args)
                monkeypatch.setattr(module, name, counting)
    return calls


def test_same_greedy_tokens_as_torch(tiny_path, torch_tokens, batches, device, fused_op_calls):
    assert generate(tiny_path, "triton", device) == torch_tokens
    assert all(n > 0 for n in fused_op_calls.values()), f"the fused kernels ran in the engine: {fused_op_calls}"
    fused_op_calls.update(dict.fromkeys(fused_op_calls, 0))
    assert generate(tiny_path, "torch", device) == torch_tokens
    assert not any(fused_op_calls.values()), "a torch engine built after a Triton one uses torch's ops"
    mixed = [(q, s) for q, s in batches if 1 in q and max(q) > 1]
    assert mixed, "some step mixed decodes and prefill chunks"
    assert any(sl > ql > 1 for q, s in mixed for ql, sl in zip(q, s, strict=True)), \
        "some chunk attended to context computed in an earlier step or found in the prefix cache"
    assert max(max(s) for _, s in batches) > 200


def test_same_greedy_tokens_with_split_k_decodes(tiny_path, torch_tokens, batches, device, monkeypatch):
    """Small partitions and a high program threshold send every pure-decode step with a context over 128
    positions through the split-K kernels."""
    monkeypatch.setattr(triton_backend, "SPLIT_K_PARTITION_SIZE", 64)
    monkeypatch.setattr(triton_backend, "SPLIT_K_PROGRAMS_PER_SM", 10**6)
    monkeypatch.setattr(triton_backend, "ONE_PASS_PROGRAMS_PER_SM", 10**6)
    split_k_calls = []
    real = triton_backend._flash_decode.flash_decode
    monkeypatch.setattr(triton_backend._flash_decode, "flash_decode",
                        lambda *a, **kw: split_k_calls.append(kw) or real(*a, **kw))
    assert generate(tiny_path, "triton", device) == torch_tokens
    assert split_k_calls


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", pytest.param("fp8_e5m2", marks=pytest.mark.heavy)])
def test_same_greedy_tokens_as_torch_with_an_fp8_cache(tiny_path, tmp_path, device, monkeypatch, kv_cache_dtype):
    """fp8 KV cache with the checkpoint's (non power-of-two) k/v scales: the Triton write, mixed-batch and
    split-K kernels against the torch path, token for token."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    path = tmp_path / "kv-scales"
    shutil.copytree(tiny_path, path)
    tensors = load_file(path / "model.safetensors")
    for layer, (k_scale, v_scale) in enumerate([(0.3, 0.07), (0.6, 0.011)]):
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k_scale)
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(v_scale)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    expected = generate(path, "torch", "cuda" if torch.cuda.is_available() else "cpu", kv_cache_dtype=kv_cache_dtype)
    monkeypatch.setattr(triton_backend, "SPLIT_K_PARTITION_SIZE", 64)
    monkeypatch.setattr(triton_backend, "SPLIT_K_PROGRAMS_PER_SM", 10**6)
    monkeypatch.setattr(triton_backend, "ONE_PASS_PROGRAMS_PER_SM", 10**6)
    split_k_calls = []
    real = triton_backend._flash_decode.flash_decode
    monkeypatch.setattr(triton_backend._flash_decode, "flash_decode",
                        lambda *a, **kw: split_k_calls.append(kw) or real(*a, **kw))
    assert generate(path, "triton", device, kv_cache_dtype=kv_cache_dtype) == expected
    assert split_k_calls and split_k_calls[0]["k_scale"] != 1.0
