"""`pagoda bench throughput`: a fixed synthetic workload through Pagoda and through transformers.

Pagoda runs all requests with continuous batching; transformers runs them one at a time and in static
left-padded batches. Output tokens count only what each request asked for (padding waste is not
counted as work). Also reports Pagoda's TPOT and its decode model-FLOP utilisation against the measured
matmul peak (of a mixture of experts, only the top-k experts each token is routed to count as work).
"""

import argparse
import json
import statistics
import time

import torch

from pagoda.bench.memory import PeakMemory
from pagoda.bench.vllm_peer import check_vllm_python, run_offline
from pagoda.bench.workload import check_workload_args, synthetic_requests
from pagoda.platform.isa import ALL_LEVELS


def parse_args(argv):
    p = argparse.ArgumentParser(prog="pagoda bench throughput", description=__doc__)
    p.add_argument("--model", default=None, help="model path (default: the default model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    p.add_argument("--hf-sequential-requests", type=int, default=8,
                   help="requests timed for transformers one-at-a-time (a rate: a subset keeps the run short)")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--skip-hf", action="store_true", help="only run Pagoda")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", type=int, default=1)
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="DP ranks, each its own scheduler and KV cache (with --enable-expert-parallel the experts "
                        "split over all DP x TP ranks; docs/distributed.md)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE: whole experts split over the tensor-parallel (and data-parallel) ranks "
                        "(docs/distributed.md)")
    p.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="also run the workload through vLLM from this installation's Python (or venv directory), "
                        "after Pagoda, so that the ratio is measured in one run")
    p.add_argument("--vllm-dtype", default=None,
                   help="vLLM's dtype (default: the one Pagoda resolved); compare against vLLM's best on the machine")
    p.add_argument("--json", dest="json_out", default=None, help="also write the results to this file")
    p.add_argument("--isa", default=None, choices=ALL_LEVELS, metavar="LEVEL",
                   help="run Pagoda's kernels (and torch's ATen, MKL and oneDNN) at this CPU ISA level, to show on "
                        f"one machine what a lesser CPU gets: {', '.join(ALL_LEVELS)} (default: PAGODA_CPU_ISA, "
                        "else native)")
    args = p.parse_args(argv)
    check_workload_args(p, args)
    return args


def matmul_flops(dtype: torch.dtype, device: str, size: int = 1024, repeats: int = 20) -> float:
    """The machine's matmul peak through the engine's own matmul (on the CPU in bfloat16, the packed weight
    pagoda.platform chose, so that a forced ISA level is measured as the engine runs it): the fastest of
    `repeats` square matmuls (the best one, not the mean, so a neighbour's burst or a process still exiting
    does not lower the peak and inflate the MFU)."""
    from pagoda.layers import packed_weights

    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    layer = torch.nn.Linear(size, size, bias=False, dtype=dtype, device=device)
    layer.packed_weight = None
    if packed_weights.packing_supported(torch.device(device), dtype):
        layer.packed_weight = packed_weights.pack(b)

    def product():
        return packed_weights.linear(a, layer) if layer.packed_weight is not None else a @ b

    for _ in range(2):
        product()
    fastest = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        product()
        if device == "cuda":
            torch.cuda.synchronize()
        fastest = min(fastest, time.perf_counter() - start)
    return 2 * size**3 / fastest


def decode_flops(hf_config, context_lens: list[int]) -> float:
    """Model FLOPs of one decode step: 2 x the matmul weights each token multiplies, plus attention over each
    context. A mixture-of-experts layer counts its router and the top-k experts a token is routed to (and a
    shared expert with its gate), not the experts it skips."""
    from pagoda.models.family import moe_config

    h, layers = hf_config.hidden_size, hf_config.num_hidden_layers
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    head_dim = getattr(hf_config, "head_dim", None) or h // heads
    attention_params = h * (heads + 2 * kv_heads) * head_dim + heads * head_dim * h
    dense_mlp = 3 * h * hf_config.intermediate_size
    moe = moe_config(hf_config)
    if moe is None:
        mlp_params = layers * dense_mlp
    else:
        shared = 3 * h * moe.shared_expert_intermediate_size + h if moe.shared_expert_intermediate_size else 0
        active_moe = h * moe.num_experts + moe.top_k * 3 * h * moe.intermediate_size + shared
        num_sparse = sum(moe.sparse_layers)
        mlp_params = num_sparse * active_moe + (layers - num_sparse) * dense_mlp
    matmul_params = layers * attention_params + mlp_params + hf_config.vocab_size * h
    attention = sum(4 * layers * heads * head_dim * ctx for ctx in context_lens)
    return 2 * matmul_params * len(context_lens) + attention


