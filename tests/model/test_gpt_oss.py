"""gpt-oss: greedy tokens equal transformers' GptOssForCausalLM (float32) on a tiny random checkpoint (sinks,
16-token sliding and full layers alternating, YaRN, biased router, clamped SwiGLU), with and without chunked
prefill; and an MXFP4 checkpoint (experts as *_blocks + *_scales, as the released ones) loads to the weights
transformers' own MXFP4 dequantization gives."""

import json
import shutil

import pytest
import torch
from checkpoints import PARITY_PROMPTS, hf_greedy

from pagoda import LLM, SamplingParams
from pagoda.models.gpt_oss import dequantize_mxfp4

pytestmark = pytest.mark.model

PROMPTS = PARITY_PROMPTS
MAX_TOKENS = 24
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def pagoda_greedy(path, **engine_kwargs):
    llm = LLM(str(path), dtype="float32", kv_cache_memory=0.02, **engine_kwargs)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    llm.engine.block_manager.check_no_leaks()
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def checkpoint(tiny_model_factory):
    path = tiny_model_factory("gpt-oss")
    return path, hf_greedy(path, PROMPTS, MAX_TOKENS)


def test_matches_transformers(checkpoint):
    path, reference = checkpoint
    assert len({tuple(r) for r in reference}) == len(PROMPTS)  # not degenerate
    _, got = pagoda_greedy(path)
    assert got == reference


def test_matches_transformers_with_chunked_prefill_and_prefix_hits(checkpoint):
    """7 tokens a step: prompts straddle the 16-token window in chunks, decodes in between; then again from the
    prefix cache."""
    path, reference = checkpoint
    llm, got = pagoda_greedy(path, max_num_batched_tokens=7)
    assert got == reference
    again = llm.generate(PROMPTS[::-1], PARAMS, use_tqdm=False)[::-1]
    assert llm.engine.get_stats().prefix_cache_hits > 0
    assert [o.outputs[0].token_ids for o in again] == reference


def test_sinks_are_read(checkpoint, tmp_path):
    """The same checkpoint with every sink far below the scores gives other tokens: the sinks are not ignored."""
    from safetensors.torch import load_file, save_file

    path, reference = checkpoint
    shutil.copytree(path, tmp_path / "m")
    tensors = load_file(str(path / "model.safetensors"))
    save_file({k: torch.full_like(v, -1e4) if k.endswith(".sinks") else v for k, v in tensors.items()},
              str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
    _, got = pagoda_greedy(tmp_path / "m")
    assert got != reference


def _mxfp4(shape, generator):
    """Random MXFP4 blocks [..., G, 16] and scales [..., G] for an [..., G * 32] weight, values about 0.1."""
    blocks = torch.randint(0, 256, (*shape[:-1], shape[-1] // 32, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(122, 126, (*shape[:-1], shape[-1] // 32), dtype=torch.uint8, generator=generator)
    return blocks, scales


def test_dequantize_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _mxfp4((3, 8, 64), torch.Generator().manual_seed(0))
    ours = dequantize_mxfp4(blocks, scales, torch.float32)  # [E, out, in]
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2))
    assert ours.abs().max() > 0


def test_mxfp4_checkpoint_matches_transformers_on_its_dequantized_weights(tiny_model_factory, tmp_path):
    """Experts stored as MXFP4 (config quant_method mxfp4): Pagoda's tokens equal transformers' on a float
    checkpoint holding transformers' dequantization of the same blocks and scales."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    source = tiny_model_factory("gpt-oss")
    tensors = load_file(str(source / "model.safetensors"))
    quantized, dequantized = dict(tensors), dict(tensors)
    generator = torch.Generator().manual_seed(1)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inputs, outputs = tensors[name].shape  # transformers' layout: [E, in, out]
        blocks, scales = _mxfp4((experts, outputs, inputs), generator)
        del quantized[name]
        quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
        dequantized[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    for out, weights in (("mxfp4", quantized), ("float", dequantized)):
        shutil.copytree(source, tmp_path / out)
        save_file(weights, str(tmp_path / out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "mxfp4" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "lm_head"]}
    (tmp_path / "mxfp4" / "config.json").write_text(json.dumps(config))

    _, got = pagoda_greedy(tmp_path / "mxfp4")
    assert got == hf_greedy(tmp_path / "float", PROMPTS, MAX_TOKENS)
