"""AsyncLLMEngine: built in its own engine thread (torch's CPU thread pool lives there alone), load
errors reach the caller, cumulative outputs stream, an explicit abort ends the stream, and dropping the
last reference shuts the engine down."""

import asyncio
import threading
import weakref

import pytest

from pagoda import AsyncEngineArgs, AsyncLLMEngine, SamplingParams
from pagoda.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def engine_args(tiny_model_factory):
    return AsyncEngineArgs(model=str(tiny_model_factory("llama")), dtype="float32", kv_cache_memory=0.02)


def test_the_engine_is_built_in_the_engine_thread(engine_args, monkeypatch):
    built_in = []
    real_init = LLMEngine.__init__

    def recording_init(self, config):
        built_in.append(threading.current_thread().name)
        real_init(self, config)

    monkeypatch.setattr(LLMEngine, "__init__", recording_init)
    engine = AsyncLLMEngine.from_engine_args(engine_args)
    try:
        assert built_in == ["pagoda-engine"] and engine.is_running
    finally:
        engine.shutdown()


def test_a_load_error_reaches_the_caller(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=str(tmp_path / "missing")))


def test_outputs_stream_and_an_abort_ends_the_stream(engine_args):
    engine = AsyncLLMEngine.from_engine_args(engine_args)

    async def run():
        lengths = []
        async for out in engine.generate("Hello, my name is", SamplingParams(max_tokens=6, ignore_eos=True), "a"):
            lengths.append(len(out.outputs[0].token_ids))
        aborted = []
        async for out in engine.generate("Paged attention", SamplingParams(max_tokens=500, ignore_eos=True), "b"):
            aborted.append(out)
            if len(aborted) == 2:
                await engine.abort("b")
        return lengths, aborted[-1]

    try:
        lengths, last = asyncio.run(asyncio.wait_for(run(), timeout=60))
    finally:
        engine.shutdown()
    assert lengths[-1] == 6 and lengths == sorted(lengths)
    assert last.finished and last.outputs[0].finish_reason == "abort" and len(last.outputs[0].token_ids) < 500
    engine.engine.block_manager.check_no_leaks()


def test_dropping_the_last_reference_shuts_the_engine_down(engine_args, monkeypatch):
    shut_down = []
    real_shutdown = LLMEngine.shutdown

    def recording_shutdown(self):
        shut_down.append(threading.current_thread().name)
        real_shutdown(self)

    monkeypatch.setattr(LLMEngine, "shutdown", recording_shutdown)
    engine = AsyncLLMEngine.from_engine_args(engine_args)

    async def one(engine):
        outputs = [out async for out in engine.generate("Hello", SamplingParams(max_tokens=2, ignore_eos=True), "x")]
        return outputs[-1]

    assert asyncio.run(asyncio.wait_for(one(engine), timeout=60)).finished
    thread, collected = engine._thread, weakref.ref(engine)
    del engine  # no gc.collect(): the engine thread must not keep it alive
    thread.join(timeout=30)
    assert not thread.is_alive(), "the engine thread outlived its AsyncLLMEngine"
    assert collected() is None
    assert len(shut_down) == 1


def test_a_request_id_taken_while_the_prompt_is_tokenized_is_refused(engine_args):
    """Two requests sent at once with one id: the second is refused and the first streams to its end (it
    used to lose its outputs to the second's queue). generate is both async engines' (engine/async_base.py)."""
    with AsyncLLMEngine.from_engine_args(engine_args) as engine:
        params = SamplingParams(max_tokens=4, ignore_eos=True)

        async def one():
            return [out async for out in engine.generate("Hello, my name is", params, "same")][-1]

        async def run():
            return await asyncio.gather(one(), one(), return_exceptions=True)

        results = asyncio.run(asyncio.wait_for(run(), timeout=30))
        refused = [r for r in results if isinstance(r, ValueError)]
        done = [r for r in results if not isinstance(r, BaseException)]
        assert len(refused) == 1 and "already running" in str(refused[0]), results
        assert len(done) == 1 and done[0].finished and len(done[0].outputs[0].token_ids) == 4
        assert engine.num_unfinished_requests == 0 and engine.is_running