def run_pagoda(args, requests):
    from pagoda import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, seed=args.seed, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
              data_parallel_size=args.data_parallel_size, enable_expert_parallel=args.enable_expert_parallel)
    engine = llm.engine
    for i, r in enumerate(requests):
        engine.add_request(str(i), None, SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True),
                           prompt_token_ids=r.prompt_token_ids)
    decode_time = decode_work = 0.0
    decode_steps = 0
    tpots = []
    with PeakMemory() as mem:
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            running = [s for sc in engine.schedulers for s in sc.running]
            pure_decode = not any(sc.waiting for sc in engine.schedulers) and all(
                s.num_computed_tokens == s.num_tokens - 1 for s in running)
            step_start = time.perf_counter()
            finished = [out for out in engine.step() if out.finished]
            if pure_decode and running:
                decode_time += time.perf_counter() - step_start
                decode_steps += 1
                decode_work += decode_flops(engine.config.model.hf_config, [s.num_tokens for s in running])
            tpots += [request_tpot(out) for out in finished if len(out.outputs[0].token_ids) > 1]
        elapsed = time.perf_counter() - start
    result = summarize("pagoda", requests, elapsed, mem.peak_bytes)
    result["decode_flops_per_s"] = decode_work / decode_time if decode_time else 0.0
    result["tpot_ms"] = {"mean": 1000 * statistics.mean(tpots), "median": 1000 * statistics.median(tpots)} \
        if tpots else None
    result["decode_step_ms"] = 1000 * decode_time / decode_steps if decode_steps else None
    result["dtype"] = engine.config.model.dtype
    result["device"] = engine.config.device
    engine.shutdown()
    return result


def request_tpot(out) -> float:
    """Seconds per output token after the first, as vLLM's benchmarks count TPOT."""
    m = out.metrics
    return (m.last_token_time - m.first_token_time) / (len(out.outputs[0].token_ids) - 1)


def run_vllm(python: str, args, path: str, dtype: str, requests):
    """The same requests through vLLM (same model directory, dtype, seed and max_num_seqs), in its own venv."""
    from pagoda.config.model_files import load_hf_config

    max_len = max(len(r.prompt_token_ids) + r.output_len for r in requests)
    max_model_len = min(load_hf_config(path).max_position_embeddings, max(2048, max_len))
    timing = run_offline(python, path, requests, dtype=dtype, seed=args.seed, max_num_seqs=args.max_num_seqs,
                         max_model_len=max_model_len)
    if timing["output_tokens"] != sum(r.output_len for r in requests):
        raise RuntimeError(f"vLLM produced {timing['output_tokens']} tokens, not the workload's")
    result = summarize(f"vLLM (CPU build, {dtype}, same workload)", requests, timing["seconds"], 0)
    result["peak_memory_gib"] = float("nan")  # another process tree: not measured
    result["startup_seconds"] = timing["startup_seconds"]
    return result


