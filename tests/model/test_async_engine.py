"""AsyncLLMEngine: built in its own engine thread (torch's CPU thread pool lives there alone), load
errors reach the caller, cumulative outputs stream, an explicit abort ends the stream, and dropping the
last reference shuts the engine down. Both async engines (this and the engine core's client): a step's outputs
wake a caller's event loop once, and a request whose caller's event loop has closed is aborted."""

import asyncio
import threading
import time
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


def _async_engine(kind: str, engine_args):
    """One of the two async engines: in-process (an engine thread) or the engine core's client."""
    if kind == "thread":
        return AsyncLLMEngine.from_engine_args(engine_args)
    from pagoda.engine.core_client import AsyncMPEngine

    return AsyncMPEngine.from_engine_args(engine_args)


@pytest.mark.parametrize("kind", ["thread", "core-process"])
def test_a_steps_outputs_wake_an_event_loop_once(engine_args, kind):
    """Streams served by one event loop get a step's outputs in one wake-up (a write to the loop's self-pipe
    each), not one per stream; every stream still gets every output."""
    with _async_engine(kind, engine_args) as engine:
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        loop = asyncio.new_event_loop()
        wake_ups = []
        real = loop.call_soon_threadsafe

        def counting(callback, *args, **kwargs):
            wake_ups.append((threading.current_thread().name, getattr(callback, "__qualname__", repr(callback))))
            return real(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counting

        async def one(request_id):
            return [len(out.outputs[0].token_ids) async for out in engine.generate("Hello, my name is", params,
                                                                                   request_id)]

        async def run():
            return await asyncio.gather(*(one(f"r{i}") for i in range(4)))

        try:
            streams = loop.run_until_complete(asyncio.wait_for(run(), timeout=60))
        finally:
            loop.close()
        assert all(lengths[-1] == 8 and lengths == sorted(lengths) for lengths in streams), streams
        # what delivers outputs (not asyncio.to_thread's futures, each prompt being tokenized on a worker)
        deliveries = sum(name in ("_put_all", "Queue.put_nowait") for _, name in wake_ups)
        steps = sum(engine.get_stats().iteration_tokens_counts)
        # 4 prompts of one length are admitted in a step, then decode together: ~9 steps of 4 outputs each
        assert 0 < deliveries <= steps, (deliveries, steps, wake_ups)


@pytest.mark.parametrize("kind", ["thread", "core-process"])
def test_a_request_whose_event_loop_closed_is_aborted(engine_args, kind):
    """The caller's event loop closed mid-stream (its thread ended): the engine aborts the request instead of
    computing the rest of its tokens for nobody."""
    with _async_engine(kind, engine_args) as engine:
        loop = asyncio.new_event_loop()
        stream = engine.generate("Paged attention", SamplingParams(max_tokens=480, ignore_eos=True), "gone")
        first = loop.run_until_complete(asyncio.wait_for(stream.__anext__(), timeout=60))
        assert not first.finished
        loop.close()  # the stream's coroutine is left suspended, as a vanished caller's would be
        deadline = time.monotonic() + 30
        while engine.num_unfinished_requests and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.num_unfinished_requests == 0 and engine.is_running
        assert engine.get_stats().generation_tokens < 100  # aborted within a step or two of the loop closing
        if kind == "thread":  # the core process's blocks are its own
            engine.engine.block_manager.check_no_leaks()
