"""`pagoda bench kv-transfer`: NIXL transfer bandwidth and latency of the P/D KV path.

Two processes, each with a NIXL agent (UCX backend) and a KV cache of the layout the engine allocates for a
model (PagedKVCache: a [planes, blocks, kv heads, block size, head size] tensor per attention layer), in host
memory (DRAM) or, with --device cuda, in GPU memory (VRAM). The second process plays the decode engine: for each
size it READs that many blocks of the first's cache through the engine's own NixlConnectorWorker (one
descriptor per layer, plane and block, as a pull does), --iters times, and prints GB/s and the per-transfer
latency (posting the READ to seeing it done). The first READ of each size is checked against the source's
contents, so a run that moves nothing fails instead of printing a fast figure.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import time
from types import SimpleNamespace

DTYPES = ("float16", "bfloat16", "float32")
CHECK_PERIOD = 251  # block b holds the value b % 251 (exact in every dtype above)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="pagoda bench kv-transfer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="a model directory or Hub id whose KV layout to use (layers, KV heads, head size; default: "
                        "the default model); --num-layers, --num-kv-heads, --head-size override it")
    p.add_argument("--num-layers", type=_positive_int, default=None)
    p.add_argument("--num-kv-heads", type=_positive_int, default=None)
    p.add_argument("--head-size", type=_positive_int, default=None)
    p.add_argument("--block-size", type=_positive_int, default=16, help="tokens per block (default: %(default)s)")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="the KV cache's dtype (default: %(default)s)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where both caches live: cpu (DRAM) or cuda (VRAM, needs torch.cuda) (default: %(default)s)")
    p.add_argument("--blocks", type=_positive_int, nargs="+", default=[1, 16, 128], metavar="N",
                   help="blocks per READ, one measurement each (default: %(default)s)")
    p.add_argument("--iters", type=_positive_int, default=20, help="READs per size (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="READs per size not measured (default: %(default)s)")
    p.add_argument("--output-json", metavar="PATH", help="also write the results here as JSON")
    args = p.parse_args(argv)
    if args.warmup < 0:
        p.error("--warmup must be 0 or more")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            p.error("--device cuda: torch.cuda is not available here")
    try:
        args.layout = kv_layout(args)
    except (OSError, ValueError) as e:
        p.error(f"--model {args.model}: {e}")
    return args


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def kv_layout(args) -> dict:
    """num_layers, num_kv_heads and head_size: the flags, else the model's config."""
    shape = {"num_layers": args.num_layers, "num_kv_heads": args.num_kv_heads, "head_size": args.head_size}
    if None in shape.values():
        from transformers import AutoConfig

        from pagoda.config.default_model import default_model_path

        config = AutoConfig.from_pretrained(args.model or default_model_path())
        config = getattr(config, "text_config", None) or config
        heads = config.num_attention_heads
        found = {"num_layers": config.num_hidden_layers,
                 "num_kv_heads": getattr(config, "num_key_value_heads", None) or heads,
                 "head_size": getattr(config, "head_dim", None) or config.hidden_size // heads}
        shape = {k: v if v is not None else found[k] for k, v in shape.items()}
    return shape


def _caches(layout: dict, num_blocks: int, block_size: int, dtype: str, device: str):
    """The KV cache tensors the engine would allocate (PagedKVCache's layout), one per layer."""
    import torch

    from pagoda.worker.kv_cache import PagedKVCache

    layers = [SimpleNamespace(num_kv_heads=layout["num_kv_heads"], head_size=layout["head_size"])
              for _ in range(layout["num_layers"])]
    cache = PagedKVCache(layers, block_size, getattr(torch, dtype), torch.device(device))
    cache.allocate(num_blocks)
    return cache.caches


def _worker(role: str, block_size: int):
    from pagoda.config.kv_transfer import KVTransferConfig
    from pagoda.kv_transfer.nixl_connector import NixlConnectorWorker

    return NixlConnectorWorker(KVTransferConfig("NixlConnector", role, engine_id=f"bench-{role}"), block_size)


def serve_blocks(conn, layout: dict, num_blocks: int, block_size: int, dtype: str, device: str) -> None:
    """The prefill side (its own process): a cache whose block b holds b % CHECK_PERIOD, registered with NIXL;
    sends its handshake and holds the memory until told to stop."""
    try:
        caches = _caches(layout, num_blocks, block_size, dtype, device)
        for cache in caches:
            for b in range(num_blocks):
                cache[:, b].fill_(b % CHECK_PERIOD)
        if device == "cuda":
            import torch

            torch.cuda.synchronize()
        worker = _worker("kv_producer", block_size)
        worker.register_kv_caches(caches)
        conn.send(("ready", worker.handshake_metadata()))
    except Exception as e:  # the reader reports it; a traceback here would be lost in the child
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.recv()  # "stop"


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def measure(args) -> dict:
    from pagoda.kv_transfer.nixl_connector import LoadSpec, NixlConnectorMetadata

    layout = args.layout
    num_blocks = max(args.blocks)
    context = multiprocessing.get_context("spawn")  # a fresh UCX context and, with cuda, a fresh CUDA one
    parent, child = context.Pipe()
    source = context.Process(target=serve_blocks, args=(child, layout, num_blocks, args.block_size, args.dtype,
                                                         args.device), daemon=True)
    source.start()
    try:
        if not parent.poll(120):
            raise RuntimeError("the source process did not register its blocks within 120 s")
        status, handshake = parent.recv()
        if status != "ready":
            raise RuntimeError(f"the source process failed: {handshake}")
        caches = _caches(layout, num_blocks, args.block_size, args.dtype, args.device)
        worker = _worker("kv_consumer", args.block_size)
        worker.register_kv_caches(caches)
        block_bytes = sum(layer[1] * layer[3] for layer in worker.layers)
        results = []
        for n in args.blocks:
            local = list(range(n))
            remote = list(range(num_blocks - n, num_blocks))  # other ids than the local ones: the mapping is checked
            latencies = []
            for i in range(args.warmup + args.iters):
                spec = LoadSpec(seq_id=i, remote_engine_id="bench-kv_producer", remote_host="", remote_port=0,
                                local_block_ids=local, remote_block_ids=remote, all_remote_block_ids=remote,
                                handshake=handshake)
                started = time.perf_counter()
                worker.start_load_kv(NixlConnectorMetadata(loads=[spec]))
                worker.wait_for_layer_load(0)
                elapsed = time.perf_counter() - started
                output = worker.get_finished()
                if output is None or output.failed_recving or i not in output.finished_recving:
                    raise RuntimeError(f"READ of {n} blocks failed: {output.failed_recving if output else 'no output'}")
                if i == 0:
                    _check(caches, local, remote)
                    for cache in caches:
                        cache[:, :n].zero_()  # (local is blocks 0..n-1) the next size's check sees its own READ
                if i >= args.warmup:
                    latencies.append(elapsed)
            nbytes = n * block_bytes
            mean = statistics.fmean(latencies)
            results.append({"blocks": n, "bytes": nbytes, "descriptors": n * 2 * layout["num_layers"],
                            "iters": len(latencies), "gb_per_s": nbytes / mean / 1e9,
                            "latency_ms_mean": mean * 1e3, "latency_ms_p50": _percentile(latencies, 0.5) * 1e3,
                            "latency_ms_p90": _percentile(latencies, 0.9) * 1e3})
    finally:
        if source.is_alive():
            parent.send("stop")
        source.join(30)
        if source.is_alive():
            source.kill()
            source.join()
    return {"device": args.device, "mem_type": "VRAM" if args.device == "cuda" else "DRAM", "backend": "UCX",
            "dtype": args.dtype, "block_size": args.block_size, "block_bytes": block_bytes, **layout,
            "results": results}


def _check(caches, local: list[int], remote: list[int]) -> None:
    import torch

    for index, cache in enumerate(caches):
        for lb, rb in zip(local, remote):
            if not torch.all(cache[:, lb] == rb % CHECK_PERIOD):
                raise RuntimeError(f"layer {index}, block {lb}: not the source's block {rb} after the READ")


def print_report(report: dict) -> None:
    print(f"NIXL {report['backend']} READ, {report['mem_type']} -> {report['mem_type']}: {report['num_layers']} "
          f"layers x {report['num_kv_heads']} KV heads x head size {report['head_size']}, block size "
          f"{report['block_size']}, {report['dtype']}: {report['block_bytes'] / 2**10:.1f} KiB a block")
    header = f"{'blocks':>7} {'MiB':>9} {'descs':>7} {'GB/s':>8} {'mean ms':>9} {'p50 ms':>9} {'p90 ms':>9}"
    print(header)
    print("-" * len(header))
    for r in report["results"]:
        print(f"{r['blocks']:>7} {r['bytes'] / 2**20:>9.2f} {r['descriptors']:>7} {r['gb_per_s']:>8.2f} "
              f"{r['latency_ms_mean']:>9.3f} {r['latency_ms_p50']:>9.3f} {r['latency_ms_p90']:>9.3f}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = measure(args)
    print_report(report)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
