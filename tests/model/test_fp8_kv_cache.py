"""fp8 KV cache (kv_cache_dtype="fp8" | "fp8_e4m3" | "fp8_e5m2") through the public API on tiny checkpoints.

Exactness: with scales of 1.0, the fp8-cache engine (float32 model) is transformers with its keys (after
rotary) and values rounded through fp8, token for token: every attention read in Pagoda goes through the
cache, so this is exactly what it computes. Against the float engine the tolerance is statistical (below).
The same exact tokens with swap, prefix-cache hits, chunked prefill and speculative decoding (ngram and a
draft model, whose cache is fp8 too)."""

import pytest
import torch
from checkpoints import _CORPUS, load_hf_reference
from safetensors.torch import load_file, save_file
from test_hf_parity import MAX_TOKENS, PROMPTS, pagoda_greedy

from pagoda import LLM, SamplingParams
from pagoda.layers.quantization.kv_scales import K_SCALE_TARGET, quantize

pytestmark = pytest.mark.model

FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FLOAT32_BLOCK_BYTES = 8192  # the tiny llama's KV block of 16 tokens, float32 (2 layers x 2 x 16 x 2 x 16 x 4)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def hf_greedy_fp8_kv(path, arch_module, fp8, prompts=PROMPTS, max_tokens=MAX_TOKENS):
    """transformers' greedy tokens with K (after rotary) and V rounded through fp8 at scale 1.0."""
    import importlib

    from transformers import AutoTokenizer

    module = importlib.import_module(f"transformers.models.{arch_module}.modeling_{arch_module}")
    rotary = module.apply_rotary_pos_emb
    round_fp8 = lambda t: quantize(t, 1.0, fp8).to(t.dtype)  # noqa: E731

    def rotary_then_round(q, k, *args, **kwargs):
        q, k = rotary(q, k, *args, **kwargs)
        return q, round_fp8(k)

    tok = AutoTokenizer.from_pretrained(path)
    model = load_hf_reference(path)
    for layer in model.model.layers:
        layer.self_attn.v_proj.register_forward_hook(lambda mod, inputs, out: round_fp8(out))
    module.apply_rotary_pos_emb = rotary_then_round
    try:
        outs = []
        for prompt in prompts:
            ids = tok(prompt, return_tensors="pt").input_ids
            gen = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(gen[0, ids.shape[1]:].tolist())
        return outs
    finally:
        module.apply_rotary_pos_emb = rotary


@pytest.fixture(scope="module")
def reference(tiny_model_factory):
    cache = {}

    def get(arch, kv_cache_dtype):
        key = (arch, FP8[kv_cache_dtype])
        if key not in cache:
            cache[key] = hf_greedy_fp8_kv(tiny_model_factory(arch), arch, FP8[kv_cache_dtype])
        return cache[key]

    return get


@pytest.mark.parametrize("arch,kv_cache_dtype", [("llama", "fp8"), ("llama", "fp8_e5m2"), ("qwen2", "fp8_e4m3")])
def test_equals_transformers_with_kv_rounded_through_fp8(tiny_model_factory, reference, arch, kv_cache_dtype):
    llm, got = pagoda_greedy(tiny_model_factory(arch), kv_cache_dtype=kv_cache_dtype)
    assert llm.engine.executor.runner.kv_caches[0].dtype == FP8[kv_cache_dtype]
    assert got == reference(arch, kv_cache_dtype)
    _, float_tokens = pagoda_greedy(tiny_model_factory(arch))
    assert got != float_tokens  # the rounding is real: these random models' greedy paths hinge on it


@pytest.mark.parametrize("engine_kwargs", [
    dict(max_num_batched_tokens=7),  # every prompt chunked: chunks read the earlier chunks' fp8 blocks
    dict(max_model_len=160, kv_cache_memory=10 * FLOAT32_BLOCK_BYTES / 4 / 2**30, preemption_mode="swap",
         swap_space=64 * FLOAT32_BLOCK_BYTES / 4 / 2**30),
    dict(speculative_config=NGRAM),
    dict(speculative_config={"model": "SELF", "num_speculative_tokens": 3}),
], ids=["chunked-prefill", "swap", "ngram-spec", "draft-model-spec"])
def test_same_tokens_with_swap_chunking_and_speculation(tiny_model_factory, reference, engine_kwargs):
    path = tiny_model_factory("llama")
    spec = engine_kwargs.get("speculative_config")
    if spec is not None and spec.get("model") == "SELF":
        engine_kwargs = dict(engine_kwargs, speculative_config=dict(spec, model=str(path)))
    # the prompts twice: the second copies hit the prefix cache's fp8 blocks
    llm, got = pagoda_greedy(path, PROMPTS * 2, kv_cache_dtype="fp8", **engine_kwargs)
    assert got == reference("llama", "fp8") * 2
    stats = llm.engine.get_stats()
    assert stats.prefix_cache_hits > 0 or "swap_space" in engine_kwargs  # ten blocks keep no prefix around
    if "swap_space" in engine_kwargs:
        assert llm.engine.num_blocks == 10 and stats.num_swapped_out > 0
        assert llm.engine.executor.runner.kv_cache.swap_caches[0].dtype == torch.float8_e4m3fn
    if spec is not None:
        assert stats.spec_decode_num_drafts > 0
    if spec is not None and "model" in spec:
        assert llm.engine.executor.runner.drafter.kv_cache.caches[0].dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("dtype,factor", [("bfloat16", 2), ("float32", 4)])