def run_hf(args, requests, batch_size: int):
    from transformers import AutoModelForCausalLM

    from pagoda.config import resolve_device, resolve_dtype
    from pagoda.config.model_files import resolve_model_path
    from pagoda.worker.model_runner import TORCH_DTYPES

    path = resolve_model_path(args.model)
    device = resolve_device("auto")
    dtype = TORCH_DTYPES[resolve_dtype(args.dtype, device, None)]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    with PeakMemory() as mem, torch.inference_mode():
        start = time.perf_counter()
        for i in range(0, len(requests), batch_size):
            batch = requests[i : i + batch_size]
            width = max(len(r.prompt_token_ids) for r in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, r in enumerate(batch):  # left padding
                ids[row, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
                mask[row, width - len(r.prompt_token_ids) :] = 1
            new = max(r.output_len for r in batch)
            model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=pad)
        elapsed = time.perf_counter() - start
    name = "transformers, one at a time" if batch_size == 1 else f"transformers, static batches of {batch_size}"
    return summarize(name, requests, elapsed, mem.peak_bytes)


def summarize(name, requests, elapsed, peak_bytes):
    out_tokens = sum(r.output_len for r in requests)
    total = out_tokens + sum(len(r.prompt_token_ids) for r in requests)
    return {"name": name, "requests": len(requests), "seconds": elapsed, "output_tokens_per_s": out_tokens / elapsed,
            "total_tokens_per_s": total / elapsed, "requests_per_s": len(requests) / elapsed,
            "peak_memory_gib": peak_bytes / 2**30}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from pagoda import platform

    if args.isa:
        try:
            platform.force_level(args.isa)
        except platform.UnsupportedIsa as e:
            raise SystemExit(f"--isa: {e}") from None
    from transformers import AutoTokenizer

    from pagoda.config.model_files import load_hf_config, resolve_model_path

    path = resolve_model_path(args.model)
    hf_config = load_hf_config(path)
    tok = AutoTokenizer.from_pretrained(path)
    requests = synthetic_requests(args.num_requests, args.seed, tuple(args.prompt_len), tuple(args.output_len),
                                  hf_config.vocab_size, set(tok.all_special_ids))
    vllm_python = check_vllm_python(args.vllm_python) if args.vllm_python else None
    results = [run_pagoda(args, requests)]
    if vllm_python:
        results.append(run_vllm(vllm_python, args, path, args.vllm_dtype or results[0]["dtype"], requests))
    if not args.skip_hf:
        results.append(run_hf(args, requests[: args.hf_sequential_requests], 1))
        results.append(run_hf(args, requests, args.hf_batch_size))
    isa = platform.cpu_isa()
    print(f"CPU: {isa.model}; ISA level {isa.level}" + (" (forced)" if isa.forced else " (native)")
          + f"; {torch.get_num_threads()} threads")
    print_table(results)
    pagoda = results[0]
    peak = matmul_flops(torch.float32 if pagoda["dtype"] == "float32" else getattr(torch, pagoda["dtype"]),
                        pagoda["device"])
    mfu = pagoda["decode_flops_per_s"] / peak
    if pagoda["tpot_ms"] is not None:
        step = pagoda["decode_step_ms"]
        print(f"\nPagoda TPOT: mean {pagoda['tpot_ms']['mean']:.1f} ms, median {pagoda['tpot_ms']['median']:.1f} ms"
              + (f"; mean pure-decode step {step:.1f} ms" if step else ""))
    print(f"\nPagoda decode: {pagoda['decode_flops_per_s'] / 1e9:.1f} GFLOP/s achieved; machine matmul peak "
          f"{peak / 1e9:.1f} GFLOP/s ({pagoda['dtype']}); model FLOP utilisation {100 * mfu:.1f}%")
    for other in results[1:]:
        print(f"Pagoda vs {other['name']}: {pagoda['output_tokens_per_s'] / other['output_tokens_per_s']:.2f}x "
              "output tokens/s")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"results": results, "matmul_flops_per_s": peak, "decode_mfu": mfu, "cpu": isa.model,
                       "isa_level": isa.level, "isa_forced": isa.forced, "amx": isa.amx}, f, indent=2)
    return 0


def print_table(results):
    header = f"{'engine':<36} {'reqs':>5} {'seconds':>8} {'out tok/s':>10} {'total tok/s':>12} {'req/s':>7} {'peak GiB':>9}"
    print(header)
    print("-" * len(header))
    for r in results:
        print(f"{r['name']:<36} {r['requests']:>5} {r['seconds']:>8.1f} {r['output_tokens_per_s']:>10.1f} "
              f"{r['total_tokens_per_s']:>12.1f} {r['requests_per_s']:>7.2f} {r['peak_memory_gib']:>9.2f}")


if __name__ == "__main__":
    raise SystemExit(main())
