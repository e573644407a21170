"""Start-up's objects kept out of the garbage collector's way, in the processes Pagoda owns (the server,
its worker ranks; not a user's process running `LLM`).

Once the model, tokenizer and libraries are loaded a process tracks ~350k objects, and none of them will
become garbage; yet a full collection walks them all, stalling every thread for ~200 ms (the default
model, measured while serving), and while they are being built such collections run again and again.
So: no collections during start-up, one at its end, then `gc.freeze()` moves the survivors to the
permanent generation (as vLLM does), and later full collections walk only what serving created.
"""

import contextlib
import gc
from collections.abc import Iterator


def pause_collections() -> None:
    """At a process's start, before its imports (they alone cost ~0.35 s of full collections)."""
    gc.disable()


@contextlib.contextmanager
def frozen_when_loaded() -> Iterator[None]:
    """Around a process's model load: collections paused; on success, one collection and the heap frozen.
    Collections are on again afterwards, also when `pause_collections` paused them earlier."""
    gc.disable()
    try:
        yield
        gc.collect()
        gc.freeze()
    finally:
        gc.enable()
