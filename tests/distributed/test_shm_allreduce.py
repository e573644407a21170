"""The shared-memory TP collectives between real spawned processes (a gloo group for setup and as the
reference): sums equal gloo's and the exact fp32 sum, every rank gets the same bits, many collectives
back to back, a dead or stopped peer fails the survivor with a clear error within seconds, and nothing
is left in /dev/shm."""

import logging
import multiprocessing
import os
import re
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pagoda import LLM, SamplingParams
from pagoda.distributed import shm_allreduce

pytestmark = pytest.mark.distributed

# 1 element to ~2.5M: odd sizes, a vector remainder, and (fp32: 10 MB) several 2 MiB steps
SIZES = [1, 7, 16, 17, 576, 64 * 576, 1_000_003, 2_500_001]
DTYPES = [torch.bfloat16, torch.float32]
HIDDEN = 576


def _init(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))


def _inputs(rank: int, numel: int, dtype) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(numel * 31 + rank)).to(dtype)


def _same_on_every_rank(t: torch.Tensor, world: int) -> bool:
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t)
    return all(torch.equal(p.view(torch.uint8), t.view(torch.uint8)) for p in parts)


def _check_collectives(rank: int, world: int, port: int) -> None:
    comm = shm_allreduce.create_communicator(None, rank, world)
    assert comm is not None, "the shared-memory communicator was not set up"
    creator = [None] * world
    dist.all_gather_object(creator, os.getpid())
    assert _leftover_segments(creator[:1]) == [], "the name is unlinked once every rank has the segment mapped"
    for dtype in DTYPES:
        for numel in SIZES:
            x = _inputs(rank, numel, dtype)
            via_gloo = x.clone()
            dist.all_reduce(via_gloo)
            got = comm.all_reduce(x.clone())
            # summed in fp32 in rank order, rounded once
            exact = sum(_inputs(r, numel, dtype).float() for r in range(world)).to(dtype)
            assert torch.equal(got, exact), f"{dtype} {numel}: not the fp32 sum in rank order"
            tol = dict(rtol=2e-2, atol=6e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got.float(), via_gloo.float(), **tol, msg=f"{dtype} {numel} vs gloo")
            assert _same_on_every_rank(got, world), f"{dtype} {numel}: ranks differ"
    for rows in (1, 3, 64, 1500):  # the LM head's gather: vocabulary slices along the last dim
        x = torch.randn(rows, 4099).to(torch.bfloat16) + rank
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x)
        assert torch.equal(comm.all_gather_last_dim(x), torch.cat(parts, dim=-1)), f"all_gather {rows} rows"
    # back to back, alternating sizes (both buffers, many reuses); integers up to 256 are exact in bf16
    for i in range(3000):
        rows = 64 if i % 3 == 0 else 1
        base = (torch.arange(rows * HIDDEN) + i) % 61
        got = comm.all_reduce((base + rank).to(torch.bfloat16))
        expected = (world * base + world * (world - 1) // 2).to(torch.bfloat16)
        assert torch.equal(got, expected), f"iteration {i}"
    comm.close()


def _fallbacks(rank: int, world: int, port: int) -> None:
    os.environ[shm_allreduce.ENABLE_ENV] = "0" if rank == world - 1 else "1"  # one rank says no: all use gloo
    assert shm_allreduce.create_communicator(None, rank, world) is None
    os.environ[shm_allreduce.ENABLE_ENV] = "1"
    real_host_id = shm_allreduce._host_id
    shm_allreduce._host_id = lambda: f"{real_host_id()}-{rank}"  # as if each rank were on its own host
    assert shm_allreduce.create_communicator(None, rank, world) is None
    shm_allreduce._host_id = real_host_id
    assert shm_allreduce.create_communicator(None, rank, world) is not None


def _abort_once_stopped(comm, pid: int) -> None:
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        time.sleep(0.05)
    time.sleep(0.5)
    comm.abort()


def _peer_fails(rank: int, world: int, port: int, how: str, out) -> None:
    comm = shm_allreduce.create_communicator(None, rank, world)
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    x = torch.ones(64 * HIDDEN, dtype=torch.bfloat16)
    if rank == 1:
        for _ in range(200):
            comm.all_reduce(x)
        os.kill(os.getpid(), signal.SIGKILL if how == "killed" else signal.SIGSTOP)  # stopped/aborted: alive
        return
    if how == "aborted":  # what the driver does when the heartbeat declares the group failed
        threading.Thread(target=_abort_once_stopped, args=(comm, pids[1]), daemon=True).start()
    last_ok = time.monotonic()
    try:
        while True:
            comm.all_reduce(x.fill_(1))
            last_ok = time.monotonic()
    except RuntimeError as e:
        out.put((str(e), time.monotonic() - last_ok))


def _rank_main(target, rank: int, world: int, port: int, env: dict, out, *args) -> None:
    os.environ.update(env)
    try:
        _init(rank, world, port)
        target(rank, world, port, *args)
        out.put((rank, "ok"))
    except BaseException as e:  # reported to the test, which names the rank
        out.put((rank, f"{type(e).__name__}: {e}"))


def _spawn(target, world: int, *args, env=None, result_queue=None):
    from pagoda.distributed.group import free_port

    ctx = multiprocessing.get_context("spawn")
    out = result_queue or ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(target, r, world, port, env or {}, out, *args), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    return procs, out


def _leftover_segments(pids) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if any(n.startswith(f"pagoda-tp-{pid}-") for pid in pids)]


