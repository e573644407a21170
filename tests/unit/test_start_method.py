"""How local workers start (pagoda.process.start_method): fork where safe, spawn where not, the env
variable that chooses, and the one-line refusal of spawn from an unguarded main script. The scripts
themselves run in tests/distributed/test_plain_scripts.py."""

import os
import subprocess
import sys
import threading

import pytest

from pagoda.process.start_method import (
    ENV,
    _is_main_check,
    choose_start_method,
    fork_unsafe_reasons,
    release_openmp_threads,
)

pytestmark = pytest.mark.unit


def test_another_running_thread_makes_fork_unsafe(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="busy-thread", daemon=True)
    thread.start()
    try:
        assert "other threads are running (busy-thread)" in fork_unsafe_reasons()
        start = choose_start_method()
        assert start.method == "spawn" and "busy-thread" in start.reason
    finally:
        stop.set()
        thread.join()
    assert not any("busy-thread" in r for r in fork_unsafe_reasons())


def test_the_variable_chooses_and_is_checked(monkeypatch):
    monkeypatch.setenv(ENV, "spawn")
    assert choose_start_method().method == "spawn"
    monkeypatch.setenv(ENV, "fork")
    assert choose_start_method().method == "fork"
    monkeypatch.setenv(ENV, "forkserver")
    with pytest.raises(ValueError, match="PAGODA_WORKER_MULTIPROC_METHOD must be fork or spawn; got 'forkserver'"):
        choose_start_method()


@pytest.mark.parametrize("source,expected", [
    ('__name__ == "__main__"', True), ("'__main__' == __name__", True), ('__name__ != "__main__"', False),
    ('x == "__main__"', False), ("__name__ == main", False)])
def test_main_guard_recognised(source, expected):
    import ast

    assert _is_main_check(ast.parse(source, mode="eval").body) is expected


FORK_AFTER_OPENMP = """
import os, torch
torch.set_num_threads(2)
a = torch.randn(256, 256)
for _ in range(3):
    a @ a  # this thread now has an OpenMP pool
from pagoda.process.start_method import release_openmp_threads
assert release_openmp_threads()
pid = os.fork()
if pid == 0:
    torch.set_num_threads(2)
    for _ in range(3):
        a @ a  # with the parent's pool copied, libgomp waits for threads the child does not have
    os._exit(0)
print("CHILD", os.waitpid(pid, 0)[1])
"""


def test_a_child_forked_after_openmp_ran_can_run_torch():
    result = subprocess.run([sys.executable, "-c", FORK_AFTER_OPENMP], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "CHILD 0" in result.stdout
    assert release_openmp_threads()
