"""The vLLM tutorial snippet, verbatim with s/vllm/pagoda/, on the default model; the periodic stats line
when an engine runs with disable_log_stats=False."""

import asyncio
import logging

import pytest

from pagoda import LLM, SamplingParams

pytestmark = pytest.mark.model


def test_the_tutorial_snippet_runs_verbatim():
    from pagoda import AsyncEngineArgs, AsyncLLMEngine

    engine_args = AsyncEngineArgs(block_size=16, max_num_batched_tokens=8192, max_num_seqs=256,
                                  gpu_memory_utilization=0.95, swap_space=4, enable_prefix_caching=True,
                                  disable_log_stats=False)
    engine = AsyncLLMEngine.from_engine_args(engine_args)
    try:
        async def run():
            final = None
            async for out in engine.generate("The capital of France is",
                                             SamplingParams(temperature=0, max_tokens=8), "tutorial-0"):
                final = out
            return final

        out = asyncio.run(run())
        assert out.finished and len(out.outputs[0].token_ids) == 8
        cfg = engine.config
        assert cfg.cache.swap_space_gib == 4 and cfg.cache.preemption_mode == "swap" and cfg.log_stats
        assert engine.engine.stats_logger is not None
    finally:
        engine.shutdown()


def test_stats_lines_are_logged_while_generating_and_not_when_disabled(tiny_model_factory, caplog):
    path = str(tiny_model_factory("llama"))
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    with caplog.at_level(logging.INFO, logger="pagoda.stats"):
        with LLM(path, dtype="float32", kv_cache_memory=0.02) as llm:  # LLM's default: off, as vLLM's
            llm.generate(["Hello, my name is"] * 4, params, use_tqdm=False)
        assert "Avg generation throughput" not in caplog.text
        with LLM(path, dtype="float32", kv_cache_memory=0.02, disable_log_stats=False,
                 stats_log_interval=0.001) as llm:
            llm.generate(["Hello, my name is"] * 4, params, use_tqdm=False)
    lines = [r.getMessage() for r in caplog.records if r.name == "pagoda.stats"]
    assert lines and all("Avg prompt throughput" in line and "KV cache usage" in line for line in lines)
    assert any("Running: 4 reqs" in line for line in lines)
