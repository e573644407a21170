"""The engine's prompt-token count (the stats line's prompt throughput, `pagoda:prompt_tokens_total`) follows
vLLM's "prefill tokens processed": a request's prompt is counted once its prefill is done (its first token
sampled), whole (prefix-cached tokens included) and once (n > 1 outputs share it), not when it arrives."""

import pytest

from pagoda import LLM, SamplingParams

pytestmark = pytest.mark.model

PROMPT = "Continuous batching lets new requests join between steps, and chunked prefill splits long prompts. " * 2


def _step_until_first_token(engine, request_id: str) -> int:
    """Steps until the request's first token; how many steps it took."""
    for steps in range(1, 100):
        outs = [o for o in engine.step() if o.request_id == request_id]
        if outs and outs[0].outputs[0].token_ids:
            return steps
    raise AssertionError("no first token in 100 steps")


def test_a_prompt_is_counted_when_its_prefill_is_done_not_when_it_arrives(tiny_llama_dir):
    with LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory=0.02, max_num_batched_tokens=16) as llm:
        engine = llm.engine
        params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
        prompt_ids = engine.process_prompt(PROMPT, params)[1]
        assert len(prompt_ids) > 2 * 16  # three or more chunks of 16
        engine.add_request("a", PROMPT, params)
        assert engine.get_stats().prompt_tokens == 0  # arrived, not computed
        engine.step()
        assert engine.get_stats().prompt_tokens == 0  # its first chunk only
        assert _step_until_first_token(engine, "a") > 1
        assert engine.get_stats().prompt_tokens == len(prompt_ids)
        while engine.has_unfinished_requests():  # its decodes add no prompt tokens
            engine.step()
        assert engine.get_stats().prompt_tokens == len(prompt_ids)

        # n = 2 outputs of one prompt: counted once; the prompt again, from the prefix cache: counted whole
        two = SamplingParams(max_tokens=4, ignore_eos=True, n=2, temperature=1.0, seed=1)
        outs = llm.generate([PROMPT], two, use_tqdm=False)
        assert len(outs[0].outputs) == 2
        assert engine.get_stats().prompt_tokens == 2 * len(prompt_ids)
        assert engine.get_stats().prefix_cache_hits > 0
