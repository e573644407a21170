"""A streaming response gives back its admission slot even when the client is gone before the body
starts, so the generator that would release it in its `finally` never runs."""

import asyncio

import pytest
from starlette.requests import ClientDisconnect

from pagoda.entrypoints.openai.serving_base import Admission, EventStreamResponse

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("how", ["send fails at the headers", "task cancelled before the body"])
def test_admission_slot_released_when_the_body_never_starts(how):
    admission = Admission(max_running=1, max_queued=0)
    release = admission.acquire()
    started = []

    async def events():
        started.append(True)
        try:
            yield "data: x\n\n"
        finally:
            release()

    async def receive():
        await asyncio.sleep(3600)

    async def send(message):
        if how == "send fails at the headers":
            raise OSError("client went away")
        await asyncio.sleep(3600)

    async def run():
        response = EventStreamResponse(events(), release)
        scope = {"type": "http", "asgi": {"spec_version": "2.4"}, "method": "POST", "path": "/"}
        task = asyncio.ensure_future(response(scope, receive, send))
        if how == "task cancelled before the body":
            await asyncio.sleep(0.05)
            task.cancel()
        with pytest.raises((OSError, ClientDisconnect, asyncio.CancelledError)):
            await task

    asyncio.run(run())
    assert not started  # the generator never ran: only the response could release
    assert admission.in_flight == 0
    admission.acquire()  # and the slot can be taken again
