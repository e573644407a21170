"""How local worker processes start: `fork` where that is safe, `spawn` where it is not, as vLLM's
VLLM_WORKER_MULTIPROC_METHOD; PAGODA_WORKER_MULTIPROC_METHOD=fork|spawn chooses.

A forked child has only the thread that forked; whatever another thread held at that moment stays held
for ever in the child. Fork is unsafe when:
- CUDA is initialised here: a forked child cannot use it;
- this process is a Ray worker (vLLM's rule: its task threads and Ray's own run concurrently);
- another Python thread may be running code the child needs (torch, the TCPStore, pagoda): any thread
  but this one, the main thread (it waits for the engine or runs the server's event loop), Ray's own
  driver threads (they wait on Ray's RPCs, which the child never uses) and tqdm's monitor.
- a torch.distributed group ran here before (a second engine in one process): what it leaves behind
  (gloo's and the store's native threads) is not fork-safe: a forked rank was seen to hang.
The OpenMP pool torch starts on its first parallel op is the other hazard: the child would wait for pool
threads it does not have (libgomp hangs). It is released just before forking (omp_pause_resource_all), and
torch makes a new one on its next op; where it cannot be released, spawn is used.

Spawn runs the main script's top level again in each child, so a script that builds the engine outside
`if __name__ == "__main__":` would start workers from its workers: that is refused in one line, before
anything starts."""

import ast
import ctypes
import logging
import os
import sys
import threading
from dataclasses import dataclass

logger = logging.getLogger(__name__)

ENV = "PAGODA_WORKER_MULTIPROC_METHOD"
METHODS = ("fork", "spawn")
# threads that only wait on what a child never uses: Ray's driver threads (its RPCs), tqdm's monitor (a timer)
IDLE_THREAD_OWNERS = ("ray", "tqdm")
_OMP_PAUSE_HARD = 2  # omp_pause_resource_t: omp_pause_hard frees the threads and their state


class UnguardedMainError(RuntimeError):
    pass


@dataclass(frozen=True)
class StartMethod:
    method: str  # fork | spawn
    reason: str  # why, for the log and for errors


def choose_start_method() -> StartMethod:
    wanted = os.environ.get(ENV, "").strip().lower()
    if wanted and wanted not in METHODS:
        raise ValueError(f"{ENV} must be fork or spawn; got {os.environ[ENV]!r}")
    reasons = fork_unsafe_reasons()
    if wanted == "spawn":
        return StartMethod("spawn", f"{ENV}=spawn")
    if wanted == "fork":
        if reasons:
            logger.warning("%s=fork although fork is unsafe here: %s", ENV, "; ".join(reasons))
        return StartMethod("fork", f"{ENV}=fork")
    if reasons:
        return StartMethod("spawn", "; ".join(reasons))
    return StartMethod("fork", "no CUDA, no other running threads")


_group_joined_before = False


def note_group_joined() -> None:
    """This process joined a torch.distributed group (init_group)."""
    global _group_joined_before
    _group_joined_before = True


def fork_unsafe_reasons() -> list[str]:
    reasons = []
    if _group_joined_before:  # a second TP/PP engine in one process: a forked rank hung in its first recv
        reasons.append("an earlier torch.distributed group ran in this process (its native threads may remain)")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        reasons.append("CUDA is initialised in this process")
    if _in_ray_worker():
        reasons.append("this process is a Ray worker")
    busy = [t.name for t in threading.enumerate() if _may_hold_what_a_child_needs(t)]
    if busy:
        reasons.append(f"other threads are running ({', '.join(busy)})")
    return reasons


def _in_ray_worker() -> bool:
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return False
    from ray._private.worker import global_worker

    return global_worker.mode == ray.WORKER_MODE


def _may_hold_what_a_child_needs(thread: threading.Thread) -> bool:
    if thread is threading.current_thread() or thread is threading.main_thread() or not thread.is_alive():
        return False
    target = getattr(thread, "_target", None)  # what a plain Thread runs; subclasses override run()
    owner = type(thread).__module__ if target is None else getattr(target, "__module__", "") or ""
    return not any(owner == known or owner.startswith(known + ".") for known in IDLE_THREAD_OWNERS)


def release_openmp_threads() -> bool:
    """Free this thread's OpenMP pool (libgomp's, which torch's wheels bundle), so that a forked child
    builds its own. False when an OpenMP runtime is loaded whose pool could not be released."""
    for library in _loaded_openmp_libraries():
        try:
            lib = ctypes.CDLL(library, mode=os.RTLD_NOLOAD)
            if lib.omp_pause_resource_all(_OMP_PAUSE_HARD) != 0:
                return False
        except (OSError, AttributeError):
            return False
    return True


def _loaded_openmp_libraries() -> list[str]:
    """GNU libgomp only: LLVM's libomp and Intel's libiomp reset their pools in the child themselves."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line and "/" in line}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.basename(p).startswith("libgomp"))


def check_main_guarded(why_spawn: str) -> None:
    """Raise UnguardedMainError when spawn would run the main script's engine-building line again."""
    line = _unguarded_main_line()
    if line is None:
        return
    path, lineno = line
    raise UnguardedMainError(
        f"worker processes must start by spawn here ({why_spawn}), and spawn runs the main script again in "
        f"each of them: put the code that builds the engine ({os.path.basename(path)}, line {lineno}) under "
        f"`if __name__ == \"__main__\":`")


def _unguarded_main_line() -> tuple[str, int] | None:
    """(script, line) when the main script's top level is running now outside an
    `if __name__ == "__main__":` block; None otherwise (interactive, -c, guarded, or not at top level)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or path is None or not path.endswith(".py"):
        return None
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is main.__dict__):
        frame = frame.f_back
    if frame is None:
        return None
    try:
        with open(path) as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None
    lineno = frame.f_lineno
    for node in tree.body:
        if isinstance(node, ast.If) and _is_main_check(node.test) and node.lineno <= lineno <= node.end_lineno:
            return None
    return path, lineno


def _is_main_check(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s.id for s in sides if isinstance(s, ast.Name)]
    values = [s.value for s in sides if isinstance(s, ast.Constant)]
    return names == ["__name__"] and values == ["__main__"]