def test_block_count_doubles_against_bfloat16(tiny_model_factory, dtype, factor):
    path = tiny_model_factory("llama")
    counts = {}
    for kv_cache_dtype in ("auto", "fp8", "fp8_e5m2"):
        llm = LLM(str(path), dtype=dtype, kv_cache_memory=0.01, kv_cache_dtype=kv_cache_dtype)
        counts[kv_cache_dtype] = llm.engine.num_blocks
        llm.engine.shutdown()
    budget_blocks = 0.01 * 2**30 // (FLOAT32_BLOCK_BYTES / 4)  # blocks of one byte per element
    assert counts["fp8"] == counts["fp8_e5m2"] == budget_blocks
    assert counts["auto"] == budget_blocks // factor


TEXT = " ".join(_CORPUS[:5]) * 2  # ~360 tokens


def teacher_forced(path, **engine_kwargs):
    """(log-prob of each next token of TEXT, the top-1 token at each position) with the engine's cache."""
    llm = LLM(str(path), dtype="float32", kv_cache_memory=0.02, max_num_batched_tokens=64, **engine_kwargs)
    out = llm.generate([TEXT], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    llm.engine.shutdown()
    ids = out.prompt_token_ids
    logprobs = [out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
    top = [next(t for t, lp in out.prompt_logprobs[i].items() if lp.rank == 1) for i in range(1, len(ids))]
    return torch.tensor(logprobs), torch.tensor(top)


@pytest.mark.parametrize("kv_cache_dtype,calculate_kv_scales,max_mean_shift,min_top1_agreement", [
    ("fp8", False, 0.5, 0.65), ("fp8", True, 0.5, 0.65), ("fp8_e5m2", False, 0.9, 0.5),
])
def test_close_to_the_float_cache(tiny_model_factory, kv_cache_dtype, calculate_kv_scales, max_mean_shift,
                                  min_top1_agreement):
    """Tolerance: measured on these checkpoints, the mean |shift| of the next-token log-prob over ~360 positions
    of a fixed text is 0.35 nats with e4m3 (either scale) and 0.63 with e5m2, top-1 agreement 76-79% and
    57-64%. These random models hinge on every activation (casting the whole model to bfloat16 already shifts
    them by 0.08 nats), so the bounds sit ~1.4x above the measured shifts (e5m2: one mantissa bit less, twice
    the rounding error of e4m3): a scale applied twice, or keys read unscaled, moves them by several nats."""
    path = tiny_model_factory("llama")
    float_lp, float_top = teacher_forced(path)
    fp8_lp, fp8_top = teacher_forced(path, kv_cache_dtype=kv_cache_dtype, calculate_kv_scales=calculate_kv_scales)
    assert (fp8_lp - float_lp).abs().mean() < max_mean_shift
    assert (fp8_top == float_top).float().mean() > min_top1_agreement


def test_checkpoint_kv_scales_are_loaded_and_used_only_by_an_fp8_cache(tiny_model_factory, tmp_path):
    import shutil

    path = tmp_path / "with-scales"
    shutil.copytree(tiny_model_factory("llama"), path)
    tensors = load_file(path / "model.safetensors")
    # compressed-tensors' names on layer 0, the older single kv_scale on layer 1
    # not powers of two: fp8 is a float format, so those would only shift exponents and round nothing differently
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.3)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor([0.7])
    tensors["model.layers.1.self_attn.kv_scale"] = torch.tensor(0.11)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})

    _, plain = pagoda_greedy(tiny_model_factory("llama"))
    llm, got = pagoda_greedy(path)  # auto cache: the scales are read and ignored
    assert got == plain
    llm, fp8_tokens = pagoda_greedy(path, kv_cache_dtype="fp8")
    layers = llm.engine.executor.runner.attention_layers
    assert [s for a in layers for s in (a.k_scale, a.v_scale)] == pytest.approx([0.3, 0.7, 0.11, 0.11])
    _, unscaled = pagoda_greedy(tiny_model_factory("llama"), kv_cache_dtype="fp8")
    assert fp8_tokens != unscaled


def test_calculate_kv_scales_calibrates_each_layer_once(tiny_model_factory):
    llm = LLM(str(tiny_model_factory("llama")), dtype="float32", kv_cache_memory=0.02, kv_cache_dtype="fp8",
              calculate_kv_scales=True)
    layers = llm.engine.executor.runner.attention_layers
    assert all(a.calculate_kv_scales for a in layers)
    llm.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    scales = [(a.k_scale, a.v_scale) for a in layers]
    assert not any(a.calculate_kv_scales for a in layers)
    assert all(k != 1.0 and v != 1.0 for k, v in scales)
    assert all(k * K_SCALE_TARGET <= 448 for k, _ in scales)
    llm.generate(PROMPTS[2:], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert [(a.k_scale, a.v_scale) for a in layers] == scales  # calibrated once, on the first batch


def test_bad_kv_cache_dtype_and_scales_without_fp8_are_refused(tiny_model_factory):
    from pagoda.errors import InvalidParam

    with pytest.raises(InvalidParam, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2"):
        LLM(str(tiny_model_factory("llama")), kv_cache_dtype="int8")
    with pytest.raises(InvalidParam, match="calculate_kv_scales applies to an fp8 KV cache"):
        LLM(str(tiny_model_factory("llama")), calculate_kv_scales=True)
