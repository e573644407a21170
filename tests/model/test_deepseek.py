"""DeepSeek-V2 and -V3: greedy tokens equal transformers' DeepseekV2/V3ForCausalLM (float32) on tiny random
checkpoints (MLA over the latent cache, YaRN with mscale on V2, q_lora on V3, grouped routing of each version,
shared experts, a dense first layer), with and without chunked prefill; the latent cache's bytes per token
against K and V per head; MTP layers skipped."""

import shutil

import pytest
import torch
from checkpoints import PARITY_PROMPTS, hf_greedy

from pagoda import LLM, SamplingParams
from pagoda.models.deepseek import MLAAttention

pytestmark = pytest.mark.model

PROMPTS = PARITY_PROMPTS
MAX_TOKENS = 24
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
ARCHS = ["deepseek-v2", "deepseek-v3"]


def pagoda_greedy(path, **engine_kwargs):
    llm = LLM(str(path), dtype="float32", kv_cache_memory=0.02, **engine_kwargs)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    llm.engine.block_manager.check_no_leaks()
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def checkpoint(tiny_model_factory):
    cache = {}

    def get(arch):
        if arch not in cache:
            path = tiny_model_factory(arch, num_kv_heads=4)  # MLA: as many "KV heads" as heads in transformers
            cache[arch] = path, hf_greedy(path, PROMPTS, MAX_TOKENS)
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_matches_transformers(checkpoint, arch):
    path, reference = checkpoint(arch)
    assert len({tuple(r) for r in reference}) == len(PROMPTS)  # not degenerate
    llm, got = pagoda_greedy(path)
    assert got == reference
    assert sum(sum(c) for c in llm.engine.get_stats().expert_tokens.values()) > 0  # the MoE layer routed


@pytest.mark.parametrize("arch", ARCHS)
def test_matches_transformers_with_chunked_prefill_and_prefix_hits(checkpoint, arch):
    path, reference = checkpoint(arch)
    llm, got = pagoda_greedy(path, max_num_batched_tokens=7)
    assert got == reference
    again = llm.generate(PROMPTS[::-1], PARAMS, use_tqdm=False)[::-1]
    assert llm.engine.get_stats().prefix_cache_hits > 0
    assert [o.outputs[0].token_ids for o in again] == reference


def test_the_latent_cache_holds_one_row_per_token_and_layer(checkpoint):
    """Per token and layer the cache holds kv_lora_rank + qk_rope_head_dim values (32 + 8), where K and V per
    head would be heads * (qk_nope + qk_rope + v) = 4 * (16 + 8 + 16): 4x smaller here, 71x at V3's shape."""
    path, _ = checkpoint("deepseek-v3")
    llm = LLM(str(path), dtype="float32", kv_cache_memory=0.02)
    runner = llm.engine.executor.runner
    layers = [m for m in runner.model.modules() if isinstance(m, MLAAttention)]
    assert len(layers) == 2
    block_size = runner.block_size
    assert all(tuple(layer.kv_cache.shape[::2]) == (1, block_size, 40) and layer.kv_cache.shape[3] == 1
               for layer in layers)
    per_token_per_layer = runner.kv_cache.bytes_per_block() // block_size // 2
    assert per_token_per_layer == (32 + 8) * 4
    assert 4 * (16 + 8 + 16) * 4 == 4 * per_token_per_layer  # K and V per head, float32
    # DeepSeek-V3's own shape: 128 heads, 512 + 64 latent, 128 + 64 / 128 K and V head sizes
    assert 128 * (128 + 64 + 128) / (512 + 64) > 71


def test_mtp_layers_in_the_checkpoint_are_skipped(checkpoint, tmp_path, caplog):
    from safetensors.torch import load_file, save_file

    path, reference = checkpoint("deepseek-v3")
    shutil.copytree(path, tmp_path / "m")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.2.eh_proj.weight"] = torch.randn(64, 128)  # layer num_hidden_layers: the MTP module
    tensors["model.layers.2.self_attn.kv_b_proj.weight"] = torch.randn(128, 32)
    save_file(tensors, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level("INFO"):
        _, got = pagoda_greedy(tmp_path / "m")
    assert got == reference
    assert "MTP layer(s) in the checkpoint are skipped" in caplog.text


def test_an_fp8_latent_cache_is_refused_by_name(checkpoint):
    from pagoda.errors import InvalidParam

    path, _ = checkpoint("deepseek-v2")
    with pytest.raises(InvalidParam, match="kv_cache_dtype 'fp8' is not supported for DeepseekV2ForCausalLM"):
        LLM(str(path), dtype="float32", kv_cache_memory=0.02, kv_cache_dtype="fp8")
