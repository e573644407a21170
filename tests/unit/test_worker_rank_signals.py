"""A local worker rank stops on SIGTERM even when forked from a process that handles it (the server's
uvicorn handler only sets a flag): terminate() and a pod's end reach it."""

import multiprocessing
import signal
import time

import pytest

from pagoda.executor import worker

pytestmark = pytest.mark.unit


def _wait_forever(config, rank, eos_token_ids, on_joined=None):
    while True:
        time.sleep(0.05)


def test_a_forked_rank_stops_on_sigterm_despite_the_parents_handler(monkeypatch):
    monkeypatch.setattr(worker, "run_worker", _wait_forever)
    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # as a server's: noted, not obeyed
    try:
        proc = multiprocessing.get_context("fork").Process(
            target=worker.worker_process_main, args=(None, 1, set(), 1, 30), daemon=True)
        proc.start()
        time.sleep(0.5)  # into run_worker, past the handler's reset
        proc.terminate()
        proc.join(timeout=10)
        alive = proc.is_alive()
        if alive:
            proc.kill()
            proc.join()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not alive and proc.exitcode == -signal.SIGTERM
