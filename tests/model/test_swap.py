"""Swap space on a real (tiny) model: greedy tokens equal transformers' under heavy preemption whether
preempted sequences are swapped or recomputed, and when the swap space is too small for all of them."""

import pytest
from checkpoints import hf_greedy
from test_hf_parity import MAX_TOKENS, PROMPTS, pagoda_greedy

pytestmark = pytest.mark.model

BLOCK_BYTES = 8192  # the tiny llama's KV block of 16 tokens, float32


@pytest.fixture(scope="module")
def reference(tiny_model_factory):
    return hf_greedy(tiny_model_factory("llama"), PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("mode,swap_blocks", [("swap", 64), ("swap", 1), ("recompute", 0)],
                         ids=["swap", "swap-space-full", "recompute"])
def test_matches_transformers_under_heavy_preemption(tiny_model_factory, reference, mode, swap_blocks):
    llm, got = pagoda_greedy(tiny_model_factory("llama"), max_model_len=160, kv_cache_memory=10 * BLOCK_BYTES / 2**30,
                             preemption_mode=mode, swap_space=swap_blocks * BLOCK_BYTES / 2**30)
    stats = llm.engine.get_stats()
    assert llm.engine.num_blocks == 10 and stats.num_swap_blocks_total == swap_blocks
    assert stats.num_preemptions > 0
    if swap_blocks == 64:  # room for every victim: nothing recomputed
        assert stats.num_swapped_out > 0 and stats.num_swapped_in == stats.num_swapped_out
        assert stats.num_recomputed == 0
    else:  # no swap space (recompute), or too little for the victim's blocks: it falls back to recompute
        assert stats.num_swapped_out == 0 and stats.num_recomputed > 0
    assert stats.num_swap_blocks_used == 0  # pagoda_greedy checked that no device or host block leaked
    assert got == reference
