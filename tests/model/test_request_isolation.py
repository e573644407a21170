"""One request's failure inside a step finishes that request alone; the engine, and every other request
in the same batch, go on. Lifecycle of the async engine: shutdown, context managers."""

import asyncio

import pytest

from pagoda import LLM, AsyncEngineArgs, AsyncLLMEngine, SamplingParams
from pagoda.errors import RequestFailed
from pagoda.worker.model_runner import ModelRunner

pytestmark = pytest.mark.model

DOOMED_SEED = 13


def test_a_failure_tied_to_one_sequence_fails_only_its_request(tiny_llama_dir, monkeypatch):
    real = ModelRunner.new_generator

    def new_generator(self, seed):
        if seed == DOOMED_SEED:
            raise RuntimeError("injected generator failure")
        return real(self, seed)

    monkeypatch.setattr(ModelRunner, "new_generator", new_generator)
    with LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory=0.02) as llm:
        params = [SamplingParams(max_tokens=8, ignore_eos=True, seed=s) for s in (1, DOOMED_SEED, 2)]
        outs = llm.generate(["Hello", "Hello there", "Paris is"], params, use_tqdm=False)
        assert [o.outputs[0].finish_reason for o in outs] == ["length", "error", "length"]
        assert "injected generator failure" in outs[1].error and outs[0].error is None
        assert [len(o.outputs[0].token_ids) for o in (outs[0], outs[2])] == [8, 8]
        # the engine goes on, its blocks all free
        again = llm.generate(["Hello"], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert len(again[0].outputs[0].token_ids) == 4
        llm.engine.block_manager.check_no_leaks()
        assert llm.engine.get_stats().finished_reasons.get("error") == 1


def test_async_engine_raises_request_failed_for_that_request_only(tiny_llama_dir, monkeypatch):
    real = ModelRunner.new_generator
    monkeypatch.setattr(ModelRunner, "new_generator",
                        lambda self, seed: (_ for _ in ()).throw(RuntimeError("boom")) if seed == DOOMED_SEED
                        else real(self, seed))

    async def run():
        args = AsyncEngineArgs(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory=0.02)
        async with AsyncLLMEngine.from_engine_args(args) as engine:
            async def collect(request_id, seed):
                last = None
                async for out in engine.generate("Hello", SamplingParams(max_tokens=6, ignore_eos=True, seed=seed),
                                                 request_id):
                    last = out
                return last

            results = await asyncio.gather(collect("ok", 1), collect("bad", DOOMED_SEED), return_exceptions=True)
            assert results[0].finished and len(results[0].outputs[0].token_ids) == 6
            assert isinstance(results[1], RequestFailed) and "boom" in str(results[1])
            assert engine.is_running
        assert not engine.is_running  # the context manager shut it down
        engine.shutdown()  # idempotent

    asyncio.run(run())
