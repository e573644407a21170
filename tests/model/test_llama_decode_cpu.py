"""The C++ decode loop (models/llama_decode_cpu) gives exactly what the Python layers give: the same kernels
in the same order, so greedy tokens and logprobs are equal, not merely close; and it stands aside for the
passes it does not run."""

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.models import llama_decode_cpu

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(not llama_decode_cpu.available(),
                       reason="the loop needs the C++ kernels and a CPU with AVX512_BF16"),
]


@pytest.fixture
def loop_calls(monkeypatch) -> list[bool]:
    """Each pure-decode pass's answer: True where the loop ran the layers."""
    calls: list[bool] = []
    real = llama_decode_cpu.decode_layers

    def counted(*args):
        result = real(*args)
        calls.append(result is not None)
        return result

    monkeypatch.setattr(llama_decode_cpu, "decode_layers", counted)
    return calls


def generate(llm: LLM, loop: bool, monkeypatch) -> list[tuple[list[int], list[dict[int, float]]]]:
    monkeypatch.setattr(llama_decode_cpu, "available", lambda: loop)
    # different lengths: decodes at different positions, contexts crossing blocks (16 tokens each)
    prompts = [{"prompt_token_ids": ids} for ids in ([5, 9, 14, 3], [7] * 30, list(range(3, 60)))]
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=4, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
            for o in outs]


# untied head; q/k/v and output biases; tied head with q/k/v biases; per-head q/k norms, GQA
@pytest.mark.parametrize("arch", ["llama", "llama-bias", "qwen2", "qwen3"])
def test_the_loop_gives_the_python_layers_results_exactly(tiny_model_factory, monkeypatch, loop_calls, arch):
    llm = LLM(str(tiny_model_factory(arch)), dtype="bfloat16", kv_cache_memory=0.05, enable_prefix_caching=False)

    in_python = generate(llm, False, monkeypatch)
    assert not any(loop_calls)
    in_one_call = generate(llm, True, monkeypatch)

    assert loop_calls.count(True) == 23  # every decode step of the second run (the first token is a prefill's)
    assert in_one_call == in_python


def test_the_loop_stands_aside_for_prefill_float32_and_tensor_parallel_layers(tiny_model_factory, monkeypatch,
                                                                               loop_calls):
    path = str(tiny_model_factory("llama"))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    LLM(path, dtype="float32", kv_cache_memory=0.05).generate("hello", params, use_tqdm=False)
    assert loop_calls and not any(loop_calls)  # weights are not packed for the bfloat16 kernel

    loop_calls.clear()
    bf16 = LLM(path, dtype="bfloat16", kv_cache_memory=0.05)
    bf16.generate("hello", params, use_tqdm=False)
    assert loop_calls == [False] + [True] * 3  # the prompt's pass is a prefill

    model = bf16.engine.executor.runner.model.model
    layers = [model.layers[i] for i in range(model.start_layer, model.end_layer)]
    assert llama_decode_cpu.DecodeStack(layers).tensors is not None
    monkeypatch.setattr(layers[-1].self_attn.o_proj, "tp_size", 2)  # as a tensor-parallel rank's layer is
    assert llama_decode_cpu.DecodeStack(layers).tensors is None


def test_a_layer_tensor_missing_from_the_list_is_a_clear_error(tiny_model_factory, monkeypatch):
    llm = LLM(str(tiny_model_factory("llama")), dtype="bfloat16", kv_cache_memory=0.05)
    llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)
    stack = llm.engine.executor.runner.model.model.cpu_decode_stack
    hidden = torch.zeros(1, 64, dtype=torch.bfloat16)
    tensors = list(stack.tensors)
    tensors[llama_decode_cpu.LAYER_SLOTS.index("qkv")] = None
    with pytest.raises(RuntimeError, match="layer 0 has no tensor in slot 1"):
        torch.ops.pagoda_llama_cpu.decode_layers(
            hidden, None, torch.zeros(1, dtype=torch.long), tensors, stack.cos_sin_cache,
            torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), torch.zeros(1, dtype=torch.long),
            *stack.sizes, stack.eps, stack.scale)
