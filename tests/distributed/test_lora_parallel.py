"""LoRA under TP=2 (A/B sharded as vLLM shards them: column-parallel layers split B's rows, row-parallel
layers A's columns, their partial deltas joining the all-reduce) and PP=2 (each stage loads its layers'
adapter weights): greedy tokens of a batch mixing two adapters and the base model equal PeftModel's."""

import pytest
from checkpoints import peft_greedy, write_lora_adapter

from pagoda import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.distributed

PROMPTS = ["Hello, my name is", "The quick brown fox jumps over the lazy dog. Paged attention stores keys"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tiny_model_factory, tmp_path_factory):
    # 3 layers (uneven over 2 stages), 1 KV head (fewer than 2 TP ranks: replicated, B's k/v rows on both)
    base = tiny_model_factory("llama", num_layers=3, num_kv_heads=1)
    root = tmp_path_factory.mktemp("lora-parallel")
    a = write_lora_adapter(base, root / "a", rank=8, seed=11)
    b = write_lora_adapter(base, root / "b", rank=4, seed=12, targets=("k_proj", "o_proj", "up_proj", "down_proj"))
    reference = {name: peft_greedy(base, path, PROMPTS, PARAMS.max_tokens)
                 for name, path in (("base", None), ("a", a), ("b", b))}
    return base, LoRARequest("a", 1, str(a)), LoRARequest("b", 2, str(b)), reference


@pytest.mark.parametrize("kwargs", [
    dict(tensor_parallel_size=2),
    dict(pipeline_parallel_size=2, max_num_batched_tokens=16),
    dict(data_parallel_size=2),  # each DP rank loads the adapters its requests bring
], ids=["tp2", "pp2-chunked", "dp2"])
def test_parallel_lora_equals_peft(setup, kwargs):
    base, a, b, reference = setup
    prompts, loras, expected = [], [], []
    for i, prompt in enumerate(PROMPTS):
        for name, lora in (("a", a), ("base", None), ("b", b)):
            prompts.append(prompt)
            loras.append(lora)
            expected.append(reference[name][i])
    llm = LLM(str(base), dtype="float32", kv_cache_memory=0.02, enable_lora=True, max_loras=2, max_lora_rank=8,
              **kwargs)
    try:
        outs = llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=loras)
        assert [o.outputs[0].token_ids for o in outs] == expected
        llm.engine.block_manager.check_no_leaks()
    finally:
        llm.engine.shutdown()
