"""The C++ layer loop (models/llama_layers_cpu) gives exactly what the Python layers give: the same kernels in
the same order, so greedy tokens and logprobs are equal, not merely close; and it stands aside for the
passes it does not run."""

import pytest
import torch
from checkpoints import write_lora_adapter
from fp8_checkpoints import write_fp8_model

from pagoda import LLM, LoRARequest, SamplingParams
from pagoda.layers import attention
from pagoda.models import llama_layers_cpu

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(not llama_layers_cpu.available(),
                       reason="the loop needs the C++ kernels and a CPU with AVX512_BF16"),
]


class Passes(list):
    """Each forward pass's answer (True where the loop ran the layers), and its query lengths."""

    def __init__(self):
        super().__init__()
        self.query_lens: list[list[int]] = []

    def clear(self):
        super().clear()
        self.query_lens.clear()


@pytest.fixture
def loop_calls(monkeypatch) -> Passes:
    calls = Passes()
    real = llama_layers_cpu.run_layers

    def counted(*args):
        result = real(*args)
        calls.append(result is not None)
        calls.query_lens.append(attention.current_forward_context().metadata.query_lens_cpu)
        return result

    monkeypatch.setattr(llama_layers_cpu, "run_layers", counted)
    return calls


def generate(llm: LLM, loop: bool, monkeypatch, lora_request=None) -> list[tuple[list[int], list[dict[int, float]]]]:
    monkeypatch.setattr(llama_layers_cpu, "available", lambda: loop)
    # different lengths: decodes at different positions, contexts crossing blocks (16 tokens each); the last
    # prompt shares the first's start (a prefix-cache hit, when caching is on)
    prompts = [{"prompt_token_ids": ids} for ids in ([5, 9, 14, 3] * 5, [7] * 30, list(range(3, 60)),
                                                       [5, 9, 14, 3] * 5 + [8, 1])]
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=4, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
            for o in outs]


# untied head; q/k/v and output biases; tied head with q/k/v biases; per-head q/k norms, GQA
@pytest.mark.parametrize("arch", ["llama", "llama-bias", "qwen2", "qwen3"])
def test_the_loop_gives_the_python_layers_results_exactly(tiny_model_factory, monkeypatch, loop_calls, arch):
    llm = LLM(str(tiny_model_factory(arch)), dtype="bfloat16", kv_cache_memory=0.05, enable_prefix_caching=False)

    in_python = generate(llm, False, monkeypatch)
    assert loop_calls and not any(loop_calls)
    loop_calls.clear()
    in_one_call = generate(llm, True, monkeypatch)

    assert len(loop_calls) == 24 and all(loop_calls)  # one prefill pass, then 23 decode steps
    assert in_one_call == in_python


def test_mixed_batches_of_prefill_chunks_and_decodes_give_the_python_layers_results(tiny_model_factory, monkeypatch,
                                                                                    loop_calls):
    # 24 tokens a step: prompts go in chunks, beside the decodes of those already started
    # no prefix cache: the second run must see the first one's batches, since a row's sums may be ordered by
    # what else its batch holds (the AVX2 matmul takes one row apart from several)
    llm = LLM(str(tiny_model_factory("qwen3")), dtype="bfloat16", kv_cache_memory=0.05, max_num_batched_tokens=24,
              max_num_seqs=4, enable_prefix_caching=False)

    in_python = generate(llm, False, monkeypatch)
    loop_calls.clear()
    in_one_call = generate(llm, True, monkeypatch)

    assert all(loop_calls)
    assert any(1 in lens and max(lens) > 1 for lens in loop_calls.query_lens)  # decodes among prefill chunks
    assert in_one_call == in_python


@pytest.mark.parametrize("arch,kv_cache_dtype", [("llama", "fp8_e4m3"), ("qwen3", "fp8_e5m2")])
def test_an_fp8_cache_gives_the_python_layers_results_exactly(tiny_model_factory, monkeypatch, loop_calls, arch,
                                                              kv_cache_dtype):
    """The loop writes and reads an fp8 cache with each layer's scales. They are calibrated on the first batch
    (calculate_kv_scales), a pass the Python layers run; the loop takes every later one."""
    llm = LLM(str(tiny_model_factory(arch)), dtype="bfloat16", kv_cache_memory=0.05, enable_prefix_caching=False,
              kv_cache_dtype=kv_cache_dtype, calculate_kv_scales=True)

    in_one_call = generate(llm, True, monkeypatch)
    assert len(loop_calls) == 24 and loop_calls[0] is False and all(loop_calls[1:])
    attn = llm.engine.executor.runner.model.model.layers[0].self_attn.attn
    assert attn.kv_cache.dtype == getattr(torch, "float8_e4m3fn" if kv_cache_dtype == "fp8_e4m3" else "float8_e5m2")
    assert attn.k_scale != 1.0 and attn.v_scale != 1.0  # calibrated, so the scales must reach the loop's kernels
    loop_calls.clear()
    in_python = generate(llm, False, monkeypatch)

    assert not any(loop_calls)
    assert in_one_call == in_python


