"""`pagoda bench kernels`: the Triton kernels on CUDA at realistic shapes, against the device's peak.

Every case prints the time per call, the bytes it must move and the FLOPs it must do, as achieved GB/s and
TFLOP/s and as a percentage of the device's peak (from a table of known GPUs, else measured with a large
copy and a large matmul), next to the torch reference on the same shapes. Attention covers pure decode
(one-pass and split-K, and which one the backend's dispatch rule picks), prefill chunks over a cached
context, and mixed batches; then the KV-cache write, RMSNorm with the residual add, and rotary.

Head layouts: Llama-3-8B (32 query heads, 8 kv heads) and Llama-3-70B at TP=8 (8 query heads, 1 kv head),
head size 128. The L2 cache is flushed before every timed call, so small cases measure memory, not L2.
Without a CUDA device the benchmark prints one line and exits 0.
"""

import argparse
import json
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass

DEVICE = "cuda"  # the tests run the whole benchmark on a CPU stand-in through the interpreter
LAYOUTS = {  # name: (query heads, kv heads, head size, hidden size for the norm)
    "llama3-8b": (32, 8, 128, 4096),
    "llama3-70b-tp8": (8, 1, 128, 8192),
}
KERNELS = ("decode", "prefill", "mixed", "kv-write", "rmsnorm", "rotary")

# Spec-sheet peaks: (name substring, memory GB/s, dense float16/bfloat16 tensor TFLOP/s). First match wins,
# so more specific names come first.
KNOWN_GPUS = [
    ("H200", 4800, 989),
    ("H100 PCIe", 2000, 756),
    ("H100", 3350, 989),
    ("GH200", 4000, 989),
    ("B200", 8000, 2250),
    ("A100-SXM4-80GB", 2039, 312),
    ("A100 80GB PCIe", 1935, 312),
    ("A100", 1555, 312),
    ("L40S", 864, 362),
    ("L40", 864, 181),
    ("L4", 300, 121),
    ("A10G", 600, 70),
    ("A10", 600, 125),
    ("RTX 4090", 1008, 165),
    ("RTX 3090", 936, 71),
    ("V100", 900, 125),
    ("T4", 320, 65),
]


