"""Prompt logprobs and logits processors under TP and PP: the same values as one process (the prompt's
logits are gathered across TP ranks; only the last stage's sampling rank scores them)."""

import pytest

from pagoda import LLM, SamplingParams

pytestmark = pytest.mark.distributed

PROMPTS = ["The quick brown fox jumps over the lazy dog. Paged attention stores keys and values in blocks",
           "Hello, my name is"]
PARAMS = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2),
          SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logit_bias={7: 100.0})]


def run(path, **kwargs):
    with LLM(str(path), dtype="float32", kv_cache_memory=0.02, **kwargs) as llm:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    scored = [{tid: lp.logprob for tid, lp in entry.items()} if entry else None for entry in outs[0].prompt_logprobs]
    return scored, [o.outputs[0].token_ids for o in outs]


MODEL = dict(num_layers=3, num_kv_heads=1)  # uneven over 2 stages; 1 KV head, replicated over 2 TP ranks


@pytest.fixture(scope="module")
def reference(tiny_model_factory):
    return run(tiny_model_factory("llama", **MODEL))


@pytest.mark.parametrize("kwargs", [dict(tensor_parallel_size=2),
                                    dict(pipeline_parallel_size=2, max_num_batched_tokens=16)],
                         ids=["tp2", "pp2-chunked"])
def test_parallel_scores_equal_single_process(tiny_model_factory, reference, kwargs):
    scored, tokens = run(tiny_model_factory("llama", **MODEL), **kwargs)
    ref_scored, ref_tokens = reference
    assert tokens == ref_tokens and tokens[1] == [7] * 4
    assert len(scored) == len(ref_scored) and scored[0] is None
    for ours, theirs in zip(scored[1:], ref_scored[1:]):
        assert ours.keys() == theirs.keys()
        assert list(ours.values()) == pytest.approx(list(theirs.values()), abs=1e-4)