@pytest.mark.parametrize("arch,weights,kv_cache_dtype", [("llama", "online", "auto"), ("qwen2", "online", "fp8"),
                                                         ("llama", "block", "auto")])
def test_fp8_weights_give_the_python_layers_results_exactly(tiny_model_factory, tmp_path, monkeypatch, loop_calls,
                                                            arch, weights, kv_cache_dtype):
    """FP8 weights packed for fp8_matmul_cpu: the loop calls that kernel with each layer's scales and block size
    (online: one scale per row; a compressed-tensors checkpoint: [32, 16] blocks), as the layers' methods do."""
    path, kwargs = tiny_model_factory(arch), {"quantization": "fp8"}
    if weights == "block":
        write_fp8_model(path, tmp_path / "fp8", tmp_path / "dequantized", "compressed-tensors", "block", (32, 16))
        path, kwargs = tmp_path / "fp8", {}
    llm = LLM(str(path), dtype="bfloat16", kv_cache_memory=0.05, enable_prefix_caching=False,
              kv_cache_dtype=kv_cache_dtype, **kwargs)
    down = llm.engine.executor.runner.model.model.layers[0].mlp.down_proj
    assert down.qweight.dim() == 4  # packed for the kernel

    in_one_call = generate(llm, True, monkeypatch)
    assert len(loop_calls) == 24 and all(loop_calls)
    loop_calls.clear()
    in_python = generate(llm, False, monkeypatch)

    assert not any(loop_calls)
    assert in_one_call == in_python


@pytest.fixture(scope="module")
def lora_adapters(tiny_model_factory, tmp_path_factory):
    """llama-bias (q/k/v and output biases: the deltas go after them) and two PEFT adapters: rank 8 on every
    target, rank 4 on q, v and down (the others zero in its slot)."""
    base = tiny_model_factory("llama-bias")
    root = tmp_path_factory.mktemp("loop-lora")
    a = write_lora_adapter(base, root / "a", rank=8, seed=1)
    b = write_lora_adapter(base, root / "b", rank=4, seed=2, targets=("q_proj", "v_proj", "down_proj"))
    return base, LoRARequest("a", 1, str(a)), LoRARequest("b", 2, str(b))


@pytest.mark.parametrize("chunked", [False, True], ids=["one-pass", "chunked"])
def test_lora_deltas_run_in_the_loop_and_give_the_python_layers_results_exactly(lora_adapters, monkeypatch,
                                                                               loop_calls, chunked):
    """A batch mixing two adapters and the base model: every pass runs in the loop (none falls back to the
    Python layers), with the same tokens and logprobs as the Python layers' hook (the same kernel calls on the
    same rows). Adapter a's rows are not one run (index path), b's are; the prefill keeps only its last rows
    (keep_rows); chunked: prompt chunks beside decodes. The Python layers equal PeftModel in test_lora.py."""
    base, a, b = lora_adapters
    kwargs = dict(max_num_batched_tokens=24, max_num_seqs=4) if chunked else {}
    llm = LLM(str(base), dtype="bfloat16", kv_cache_memory=0.05, enable_prefix_caching=False, enable_lora=True,
              max_loras=2, max_lora_rank=8, **kwargs)
    loras = [a, None, b, a]

    in_python = generate(llm, False, monkeypatch, loras)
    assert loop_calls and not any(loop_calls)
    loop_calls.clear()
    in_one_call = generate(llm, True, monkeypatch, loras)

    assert loop_calls and all(loop_calls)
    if chunked:
        assert any(1 in lens and max(lens) > 1 for lens in loop_calls.query_lens)  # decodes among prefill chunks
    assert in_one_call == in_python
    without = generate(llm, True, monkeypatch)  # the adapters changed their rows' outputs, and no other row's
    assert [got != plain for got, plain in zip(in_one_call, without)] == [True, False, True, True]


def record_kept_rows(runner, monkeypatch) -> list[tuple[int, list[int] | None, int]]:
    """Each pass's (rows in, keep_rows given, rows out), recorded around the runner's model."""
    passes = []
    forward = runner.model.forward

    def recorded(input_ids, *args, keep_rows=None):
        hidden = forward(input_ids, *args, keep_rows=keep_rows)
        passes.append((len(input_ids), None if keep_rows is None else keep_rows.tolist(), len(hidden)))
        return hidden

    monkeypatch.setattr(runner.model, "forward", recorded)
    return passes