def parse_args(argv):
    p = argparse.ArgumentParser(prog="pagoda bench kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS))
    p.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=list(LAYOUTS))
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    p.add_argument("--context-lens", type=int, nargs="+", default=[128, 1024, 4096, 16384, 32768])
    p.add_argument("--prefill-chunk", type=int, default=2048,
                   help="query tokens per prefilling sequence: the last chunk of a context-long prompt")
    p.add_argument("--max-batched-tokens", type=int, default=8192,
                   help="skip prefill and mixed cases with more query tokens per launch than this")
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--block-size", type=int, choices=[16, 32], default=16)
    p.add_argument("--max-cache-gib", type=float, default=None,
                   help="skip cases whose KV cache is larger (default: a third of the free device memory)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10, help="timed calls per case; the median is reported")
    p.add_argument("--no-torch", action="store_true", help="skip the torch reference")
    p.add_argument("--peak-gbs", type=float, default=None, help="peak memory bandwidth, overriding the table")
    p.add_argument("--peak-tflops", type=float, default=None, help="peak tensor TFLOP/s, overriding the table")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_out", default=None, help="also write the results to this file")
    args = p.parse_args(argv)
    for name in ("batch_sizes", "context_lens"):
        if min(getattr(args, name)) < 1:
            p.error(f"--{name.replace('_', '-')} must all be >= 1")
    if args.iters < 1 or args.warmup < 0 or args.prefill_chunk < 1 or args.max_batched_tokens < 1:
        p.error("--iters and --prefill-chunk and --max-batched-tokens must be >= 1, --warmup >= 0")
    return args


# --- the device ---------------------------------------------------------------------------------------


@dataclass
class Peaks:
    name: str
    gbs: float
    tflops: float
    source: str


def device_peaks(args, dtype) -> Peaks:
    import torch

    name = torch.cuda.get_device_name()
    known = next(((gbs, tf) for key, gbs, tf in KNOWN_GPUS if key in name), None)
    gbs, tflops = known if known else (None, None)
    source = "spec sheet" if known else "measured"
    if args.peak_gbs or args.peak_tflops:
        source = "given"
    gbs = args.peak_gbs or gbs or measure_copy_gbs()
    tflops = args.peak_tflops or tflops or measure_matmul_tflops(dtype)
    return Peaks(name, gbs, tflops, source)


def free_memory() -> int:
    import torch

    return torch.cuda.mem_get_info()[0]


def measure_copy_gbs(num_bytes: int = 2**30) -> float:
    import torch

    src = torch.empty(num_bytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    seconds = time_cuda(lambda: dst.copy_(src), warmup=3, iters=10, flush=None)
    return 2 * num_bytes / seconds / 1e9  # read + write


def measure_matmul_tflops(dtype, size: int = 8192) -> float:
    import torch

    a = torch.randn(size, size, dtype=dtype, device=DEVICE)
    b = torch.randn(size, size, dtype=dtype, device=DEVICE)
    seconds = time_cuda(lambda: a @ b, warmup=3, iters=10, flush=None)
    return 2 * size**3 / seconds / 1e12


class L2Flush:
    """Overwrites a buffer larger than any L2 before each timed call."""

    def __init__(self):
        import torch

        l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or 64 * 2**20
        self.buffer = torch.empty(max(4 * l2, 256 * 2**20), dtype=torch.uint8, device=DEVICE)

    def __call__(self):
        self.buffer.zero_()


def time_cuda(fn: Callable[[], object], warmup: int, iters: int, flush: L2Flush | None) -> float:
    """Median seconds per call, timed with CUDA events around each call."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if flush is not None:
            flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


# --- the cases --------------------------------------------------------------------------------------------


@dataclass
class Case:
    kernel: str
    layout: str
    variant: str  # which implementation or path: one-pass, split-K, ...
    shape: str
    num_bytes: int  # what the kernel must read and write at least
    flops: int
    run: Callable[[], object]
    reference: Callable[[], object] | None  # the torch code doing the same work
    note: str = ""


@dataclass
class Result:
    kernel: str
    layout: str
    variant: str
    shape: str
    microseconds: float
    gbs: float
    pct_peak_gbs: float
    tflops: float
    pct_peak_tflops: float
    torch_microseconds: float | None
    note: str


def attention_flops(num_heads: int, head_size: int, query_lens: list[int], seq_lens: list[int]) -> int:
    """QK^T and PV, 2 FLOPs per multiply-add, over the causally visible positions only."""
    visible = sum(q * (s - q) + q * (q + 1) // 2 for q, s in zip(query_lens, seq_lens, strict=True))
    return 4 * num_heads * head_size * visible


def paged_batch(query_lens, seq_lens, layout, args, dtype):
    """Query, cache and metadata for one attention launch; blocks shuffled as a long-running server's are."""
    import torch

    from pagoda.attention.metadata import AttentionMetadata

    num_heads, num_kv_heads, head_size, _ = LAYOUTS[layout]
    bs = args.block_size
    blocks_per_seq = [-(-s // bs) for s in seq_lens]
    num_blocks = sum(blocks_per_seq)
    kv_cache = torch.empty(2, num_blocks, bs, num_kv_heads, head_size, dtype=dtype, device=DEVICE).normal_()
    order = torch.randperm(num_blocks, device=DEVICE, dtype=torch.int64).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32, device=DEVICE)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = order[used : used + n]
        used += n
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(query_lens).cumsum(0)
    num_tokens = sum(query_lens)
    metadata = AttentionMetadata(
        query_start_loc=query_start_loc.to(DEVICE), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=tables, slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=DEVICE),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens))
    query = torch.randn(num_tokens, num_heads, head_size, dtype=dtype, device=DEVICE)
    return query, kv_cache, metadata


def attention_bytes(query, kv_cache, seq_lens) -> int:
    """Every visible K/V row once, the queries read and the outputs written."""
    num_kv_heads, head_size = kv_cache.shape[3], kv_cache.shape[4]
    return 2 * sum(seq_lens) * num_kv_heads * head_size * kv_cache.element_size() + 2 * query.nbytes


def cache_gib(seq_lens, layout, args, itemsize) -> float:
    _, num_kv_heads, head_size, _ = LAYOUTS[layout]
    blocks = sum(-(-s // args.block_size) for s in seq_lens)
    return 2 * blocks * args.block_size * num_kv_heads * head_size * itemsize / 2**30


def attention_cases(kernel: str, layout: str, args, dtype):
    """Shapes per attention kernel; None marks a skipped shape with the reason."""
    for batch in args.batch_sizes:
        for context in args.context_lens:
            if kernel == "decode":
                query_lens, seq_lens = [1] * batch, [context] * batch
            elif kernel == "prefill":
                chunk = min(context, args.prefill_chunk)
                query_lens, seq_lens = [chunk] * batch, [context] * batch
            else:  # mixed: the decodes of batch - 1 sequences and one prefill chunk, in one launch
                chunk = min(context, args.prefill_chunk)
                query_lens, seq_lens = [1] * (batch - 1) + [chunk], [context] * batch
            shape = f"batch {batch:>3} q {max(query_lens):>5} ctx {context:>5}"
            if sum(query_lens) > args.max_batched_tokens:
                continue
            if cache_gib(seq_lens, layout, args, dtype.itemsize) > args.max_cache_gib:
                yield shape, None, None
                continue
            yield shape, query_lens, seq_lens


def build_attention(kernel: str, layout: str, args, dtype):
    from pagoda.attention import torch_backend, triton_backend
    from pagoda.kernels.flash_decode import flash_decode
    from pagoda.kernels.paged_attention import paged_attention

    num_heads, _, head_size, _ = LAYOUTS[layout]
    scale = head_size**-0.5
    for shape, query_lens, seq_lens in attention_cases(kernel, layout, args, dtype):
        if query_lens is None:
            print(f"  {kernel} {layout} {shape}: skipped, KV cache over --max-cache-gib {args.max_cache_gib:.1f}")
            continue
        query, kv_cache, md = paged_batch(query_lens, seq_lens, layout, args, dtype)
        num_bytes = attention_bytes(query, kv_cache, seq_lens)
        flops = attention_flops(num_heads, head_size, query_lens, seq_lens)
        reference = None
        if not args.no_torch and free_memory() > 2.5 * kv_cache.nbytes:  # it gathers every context into a workspace
            def reference(query=query, kv_cache=kv_cache, md=md):
                return torch_backend.paged_attention(query, kv_cache, md, scale)

        def one_pass(query=query, kv_cache=kv_cache, md=md):
            return paged_attention(query, kv_cache[0], kv_cache[1], md.block_tables, md.query_start_loc,
                                   md.seq_lens, md.max_query_len, scale)

        if kernel != "decode":
            yield Case(kernel, layout, "one launch", shape, num_bytes, flops, one_pass, reference)
        else:
            chosen = "split-K" if triton_backend.use_split_k(md, kv_cache.shape[3], query.device) else "one-pass"
            yield Case(kernel, layout, "one-pass", shape, num_bytes, flops, one_pass, reference,
                       "dispatch" if chosen == "one-pass" else "")
            if max(seq_lens) > triton_backend.SPLIT_K_PARTITION_SIZE:
                partition = triton_backend.split_k_partition_size(md, kv_cache.shape[3], query.device)

                def split_k(query=query, kv_cache=kv_cache, md=md, partition=partition):
                    return flash_decode(query, kv_cache[0], kv_cache[1], md.block_tables, md.seq_lens,
                                        md.max_seq_len, scale, partition_size=partition)
                yield Case(kernel, layout, f"split-K/{partition}", shape, num_bytes, flops, split_k, reference,
                           "dispatch" if chosen == "split-K" else "")
                del split_k
        # drop this shape's cache before the next one is allocated: two large caches may not fit
        del query, kv_cache, md, one_pass, reference


def build_kv_write(layout: str, args, dtype):
    import torch

    from pagoda.attention import torch_backend
    from pagoda.kernels.kv_cache import write_kv_cache

    _, num_kv_heads, head_size, _ = LAYOUTS[layout]
    for num_tokens in sorted({*args.batch_sizes, args.max_batched_tokens}):
        num_blocks = max(1024, 2 * -(-num_tokens // args.block_size))
        kv_cache = torch.zeros(2, num_blocks, args.block_size, num_kv_heads, head_size, dtype=dtype, device=DEVICE)
        key = torch.randn(num_tokens, num_kv_heads, head_size, dtype=dtype, device=DEVICE)
        value = torch.randn_like(key)
        slots = torch.randperm(num_blocks * args.block_size, device=DEVICE)[:num_tokens]
        num_bytes = 2 * (key.nbytes + value.nbytes) + slots.nbytes
        yield Case("kv-write", layout, "triton", f"tokens {num_tokens:>5}", num_bytes, 0,
                   lambda k=key, v=value, c=kv_cache, s=slots: write_kv_cache(k, v, c[0], c[1], s),
                   None if args.no_torch else
                   (lambda k=key, v=value, c=kv_cache, s=slots: torch_backend.write_kv_cache(k, v, c, s)))


def build_rmsnorm(layout: str, args, dtype):
    import torch

    from pagoda.kernels.rmsnorm import fused_add_rms_norm
    from pagoda.layers.layernorm import RMSNorm

    hidden = LAYOUTS[layout][3]
    norm = RMSNorm(hidden).to(device=DEVICE, dtype=dtype)
    for num_tokens in sorted({*args.batch_sizes, args.max_batched_tokens}):
        x = torch.randn(num_tokens, hidden, dtype=dtype, device=DEVICE)
        residual = torch.randn_like(x)
        num_bytes = 4 * x.nbytes + norm.weight.nbytes
        yield Case("rmsnorm", layout, "fused add", f"tokens {num_tokens:>5} hidden {hidden}", num_bytes,
                   4 * x.numel(), lambda x=x, r=residual: fused_add_rms_norm(x, r, norm.weight, norm.eps),
                   None if args.no_torch else (lambda x=x, r=residual: norm(x, r)))


def build_rotary(layout: str, args, dtype):
    import torch

    from pagoda.kernels.rotary import apply_rotary_
    from pagoda.layers.rotary import RotaryEmbedding

    num_heads, num_kv_heads, head_size, _ = LAYOUTS[layout]
    rope = RotaryEmbedding(head_size, 131072, {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 8192}).to(DEVICE)
    for num_tokens in sorted({*args.batch_sizes, args.max_batched_tokens}):
        positions = torch.randint(0, 32768, (num_tokens,), device=DEVICE)
        query = torch.randn(num_tokens, num_heads * head_size, dtype=dtype, device=DEVICE)
        key = torch.randn(num_tokens, num_kv_heads * head_size, dtype=dtype, device=DEVICE)
        num_bytes = 2 * (query.nbytes + key.nbytes) + num_tokens * head_size * 4
        yield Case("rotary", layout, "in place", f"tokens {num_tokens:>5}", num_bytes,
                   6 * (query.numel() + key.numel()) // 2,
                   lambda p=positions, q=query, k=key: apply_rotary_(p, q, k, rope.cos_sin_cache, head_size),
                   None if args.no_torch else (lambda p=positions, q=query, k=key: rope(p, q, k)))


def build_cases(kernel: str, layout: str, args, dtype):
    if kernel in ("decode", "prefill", "mixed"):
        return build_attention(kernel, layout, args, dtype)
    return {"kv-write": build_kv_write, "rmsnorm": build_rmsnorm, "rotary": build_rotary}[kernel](layout, args, dtype)


# --- running and reporting ----------------------------------------------------------------------------


def measure(case: Case, peaks: Peaks, args, flush: L2Flush) -> Result:
    import torch

    from pagoda.attention import torch_backend

    seconds = time_cuda(case.run, args.warmup, args.iters, flush)
    torch_us = None
    if case.reference is not None:
        try:
            torch_us = 1e6 * time_cuda(case.reference, min(args.warmup, 1), max(1, args.iters // 2), flush)
        except torch.cuda.OutOfMemoryError:
            case.note = (case.note + ", " if case.note else "") + "torch: out of memory"
        finally:
            # the torch decode path keeps a gather workspace as large as the largest context batch seen
            torch_backend._workspaces.clear()
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    gbs, tflops = case.num_bytes / seconds / 1e9, case.flops / seconds / 1e12
    return Result(case.kernel, case.layout, case.variant, case.shape, 1e6 * seconds, gbs, 100 * gbs / peaks.gbs,
                  tflops, 100 * tflops / peaks.tflops, torch_us, case.note)


HEADER = (f"{'kernel':<9} {'layout':<15} {'variant':<11} {'shape':<30} {'time us':>10} {'GB/s':>8} {'%BW':>5} "
          f"{'TFLOP/s':>8} {'%FLOP':>6} {'torch us':>10} {'x torch':>8}")


def format_row(r: Result) -> str:
    torch_us = f"{r.torch_microseconds:10.1f}" if r.torch_microseconds else f"{'-':>10}"
    speedup = f"{r.torch_microseconds / r.microseconds:7.1f}x" if r.torch_microseconds else f"{'-':>8}"
    note = f"  <- {r.note}" if r.note else ""
    return (f"{r.kernel:<9} {r.layout:<15} {r.variant:<11} {r.shape:<30} {r.microseconds:10.1f} {r.gbs:8.0f} "
            f"{r.pct_peak_gbs:5.0f} {r.tflops:8.2f} {r.pct_peak_tflops:6.1f} {torch_us} {speedup}{note}")


def summarize_decode(results: list[Result]) -> str | None:
    """The issue's aim: decode attention at >= 70% of peak bandwidth for long contexts (the dispatched path)."""
    long = [r for r in results if r.kernel == "decode" and r.note == "dispatch"
            and int(r.shape.split("ctx")[1]) >= 8192]
    if not long:
        return None
    worst = min(long, key=lambda r: r.pct_peak_gbs)
    best = max(long, key=lambda r: r.pct_peak_gbs)
    verdict = "meets" if worst.pct_peak_gbs >= 70 else "misses"
    return (f"decode, contexts >= 8192, dispatched path: {worst.pct_peak_gbs:.0f}%..{best.pct_peak_gbs:.0f}% of peak "
            f"bandwidth (worst: {worst.layout} {worst.variant} {worst.shape.strip()}); {verdict} the 70% aim")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("pagoda bench kernels: skipped: no CUDA device (the kernels are timed on a GPU)")
        return 0
    from pagoda.kernels import paged_attention
    from pagoda.kernels._checks import is_interpreted

    if is_interpreted(paged_attention._mixed_batch_kernel):
        print("pagoda bench kernels: TRITON_INTERPRET=1 is set; unset it to time the compiled kernels")
        return 2
    run(args, device_peaks(args, getattr(torch, args.dtype)))
    return 0


def run(args, peaks: Peaks) -> list[Result]:
    import torch

    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    if args.max_cache_gib is None:
        args.max_cache_gib = free_memory() / 3 / 2**30
    print(f"{peaks.name}: peak {peaks.gbs:.0f} GB/s, {peaks.tflops:.0f} {args.dtype} TFLOP/s ({peaks.source}); "
          f"block size {args.block_size}, KV cache up to {args.max_cache_gib:.1f} GiB, median of {args.iters} calls")
    flush = L2Flush()
    results: list[Result] = []
    for kernel in args.kernels:
        print(f"\n{HEADER}")
        for layout in args.layouts:
            for case in build_cases(kernel, layout, args, dtype):
                result = measure(case, peaks, args, flush)
                results.append(result)
                print(format_row(result), flush=True)
                write_json(args, peaks, results)  # after every row: a run stopped early keeps what it measured
                del case
                if DEVICE == "cuda":
                    torch.cuda.empty_cache()
    summary = summarize_decode(results)
    if summary:
        print(f"\n{summary}")
    write_json(args, peaks, results)
    return results


def write_json(args, peaks: Peaks, results: list[Result]) -> None:
    """The whole file each time, written aside and renamed, so a reader never sees half of it."""
    if args.json_out:
        import os

        with open(f"{args.json_out}.tmp", "w") as f:
            json.dump({"device": asdict(peaks), "dtype": args.dtype, "block_size": args.block_size,
                       "results": [asdict(r) for r in results]}, f, indent=2)
        os.replace(f"{args.json_out}.tmp", args.json_out)


if __name__ == "__main__":
    raise SystemExit(main())
