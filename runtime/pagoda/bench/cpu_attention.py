"""`python -m pagoda.bench.cpu_attention`: decode attention on CPU per KV-cache dtype (bfloat16, fp8 e4m3, fp8
e5m2), through ``torch_backend.paged_attention`` as the engine calls it (the C++ kernels where they are built),
beside the torch path (``paged_attention_in_torch``, what an fp8 cache ran before the kernels read it).

Shapes are the default model's (SmolLM2-135M: 9 query heads, 3 KV heads, head size 64, 30 layers, a bfloat16
query); every layer has its own cache, laid out head-major as the model runner allocates it, each sequence's
blocks in order (a prompt's blocks are allocated together). One timed sweep calls every layer once; the figure
is the median sweep divided by the layers: microseconds per layer call.
"""

import argparse
import statistics
import time

import torch

from pagoda.attention import cpu_kernels, torch_backend
from pagoda.attention.metadata import AttentionMetadata
from pagoda.layers.quantization.kv_scales import quantize

CACHE_DTYPES = {"bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m pagoda.bench.cpu_attention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, default=4)
    p.add_argument("--context", type=int, default=500, help="tokens per sequence")
    p.add_argument("--cache-dtypes", nargs="+", choices=sorted(CACHE_DTYPES), default=list(CACHE_DTYPES))
    p.add_argument("--heads", type=int, nargs=3, default=[9, 3, 64], metavar=("Q", "KV", "D"))
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--sliding-window", type=int, default=None)
    p.add_argument("--logit-softcap", type=float, default=None)
    p.add_argument("--no-torch", action="store_true", help="skip the torch path")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    return p.parse_args(argv)


def build(args, cache_dtype):
    num_heads, num_kv_heads, head_size = args.heads
    g = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-args.context // args.block_size)
    num_blocks = args.seqs * blocks_per_seq
    caches = []
    for _ in range(args.layers):
        values = torch.randn(2, num_blocks, num_kv_heads, args.block_size, head_size, generator=g)
        cache = quantize(values, 1.0, cache_dtype) if cache_dtype != torch.bfloat16 else values.to(torch.bfloat16)
        caches.append(cache.transpose(2, 3))  # [2, blocks, block_size, H_kv, D], head-major in memory
    tables = torch.arange(num_blocks, dtype=torch.int32).view(args.seqs, blocks_per_seq)
    metadata = AttentionMetadata.build([1] * args.seqs, [args.context] * args.seqs, tables.tolist(),
                                       torch.full((args.seqs,), -1, dtype=torch.int64), torch.device("cpu"))
    query = torch.randn(args.seqs, num_heads, head_size, generator=g).to(torch.bfloat16)
    return query, caches, metadata


def time_sweeps(attend, caches, args) -> float:
    """Median microseconds per layer call."""
    for _ in range(args.warmup):
        for cache in caches:
            attend(cache)
    sweeps = []
    for _ in range(args.iters):
        start = time.perf_counter()
        for cache in caches:
            attend(cache)
        sweeps.append((time.perf_counter() - start) / len(caches) * 1e6)
    return statistics.median(sweeps)


def measure(name: str, args) -> str:
    query, caches, md = build(args, CACHE_DTYPES[name])
    scale = args.heads[2] ** -0.5
    plain = args.sliding_window is None and args.logit_softcap is None

    def engine_path(cache):
        torch_backend.paged_attention(query, cache, md, scale, sliding_window=args.sliding_window,
                                      logit_softcap=args.logit_softcap)

    def torch_path(cache):
        if plain:
            torch_backend.paged_attention_in_torch(query, cache, md, scale)
        else:
            torch_backend.windowed_attention(query, cache, md, scale, args.sliding_window, args.logit_softcap)

    row = f"{name:9s} engine path {time_sweeps(engine_path, caches, args):8.1f} us/layer"
    if not args.no_torch:
        row += f"   torch path {time_sweeps(torch_path, caches, args):8.1f} us/layer"
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"decode attention, {args.seqs} sequences x {args.context} tokens, heads {args.heads}, "
          f"{torch.get_num_threads()} threads, C++ kernels built: {cpu_kernels.available()}")
    with torch.inference_mode():
        for name in args.cache_dtypes:
            print(measure(name, args), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