@pytest.mark.parametrize("loop", [True, False], ids=["loop", "python"])
def test_rows_nobody_reads_skip_the_last_layers_mlp_and_change_nothing(tiny_model_factory, monkeypatch, loop):
    """A prefill samples only its prompt's last row: the model is given those rows and returns them alone. Each
    row's sums are its own in the bfloat16 kernels, so tokens and logprobs equal a full pass's bit for bit."""
    llm = LLM(str(tiny_model_factory("qwen3")), dtype="bfloat16", kv_cache_memory=0.05, enable_prefix_caching=False)
    runner = llm.engine.executor.runner
    passes = record_kept_rows(runner, monkeypatch)
    kept = generate(llm, loop, monkeypatch)
    # the four prompts (20, 30, 57 and 22 tokens) in one pass, their last rows kept; decodes keep every row
    assert passes[0] == (129, [19, 49, 106, 128], 4)
    assert all(keep is None and rows == out for rows, keep, out in passes[1:])
    with monkeypatch.context() as every_row:
        every_row.setattr(runner, "_rows_read", lambda *args: None)
        assert generate(llm, loop, monkeypatch) == kept

    passes.clear()
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    llm.generate({"prompt_token_ids": [5, 9, 14, 3] * 5}, params, use_tqdm=False)
    assert passes[0] == (20, None, 20)  # every row is scored


@pytest.mark.parametrize("loop", [True, False], ids=["loop", "python"])
def test_a_prompts_chunks_before_its_last_keep_no_row(tiny_model_factory, monkeypatch, loop):
    llm = LLM(str(tiny_model_factory("qwen3")), dtype="bfloat16", kv_cache_memory=0.05, enable_prefix_caching=False,
              max_num_batched_tokens=16)
    runner = llm.engine.executor.runner
    monkeypatch.setattr(llama_layers_cpu, "available", lambda: loop)
    passes = record_kept_rows(runner, monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(3, 43))}

    def tokens_and_logprobs():
        out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        return out.token_ids, [{t: lp.logprob for t, lp in step.items()} for step in out.logprobs]

    kept = tokens_and_logprobs()
    assert passes[:4] == [(16, [], 0), (16, [], 0), (8, [7], 1), (1, None, 1)]
    monkeypatch.setattr(runner, "_rows_read", lambda *args: None)
    assert tokens_and_logprobs() == kept


def test_the_loop_stands_aside_for_float32_and_tensor_parallel_layers(tiny_model_factory, monkeypatch, loop_calls):
    path = str(tiny_model_factory("llama"))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    LLM(path, dtype="float32", kv_cache_memory=0.05).generate("hello", params, use_tqdm=False)
    assert loop_calls and not any(loop_calls)  # weights are not packed for the bfloat16 kernel

    loop_calls.clear()
    bf16 = LLM(path, dtype="bfloat16", kv_cache_memory=0.05)
    bf16.generate("hello", params, use_tqdm=False)
    assert loop_calls == [True] * 4

    model = bf16.engine.executor.runner.model.model
    layers = [model.layers[i] for i in range(model.start_layer, model.end_layer)]
    assert llama_layers_cpu.LayerStack(layers).tensors is not None
    monkeypatch.setattr(layers[-1].self_attn.o_proj, "tp_size", 2)  # as a tensor-parallel rank's layer is
    assert llama_layers_cpu.LayerStack(layers).tensors is None


def test_a_layer_tensor_missing_from_the_list_is_a_clear_error(tiny_model_factory):
    llm = LLM(str(tiny_model_factory("llama")), dtype="bfloat16", kv_cache_memory=0.05)
    llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)
    stack = llm.engine.executor.runner.model.model.cpu_layer_stack
    tensors = list(stack.tensors)
    tensors[llama_layers_cpu.layer_slots().index("qkv")] = None
    one = torch.ones(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="layer 0 has no tensor in slot 1"):
        torch.ops.pagoda_cpu.llama_layers(
            torch.zeros(1, 64, dtype=torch.bfloat16), None, torch.zeros(1, dtype=torch.long), tensors,
            stack.cos_sin_cache, torch.tensor([0, 1], dtype=torch.int32), one, torch.zeros(1, 1, dtype=torch.int32),
            torch.zeros(1, dtype=torch.long), True, None, None, None, None, *stack.sizes, stack.eps, stack.scale,
            None, [])
