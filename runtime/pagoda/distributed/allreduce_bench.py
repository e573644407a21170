"""Micro-benchmark of the TP all-reduce on CPU: gloo against shared memory, between local processes.

    python -m pagoda.distributed.allreduce_bench [--world-size 2] [--hidden 576] [--rows 1 64]

Each size is timed back to back on every rank (a barrier first); rank 0 prints the mean and median
latency per all-reduce.
"""

import argparse
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def _time(fn, iters: int) -> list[float]:
    for _ in range(max(10, iters // 10)):  # warm-up
        fn()
    dist.barrier()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def _rank(rank: int, args, port: int, out) -> None:
    from pagoda.distributed.group import cpu_threads_per_rank
    from pagoda.distributed.shm_allreduce import create_communicator

    torch.set_num_threads(cpu_threads_per_rank(args.world_size))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.world_size, timeout=timedelta(seconds=120))
    comm = create_communicator(None, rank, args.world_size)
    if comm is None:
        raise SystemExit("the shared-memory communicator could not be set up (see the log)")
    dtype = getattr(torch, args.dtype)
    rows_out = []
    for rows in args.rows:
        x = torch.randn(rows, args.hidden).to(dtype)
        gloo = _time(lambda: dist.all_reduce(x), args.gloo_iters)  # noqa: B023 (called at once)
        shm = _time(lambda: comm.all_reduce(x), args.shm_iters)  # noqa: B023
        rows_out.append((rows, gloo, shm))
    comm.close()
    dist.destroy_process_group()
    if rank == 0:
        out.put(rows_out)


def main(argv: list[str] | None = None) -> int:
    import multiprocessing

    from pagoda.distributed.group import free_port

    p = argparse.ArgumentParser(prog="python -m pagoda.distributed.allreduce_bench", description=__doc__)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--gloo-iters", type=int, default=300)
    p.add_argument("--shm-iters", type=int, default=3000)
    args = p.parse_args(argv)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, args, port, out)) for r in range(args.world_size)]
    for proc in procs:
        proc.start()
    results = out.get()
    for proc in procs:
        proc.join()
    print(f"all-reduce of [rows, {args.hidden}] {args.dtype}, {args.world_size} ranks on {os.cpu_count()} CPUs")
    print("| rows | gloo mean / median | shared memory mean / median | speed-up (median) |")
    print("| --- | --- | --- | --- |")
    for rows, gloo, shm in results:
        g, s = [(1e6 * statistics.fmean(t), 1e6 * statistics.median(t)) for t in (gloo, shm)]
        print(f"| {rows} | {g[0]:.0f} / {g[1]:.0f} µs | {s[0]:.1f} / {s[1]:.1f} µs | {g[1] / s[1]:.0f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
