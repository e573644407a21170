"""`AsyncEngineBase`: what the two async engines share, the in-process `AsyncLLMEngine` (engine thread) and
`AsyncMPEngine` (the engine core's client): a request's life as the server sees it (checks, then its
outputs off a per-request asyncio queue until the finished one), the death that fails every waiting
request, health, stats, the distributed group's failure callbacks, and context-manager use.

A subclass hands a request to its engine (`_submit`), drops it (`_end`), fails all (`_fail_all`) and says
whether it runs (`is_running`); it keeps its requests in `self._requests`, keyed by request id."""

import asyncio
import threading
from collections.abc import AsyncIterator

from pagoda.engine import EngineDeadError
from pagoda.engine.input_processor import check_priority
from pagoda.engine.outputs import EngineStats, RequestOutput
from pagoda.sampling_params import SamplingParams


class AsyncEngineBase:
    engine_name = "engine"  # in errors: "the <name> is not running", "<name> died"

    def __init__(self) -> None:
        self._requests: dict = {}
        self._stats: EngineStats | None = None
        self._dead_error: BaseException | None = None  # the first cause of death
        self._stopping = threading.Event()
        self._group_failure_callbacks: list = []

    # --- what a subclass provides --------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        raise NotImplementedError

    async def process_prompt(self, prompt, params: SamplingParams) -> tuple[str | None, list[int]]:
        """Tokenize and validate a prompt off the event loop; raises ValueError naming the problem."""
        raise NotImplementedError

    def _submit(self, request_id: str, text, token_ids: list[int], params: SamplingParams, lora_request,
                priority: int, stream: asyncio.Queue) -> None:
        """Register the request in `_requests` (its outputs go to `stream`) and hand it to the engine; raises
        ValueError if the id is taken, and leaves nothing behind if it raises."""
        raise NotImplementedError

    def _end(self, request_id: str, finished: bool) -> None:
        """The caller stopped reading: forget the request, and abort it in the engine if it is not finished."""
        raise NotImplementedError

    def _fail_all(self, error: BaseException) -> None:
        raise NotImplementedError

    def shutdown(self, timeout: float = 10.0) -> None:
        raise NotImplementedError

    # --- shared --------------------------------------------------------------------------------------

    @property
    def errored(self) -> bool:
        return self._dead_error is not None

    async def check_health(self) -> None:
        if not self.is_running:
            raise EngineDeadError(f"the {self.engine_name} is not running: {self._dead_error!r}")

    def get_stats(self) -> EngineStats:
        return self._stats

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    async def generate(self, prompt, params: SamplingParams, request_id: str, lora_request=None, priority: int = 0
                       ) -> AsyncIterator[RequestOutput]:
        """Yields cumulative outputs until the request finishes; aborts it if the caller stops listening.
        lora_request: a LoRARequest, the adapter the request runs with."""
        await self.check_health()
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        check_priority(priority, self.config.scheduler.scheduling_policy)
        text, token_ids = await self.process_prompt(prompt, params)
        if lora_request is not None:  # checked (a Hub id downloaded) before the request is queued
            lora_request = await asyncio.to_thread(self.loras.resolve, lora_request)
        stream: asyncio.Queue = asyncio.Queue()
        self._submit(request_id, text, token_ids, params, lora_request, priority, stream)
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                # a slow consumer may have fallen behind: outputs are cumulative, keep only the newest
                while not item.finished and not stream.empty():
                    newer = stream.get_nowait()
                    if isinstance(newer, BaseException):
                        raise newer
                    item = newer
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._end(request_id, finished)

    def add_group_failure_callback(self, callback) -> None:
        """callback(message) runs (in a background thread) when a rank of the distributed group dies or
        hangs: the group cannot recover, so the server should exit non-zero and be restarted."""
        self._group_failure_callbacks.append(callback)

    def _on_group_failure(self, message: str) -> None:
        self._fail_all(RuntimeError(f"distributed group failed: {message}"))
        for callback in self._group_failure_callbacks:
            callback(message)

    def _death(self, error: BaseException) -> EngineDeadError:
        """Record the engine's death (its first cause is kept); the error each waiting request gets."""
        if self._dead_error is None:
            self._dead_error = error
        return EngineDeadError(f"{self.engine_name} died: {error!r}")

    # --- `with` and `async with`: both stop with the idempotent `shutdown()` ---------------------------

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.to_thread(self.shutdown)


def publish(by_loop: dict) -> list:
    """Hand items to their streams from another thread: one wake-up per event loop for a whole step's outputs
    (a wake-up is a write to the loop's self-pipe; one per output took ~2 % of the engine thread at 32 streams).
    by_loop: {event loop: [(asyncio.Queue, item), ...]}. Returns the loops found closed (nobody listens there)."""
    closed = []
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # that event loop is closed
            closed.append(loop)
    return closed


def _put_all(items: list) -> None:
    for stream, item in items:
        stream.put_nowait(item)
