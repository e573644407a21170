"""vLLM 0.32's admission knobs in a whole engine (core/step_limits.py): greedy answers are the same tokens with
them as without, every request finishes, and no KV block leaks."""

import pytest

from pagoda import LLM, SamplingParams

pytestmark = pytest.mark.model

PROMPTS = ["Hello " * n for n in (3, 40, 9, 70, 1, 25)]


def answers(model_dir, **knobs):
    with LLM(str(model_dir), dtype="float32", kv_cache_memory=0.02, max_num_batched_tokens=64, **knobs) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True, temperature=0), use_tqdm=False)
        llm.engine.block_manager.check_no_leaks()
        return [o.outputs[0].token_ids for o in outs]


def test_the_knobs_change_when_work_runs_not_what_it_computes(tiny_llama_dir):
    plain = answers(tiny_llama_dir)
    assert all(len(tokens) == 12 for tokens in plain)
    assert answers(tiny_llama_dir, max_num_active_seqs=2, max_num_scheduled_tokens=48, watermark=0.2,
                   long_prefill_token_threshold=16, long_prefill_token_threshold_adaptive=True,
                   prefill_schedule_interval=3) == plain
    assert answers(tiny_llama_dir, scheduler_reserve_full_isl=False, long_prefill_token_threshold=16) == plain
