"""The Triton engine's decode graphs against its eager steps: the same greedy tokens. On a CPU the stand-in
capture replays the recorded forward with the metadata's host copies frozen as captured (every context one
token long), as a CUDA graph would: equal tokens prove the captured kernels read every length from the static
device buffers. On a GPU the graphs are torch.cuda.CUDAGraph's."""

import pytest

from pagoda import LLM, SamplingParams
from pagoda.config.compilation import STAND_IN_ENV
from pagoda.worker import cuda_graphs

pytestmark = pytest.mark.kernels

PROMPTS = ["Hello, my name is", "Paris is the capital of", "The quick brown fox jumps over the lazy dog."]
MAX_TOKENS = 5


def generate(path, device, **kwargs):
    llm = LLM(str(path), dtype="float32", attention_backend="triton", device=device, kv_cache_memory=0.01,
              max_num_seqs=4, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    return tokens, llm.engine.executor.runner.graphs


def test_graphs_equal_eager(tiny_model_factory, device, monkeypatch):
    path = tiny_model_factory("llama")
    eager, none = generate(path, device, enforce_eager=True)
    assert none is None
    monkeypatch.setenv(STAND_IN_ENV, "1")
    tokens, graphs = generate(path, device, compilation_config={"cudagraph_capture_sizes": [1, 4]})
    assert isinstance(graphs.capturer, cuda_graphs.CudaGraphCapture if device == "cuda" else
                      cuda_graphs.StandInCapture)
    assert graphs.metadata[4].seq_lens_cpu == [1] * 4 and graphs.metadata[4].max_seq_len == 1  # as captured
    assert graphs.stats.replays_by_size == {4: MAX_TOKENS - 1}  # 3 sequences padded to 4
    assert tokens == eager
