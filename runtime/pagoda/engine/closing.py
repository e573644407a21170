"""Context-manager use, sync and async, of the async engines (in-process and the engine core's client): both
stop with their own idempotent `shutdown()`."""

import asyncio


class ShutdownOnExit:
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.to_thread(self.shutdown)
