"""The engine with attention_backend="triton" on CUDA (compiled kernels, not the interpreter) produces
transformers' greedy tokens (float32, tiny random checkpoints) for a dense Llama, Qwen3, a mixture of experts
and a sliding-window model; then chunked prefill with prefix-cache hits, an fp8 KV cache (against
transformers with its keys and values rounded through fp8) and LoRA (against peft); FP8 weights through
torch._scaled_mm."""

import os

import pytest
from checkpoints import hf_greedy, peft_greedy, write_lora_adapter

from pagoda import LLM, LoRARequest, SamplingParams

PROMPTS = [
    "Hello, my name is",
    "The quick brown fox jumps over the lazy dog. Paged attention stores keys and values in blocks",
    "a",
    "Continuous batching lets new requests join between steps. " * 3,
]
MAX_TOKENS = 16
# The rehearsal on Triton 3.6 sets "torch": that Triton's interpreter cannot run the attention kernels
# (docs/gpu.md), so there the tests prove their references, fixtures and files, not the kernels.
BACKEND = os.environ.get("PAGODA_GPU_TEST_BACKEND", "triton")
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def triton_llm(path, device, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", 0.02)
    kwargs.setdefault("attention_backend", BACKEND)
    llm = LLM(str(path), dtype="float32", device=device, **kwargs)
    assert llm.engine.config.device.startswith(device)
    return llm


def greedy(llm, prompts=PROMPTS, **kwargs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False, **kwargs)]


@pytest.fixture(scope="module")
def reference(tiny_model_factory):
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = hf_greedy(tiny_model_factory(arch), PROMPTS, MAX_TOKENS)
        return cache[arch]

    return get


def test_kernels_are_compiled_for_the_device(device):
    from pagoda.kernels import paged_attention
    from pagoda.kernels._checks import is_interpreted

    assert is_interpreted(paged_attention._mixed_batch_kernel) == (device == "cpu")


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2-moe", "mistral-window"])
def test_greedy_tokens_equal_transformers(tiny_model_factory, reference, device, arch):
    with triton_llm(tiny_model_factory(arch), device) as llm:
        assert greedy(llm) == reference(arch)
        llm.engine.block_manager.check_no_leaks()


@pytest.mark.parametrize("arch", ["llama", "mistral-window"])
def test_chunked_prefill_then_prefix_cache_hits(tiny_model_factory, reference, device, arch):
    """7 tokens a step (every prompt chunked, decodes in between), then every prompt again from the cache."""
    with triton_llm(tiny_model_factory(arch), device, max_num_batched_tokens=7) as llm:
        assert greedy(llm) == reference(arch)
        assert greedy(llm, PROMPTS[::-1])[::-1] == reference(arch)
        assert llm.engine.get_stats().prefix_cache_hits > 0
        llm.engine.block_manager.check_no_leaks()


def test_fp8_kv_cache_equals_transformers_with_fp8_rounded_kv(tiny_model_factory, device):
    import torch
    from test_fp8_kv_cache import hf_greedy_fp8_kv  # tests/model: the fp8-rounded transformers reference

    path = tiny_model_factory("llama")
    expected = hf_greedy_fp8_kv(path, "llama", torch.float8_e4m3fn, PROMPTS, MAX_TOKENS)
    with triton_llm(path, device, kv_cache_dtype="fp8", max_num_batched_tokens=32) as llm:
        assert llm.engine.executor.runner.kv_caches[0].dtype == torch.float8_e4m3fn
        assert greedy(llm) == expected


def test_lora_mixed_batch_equals_peft(tiny_model_factory, tmp_path, device):
    base = tiny_model_factory("llama")
    a = write_lora_adapter(base, tmp_path / "a", rank=8, seed=1)
    b = write_lora_adapter(base, tmp_path / "b", rank=4, seed=2, targets=("q_proj", "v_proj", "down_proj"))
    reference = {name: peft_greedy(base, adapter, PROMPTS, MAX_TOKENS) for name, adapter in
                 (("base", None), ("a", a), ("b", b))}
    loras = {"a": LoRARequest("a", 1, str(a)), "base": None, "b": LoRARequest("b", 2, str(b))}
    prompts = [p for p in PROMPTS for _ in loras]
    with triton_llm(base, device, enable_lora=True, max_loras=2, max_lora_rank=8) as llm:
        got = greedy(llm, prompts, lora_request=[loras[name] for _ in PROMPTS for name in loras])
        assert got == [reference[name][i] for i in range(len(PROMPTS)) for name in loras]


def fp8_tensor_cores(device) -> bool:
    import torch

    return device == "cuda" and torch.cuda.get_device_capability() >= (8, 9)


def test_fp8_scaled_mm_is_close_to_the_dequantized_matmul(device):
    """W8A8 through torch._scaled_mm (FP8 tensor cores, sm_89+): activations quantized per token, weights per
    channel; within fp8's rounding of the float32 product of the dequantized weights."""
    import torch
    import torch.nn.functional as F

    from pagoda.layers.quantization import fp8

    if not fp8_tensor_cores(device):
        pytest.skip("torch._scaled_mm needs FP8 tensor cores (sm_89+)")
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(256, 512, generator=g)
    qweight, scales = fp8.quantize_rows(weight, weight.abs().amax(dim=1))
    x = torch.randn(37, 512, generator=g).to(torch.bfloat16)
    qweight, scales, x = qweight.to(device), scales.to(device), x.to(device)
    assert fp8.scaled_mm_supported(x, qweight, scales)
    got = fp8.scaled_mm(x, qweight, scales).float()
    expected = F.linear(x.float(), fp8.dequantize(qweight, scales))
    assert (got - expected).norm() / expected.norm() < 0.06  # e4m3 activations: ~2**-4 per element, averaged


def test_online_fp8_weights_in_the_engine_use_scaled_mm(tiny_model_factory, device, monkeypatch):
    """quantization="fp8" in bfloat16 on an FP8-capable GPU: the linear layers go through torch._scaled_mm."""
    from pagoda.layers.quantization import fp8

    if not fp8_tensor_cores(device):
        pytest.skip("torch._scaled_mm needs FP8 tensor cores (sm_89+)")
    calls = []
    real = fp8.scaled_mm
    monkeypatch.setattr(fp8, "scaled_mm", lambda *a: calls.append(a[0].shape) or real(*a))
    with LLM(str(tiny_model_factory("llama")), dtype="bfloat16", quantization="fp8", attention_backend="triton",
             device=device, kv_cache_memory=0.02) as llm:
        outs = greedy(llm)
    assert calls and all(len(tokens) == MAX_TOKENS for tokens in outs)
