"""The engine's CPU attention runs the C++ kernels (``attention/paged_*_cpu.cpp``) for the layers that used
to take the torch path: sliding windows and soft-capped scores (Gemma 2/3, Mistral with a window) and fp8 KV
caches. The torch attention functions are made to fail for the whole run, so these tests see only the kernels,
and the tokens are still transformers' (test_hf_parity.py and test_fp8_kv_cache.py hold the same references)."""

import shutil

import pytest
from checkpoints import hf_greedy
from test_fp8_kv_cache import FP8, hf_greedy_fp8_kv
from test_hf_parity import MAX_TOKENS, PROMPTS, pagoda_greedy

from pagoda.attention import cpu_kernels, torch_backend

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler: the kernels cannot be built here"),
]


@pytest.fixture
def torch_attention_refused(monkeypatch):
    assert cpu_kernels.available(), "the C++ attention kernels failed to build (see the log)"

    def refuse(*args, **kwargs):
        raise AssertionError("the torch attention path ran where the C++ kernels should have")

    for name in ("paged_attention_in_torch", "windowed_attention", "_batched_decode"):
        monkeypatch.setattr(torch_backend, name, refuse)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "mistral-window"])
def test_windowed_and_softcapped_models_run_the_kernels(tiny_model_factory, arch, torch_attention_refused):
    """Prompts chunked 7 tokens a step past the 16-token windows, decodes in between."""
    path = tiny_model_factory(arch)
    expected = hf_greedy(path, PROMPTS, MAX_TOKENS)
    _, got = pagoda_greedy(path, max_num_batched_tokens=7)
    assert got == expected


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_cache_runs_the_kernels(tiny_model_factory, kv_cache_dtype, torch_attention_refused):
    path = tiny_model_factory("llama")
    expected = hf_greedy_fp8_kv(path, "llama", FP8[kv_cache_dtype])
    llm, got = pagoda_greedy(path, kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=7)
    assert llm.engine.executor.runner.kv_caches[0].dtype == FP8[kv_cache_dtype]
    assert got == expected
