"""Joining a group: every rank announces itself and its settings in a TCPStore hosted by the head.

The head waits for all ranks up to a deadline, naming the ones that never came (or until a rank it
started itself is known to have exited); a rank whose
settings differ from the head's makes everyone fail fast, saying which setting differs. Once joined,
every rank bumps a heartbeat counter, and each side watches the other's, so a dead or hung rank is
noticed within seconds instead of at the next collective's timeout.
"""

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL = 1.0
HEARTBEAT_TIMEOUT = 5.0


class RendezvousError(RuntimeError):
    pass


@dataclass
class RankInfo:
    rank: int
    world_size: int
    tp_size: int
    pp_size: int
    nnodes: int
    dp_size: int = 1  # ranks are DP-major: rank = (dp_rank * pp_size + pp_rank) * tp_size + tp_rank
    dp_size_local: int = 0  # DP ranks per node (0: all on one node); fewer: DP over many nodes

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size % self.pp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.tp_size * self.pp_size)

    @property
    def dp_leader(self) -> int:
        """The global rank that receives this DP rank's schedules (its first stage's TP rank 0)."""
        return self.dp_rank * self.tp_size * self.pp_size

    @property
    def node_rank(self) -> int:
        # one node per pipeline stage when nnodes > 1; dp_size_local DP ranks per node; else everything on node 0
        if self.nnodes > 1:
            return self.pp_rank
        if 0 < self.dp_size_local < self.dp_size:
            return self.dp_rank // self.dp_size_local
        return 0

    @property
    def local_rank(self) -> int:
        return self.rank - self.node_rank * self.ranks_per_node

    @property
    def ranks_per_node(self) -> int:
        if 0 < self.dp_size_local < self.dp_size:
            return self.dp_size_local * self.tp_size * self.pp_size
        return self.world_size // self.nnodes


def connect_store(master_addr: str, master_port: int, is_master: bool, timeout: float) -> dist.TCPStore:
    try:
        return dist.TCPStore(master_addr, master_port, is_master=is_master, timeout=timedelta(seconds=timeout),
                             wait_for_workers=False)
    except (RuntimeError, OSError) as e:
        where = "listen on" if is_master else "reach the head at"
        raise RendezvousError(f"could not {where} {master_addr}:{master_port} within {timeout:.0f}s "
                              f"(--master-addr/--master-port): {e}") from None


def join(store: dist.TCPStore, info: RankInfo, settings: dict, timeout: float,
         failure: Callable[[], str | None] = lambda: None) -> None:
    """Announce this rank; the head (rank 0) waits for everyone and checks their settings. failure() says
    why the group cannot form while it waits (a rank's process exited): the wait ends then, not at the
    deadline."""
    store.set(f"join/{info.rank}", json.dumps(settings))
    if info.rank == 0:
        _wait_for_all(store, info, settings, timeout, failure)
    else:
        _wait_for_head(store, info, settings, timeout)


def _wait_for_all(store, info: RankInfo, settings: dict, timeout: float, failure: Callable[[], str | None]) -> None:
    deadline = time.monotonic() + timeout
    pending = set(range(info.world_size))
    while True:
        if store.check(["abort"]):
            raise RendezvousError(store.get("abort").decode())
        if (reason := failure()) is not None:
            message = f"rendezvous aborted: {reason}"
            store.set("abort", message)
            raise RendezvousError(message)
        for rank in sorted(pending):
            if store.check([f"join/{rank}"]):
                theirs = json.loads(store.get(f"join/{rank}"))
                problem = settings_mismatch(settings, theirs, rank, info)
                if problem:
                    store.set("abort", problem)
                    raise RendezvousError(problem)
                pending.discard(rank)
        if not pending:
            store.set("ready", "1")
            return
        if time.monotonic() > deadline:
            missing = ", ".join(f"rank {r} (node {r // info.ranks_per_node if info.nnodes > 1 else 0})"
                                for r in sorted(pending))
            message = (f"rendezvous timed out after {timeout:.0f}s (--distributed-timeout): "
                       f"{missing} never joined")
            store.set("abort", message)
            raise RendezvousError(message)
        time.sleep(0.2)


def _wait_for_head(store, info: RankInfo, settings: dict, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    checked_head = False
    while True:
        if store.check(["abort"]):
            raise RendezvousError(f"the head aborted the rendezvous: {store.get('abort').decode()}")
        if not checked_head and store.check(["join/0"]):
            problem = settings_mismatch(json.loads(store.get("join/0")), settings, info.rank, info)
            if problem:
                store.set("abort", problem)  # the head may never see our join key under the rank it expects
                raise RendezvousError(problem)
            checked_head = True
        if store.check(["ready"]):
            return
        if time.monotonic() > deadline:
            raise RendezvousError(f"rendezvous timed out after {timeout:.0f}s (--distributed-timeout): "
                                  "the head did not report the group complete")
        time.sleep(0.2)


def settings_mismatch(head: dict, theirs: dict, rank: int, info: RankInfo) -> str | None:
    for key in head:
        if head[key] != theirs.get(key):
            node = rank // info.ranks_per_node if info.nnodes > 1 else 0
            return (f"rank {rank} (node {node}) was started with {key}={theirs.get(key)!r} "
                    f"but the head has {key}={head[key]!r}")
    return None


class Heartbeat:
    """Bumps this rank's counter and watches the counters of `watched` ranks from a background thread.

    `on_failure(message)` is called once if a watched rank's counter stops moving or the store is gone.
    """

    def __init__(self, master_addr: str, master_port: int, rank: int, watched: list[int],
                 on_failure: Callable[[str], None], timeout: float = HEARTBEAT_TIMEOUT):
        self.addr, self.port, self.rank, self.watched = master_addr, master_port, rank, watched
        self.on_failure, self.timeout = on_failure, timeout
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{rank}", daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        try:
            store = dist.TCPStore(self.addr, self.port, is_master=False, timeout=timedelta(seconds=self.timeout),
                                  wait_for_workers=False)
            last_seen = {r: (-1, time.monotonic()) for r in self.watched}
            while not self._stop.is_set():
                store.add(f"hb/{self.rank}", 1)
                if store.check(["abort"]):
                    self._fail(f"group aborted: {store.get('abort').decode()}")
                    return
                now = time.monotonic()
                for r in self.watched:
                    count = store.add(f"hb/{r}", 0)
                    if count != last_seen[r][0]:
                        last_seen[r] = (count, now)
                    elif now - last_seen[r][1] > self.timeout:
                        self._fail(f"rank {r} stopped responding (no heartbeat for {self.timeout:.0f}s)")
                        return
                self._stop.wait(HEARTBEAT_INTERVAL)
        except Exception as e:  # the store (the head) is gone
            if not self._stop.is_set():
                self._fail(f"lost contact with the group's store: {e}")

    def _fail(self, message: str) -> None:
        if not self._stop.is_set():
            self._stop.set()
            self.on_failure(message)
