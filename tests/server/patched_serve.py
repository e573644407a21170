"""`pagoda serve` with test hooks: a slower model load (TEST_SERVE_LOAD_DELAY seconds, to observe the
loading state), slower steps (TEST_SERVE_STEP_DELAY seconds, for long requests) and an engine step that
raises once a prompt contains KILL_ENGINE (engine death), and output processing that raises for a request
whose prompt contains FAIL_REQUEST (one request's failure: the engine must go on); and it prints the garbage
collector's state once the model is loaded ("TEST gc ...").

The engine core process (engine/core_proc.py) starts by spawn, which runs this script's top level again
there (not its `__main__` block): the engine's hooks apply in the core, the output processor's here."""

import gc
import os
import sys
import time

from pagoda.engine.async_llm_engine import AsyncLLMEngine
from pagoda.engine.core_client import AsyncMPEngine
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.output_processor import OutputProcessor
from pagoda.entrypoints.cli import main
from pagoda.entrypoints.openai import api_server

KILL = "KILL_ENGINE"
FAIL = "FAIL_REQUEST"
STEP_DELAY = float(os.environ.get("TEST_SERVE_STEP_DELAY", "0"))
_add_request, _step = LLMEngine.add_request, LLMEngine.step
_process_token = OutputProcessor.process_token


def add_request(self, request_id, prompt, *args, **kwargs):
    if isinstance(prompt, str) and KILL in prompt:
        self.doomed = True
    return _add_request(self, request_id, prompt, *args, **kwargs)


def step(self):
    if getattr(self, "doomed", False):
        raise RuntimeError("injected engine failure")
    time.sleep(STEP_DELAY)
    return _step(self)


def process_token(self, state, *args, **kwargs):
    if isinstance(state.prompt, str) and FAIL in state.prompt:
        raise RuntimeError("injected request failure")
    return _process_token(self, state, *args, **kwargs)


def delayed(from_engine_args):
    def slow_from_engine_args(cls, args):
        time.sleep(float(os.environ.get("TEST_SERVE_LOAD_DELAY", "0")))
        return from_engine_args(cls, args)

    return classmethod(slow_from_engine_args)


_attach_engine = api_server._attach_engine


def attach_engine(state, engine):
    print(f"TEST gc enabled={gc.isenabled()} frozen={gc.get_freeze_count()}", file=sys.stderr, flush=True)
    return _attach_engine(state, engine)


LLMEngine.add_request, LLMEngine.step = add_request, step
api_server._attach_engine = attach_engine
OutputProcessor.process_token = process_token
AsyncLLMEngine.from_engine_args = delayed(AsyncLLMEngine.from_engine_args.__func__)
AsyncMPEngine.from_engine_args = delayed(AsyncMPEngine.from_engine_args.__func__)

if __name__ == "__main__":
    sys.exit(main())