def _finish(procs, timeout=30):
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join()


@pytest.fixture(scope="module", autouse=True)
def built():
    shm_allreduce.load_library()  # the kernel library: compiled once, before the ranks race for it


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.heavy)])
def test_sums_equal_gloo_and_agree_across_ranks(world):
    procs, out = _spawn(_check_collectives, world)
    try:
        results = dict(out.get(timeout=600) for _ in range(world))
    finally:
        _finish(procs)
    assert results == {r: "ok" for r in range(world)}
    assert _leftover_segments([p.pid for p in procs]) == []


def test_every_rank_falls_back_to_gloo_together():
    procs, out = _spawn(_fallbacks, 2)
    try:
        results = dict(out.get(timeout=300) for _ in range(2))
    finally:
        _finish(procs)
    assert results == {0: "ok", 1: "ok"}
    assert _leftover_segments([p.pid for p in procs]) == []


@pytest.mark.parametrize("how, message, within", [
    ("killed", r"TP rank 1 \(pid \d+\) exited", 3.0),
    ("stopped", r"TP rank 1 did not arrive within 2(\.0)? s \(PAGODA_CPU_SHM_ALLREDUCE_TIMEOUT\)", 6.0),
    ("aborted", r"another TP rank gave up", 5.0),
])
def test_a_dead_or_stuck_peer_fails_the_survivor_with_a_clear_error(how, message, within):
    ctx = multiprocessing.get_context("spawn")
    failures = ctx.Queue()
    timeout = "30" if how == "aborted" else "2"
    procs, out = _spawn(_peer_fails, 2, how, failures, env={shm_allreduce.TIMEOUT_ENV: timeout})
    try:
        error, waited = failures.get(timeout=120)
        assert out.get(timeout=30) == (0, "ok")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        _finish(procs)
    assert re.search(message, error), error
    assert waited < within, f"the survivor took {waited:.1f} s to fail"
    assert _leftover_segments([p.pid for p in procs]) == []


def test_llm_tp2_uses_shared_memory_and_keeps_greedy_tokens(tiny_model_factory, caplog):
    path = tiny_model_factory("llama", num_layers=2, num_kv_heads=1)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["Hello, my name is", "Paged attention stores keys and values in blocks"]

    def greedy(**kwargs):
        llm = LLM(str(path), dtype="float32", kv_cache_memory=0.02, **kwargs)
        try:
            return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.engine.shutdown()

    with caplog.at_level(logging.INFO, logger="pagoda.distributed.shm_allreduce"):
        tp2 = greedy(tensor_parallel_size=2)
    assert any("TP collectives use shared memory" in r.getMessage() for r in caplog.records)
    assert tp2 == greedy()
    assert _leftover_segments([os.getpid()]) == []



def test_rounding_and_nan_are_the_same_on_the_vector_and_the_scalar_path():
    """One rank (the sum is the rounding alone): element 0 goes through the 16-wide loop where the CPU has
    AVX-512, element 16 through the scalar remainder; both quiet a NaN keeping its sign, as vcvtneps2bf16."""
    name = f"/pagoda-tp-{os.getpid()}-rounding"
    group = torch.classes.pagoda_cpu.ShmGroup(name, 0, 1, shm_allreduce.SLOT_BYTES, True, [], 5.0)
    torch.ops.pagoda_cpu.shm_unlink(name)
    try:
        for bits, expected in ((0xFF81, 0xFFC1), (0x7F81, 0x7FC1), (0x7FC0, 0x7FC0), (0x3F81, 0x3F81)):
            x = torch.full((17,), bits, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)  # 16 bits, wrapped
            group.all_reduce(x)
            assert torch.equal(x.view(torch.int16), torch.full((17,), expected, dtype=torch.int32).to(torch.int16)), \
                hex(bits)
    finally:
        group.close()
    assert _leftover_segments([os.getpid()]) == []
