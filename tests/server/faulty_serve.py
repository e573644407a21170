"""`pagoda serve` whose engine step raises once a prompt contains KILL_ENGINE (the engine-death test)."""

import sys

from pagoda.engine.llm_engine import LLMEngine
from pagoda.entrypoints.cli import main

KILL = "KILL_ENGINE"
_add_request, _step = LLMEngine.add_request, LLMEngine.step


def add_request(self, request_id, prompt, *args, **kwargs):
    if isinstance(prompt, str) and KILL in prompt:
        self.doomed = True
    return _add_request(self, request_id, prompt, *args, **kwargs)


def step(self):
    if getattr(self, "doomed", False):
        raise RuntimeError("injected engine failure")
    return _step(self)


LLMEngine.add_request, LLMEngine.step = add_request, step

if __name__ == "__main__":
    sys.exit(main())
