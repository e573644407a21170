"""`pagoda bench moe`: the MoE checkpoint it writes is one transformers and Pagoda read alike (greedy tokens
equal in float32), and its decode-step profile splits the MoE layers' time into what it names."""

import pytest
from checkpoints import hf_greedy
from safetensors import safe_open

from pagoda import LLM, SamplingParams
from pagoda.bench import moe

pytestmark = pytest.mark.model

PROMPTS = ["Hello, my name is", "The capital of France is"]
SMALL = ["--hidden-size", "64", "--num-layers", "2", "--num-experts", "4", "--top-k", "2", "--intermediate-size",
         "32", "--num-heads", "4", "--num-kv-heads", "2"]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, tiny_model_factory):
    out = tmp_path_factory.mktemp("moe")
    # the tests' own small tokenizer (the default is the default model's)
    assert moe.main(["write", str(out), *SMALL, "--tokenizer", str(tiny_model_factory("llama"))]) == 0
    return out


def test_the_written_checkpoint_is_per_expert_mixtral_and_pagoda_equals_transformers(moe_dir):
    names = set()
    for file in moe_dir.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            names |= set(f.keys())
    assert {f"model.layers.1.block_sparse_moe.experts.3.w{i}.weight" for i in (1, 2, 3)} <= names
    with LLM(str(moe_dir), dtype="float32", kv_cache_memory=0.02) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(moe_dir, PROMPTS, 8)


def test_the_profile_splits_the_moe_time_into_its_parts(moe_dir, capsys):
    result = moe.profile_decode(str(moe_dir), batch=3, context=20, steps=2, dtype="float32", kv_cache_memory=0.02)
    assert result["num_steps"] == 2 and result["moe_layers"] == 2
    assert 0 < result["moe_us"] < result["step_us"]
    parts = result["by_category"]
    assert parts["routing"] > 0 and parts["expert matmuls"] > 0 and parts["gather / combine"] > 0
    assert sum(parts.values()) == pytest.approx(result["moe_us"], rel=1e-6)
    moe.print_breakdown(result)
    assert "expert matmuls" in capsys.readouterr().out


def test_write_refuses_impossible_shapes_naming_the_flag(tmp_path):
    with pytest.raises(SystemExit, match="--top-k must be <= --num-experts"):
        moe.main(["write", str(tmp_path), "--num-experts", "2", "--top-k", "4"])
