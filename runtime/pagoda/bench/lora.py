"""LoRA serving cost: one batch of requests run on the base model, then with 1, 4, 16 ... distinct adapters
spread over the same batch, and the time to first token of an adapter the engine has never loaded.

    pagoda bench lora [--model PATH] [--adapters 1 4 16] [--num-requests 32] [--rank 16] [--repeats 3]
                      [--vllm-python PATH]

The adapters are random PEFT LoRA directories written here for the model (rank --rank on q/k/v/o and
gate/up/down of every layer, as a fine-tune typically targets), so no download is needed. Every run is
greedy with ignore_eos, so each request makes exactly --max-tokens tokens. Reported per configuration:
output tokens/s over the batch (and its ratio to the base run), the process's CPU seconds for the batch
(and the base's over this: the throughput ratio of one thread, on a machine shared with other jobs, when
run under `taskset -c N` with OMP_NUM_THREADS=1), median TPOT ((last token - first token) /
(tokens - 1) per request), and median TTFT; then the time to the first token of one request alone with a new
adapter (its files checked, read and put in a slot) against one with an adapter already in a slot.
The base run uses an engine without LoRA; the adapter runs one engine with --max-loras at the largest
count. Each configuration, the base one too, runs the whole batch once as a warm-up (the adapters in their
slots), then --repeats times; a configuration reports its median run (by throughput) and every run's
throughput (`runs_tokens_per_s`). The adapter configurations take turns, round after round, so that a slower
spell of a shared machine falls on all of them, not on one: single runs minutes apart moved the 4-adapter
ratio from 0.69 to 0.89 on one machine. Prefix caching is off in both engines, as in the vLLM peer: the
warm-up runs the same prompts, and a measured run would otherwise find their KV blocks cached and skip most
of its prefill (a run reports its `prefix_cache_hits`, 0 here).

With --vllm-python, the same batches run through vLLM's offline engine (enable_lora, the same adapter
directories) in that interpreter, as `pagoda bench throughput --vllm-python` runs it, once per configuration.
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from pagoda import LLM, LoRARequest, SamplingParams
from pagoda.bench.workload import synthetic_requests

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="pagoda bench lora", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="the base model (default: the default model)")
    p.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 16],
                   help="distinct adapters spread over the batch, one run each (the base run comes first)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="measured runs per configuration (the median reported)")
    p.add_argument("--vllm-python", default=None, help="also run the batches through vLLM in this interpreter")
    p.add_argument("--json", dest="json_out", default=None)
    args = p.parse_args(argv)
    for flag in ("repeats", "num_requests", "prompt_len", "max_tokens", "rank"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if min(args.adapters) < 1:
        p.error(f"--adapters: each count of distinct adapters must be at least 1, got {args.adapters}")
    return args


def write_adapter(out: Path, hf_config, rank: int, seed: int) -> Path:
    """A random PEFT LoRA directory for the model: adapter_config.json and adapter_model.safetensors."""
    import torch
    from safetensors.torch import save_file

    from pagoda.lora.adapter import expected_shapes

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for target, (rows, cols) in expected_shapes(hf_config).items():
            block = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{target}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, cols, generator=generator) / cols ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(rows, rank, generator=generator) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
        "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM"}))
    return out


def run_batch(llm: LLM, requests, loras: list) -> dict:
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    hits = llm.engine.get_stats().prefix_cache_hits
    started, cpu_started = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    hits = llm.engine.get_stats().prefix_cache_hits - hits
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    tpots = [(o.metrics.last_token_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
             for o in outs if len(o.outputs[0].token_ids) > 1]
    ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    return {"output_tokens": tokens, "seconds": round(seconds, 3), "cpu_seconds": round(cpu_seconds, 3),
            "output_tokens_per_s": round(tokens / seconds, 1),
            "median_tpot_ms": round(1000 * statistics.median(tpots), 2),
            "median_ttft_ms": round(1000 * statistics.median(ttfts), 1), "prefix_cache_hits": hits}


def median_run(runs: list[dict]) -> dict:
    """The run of median throughput (the lower middle one of an even count), with every run's throughput."""
    ordered = sorted(runs, key=lambda r: r["output_tokens_per_s"])
    return {**ordered[(len(ordered) - 1) // 2], "runs_tokens_per_s": [r["output_tokens_per_s"] for r in runs]}


def first_token_ms(llm: LLM, request, lora) -> float:
    """Wall time of a one-token request, from the call: for a new adapter this includes the engine's check
    of its files, which happens before the request's arrival time is taken."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    started = time.perf_counter()
    llm.generate({"prompt_token_ids": request.prompt_token_ids}, params, use_tqdm=False, lora_request=lora)
    return round(1000 * (time.perf_counter() - started), 1)


def main(argv=None) -> int:
    args = parse_args(argv)
    from pagoda.config.model_files import load_hf_config, resolve_model_path

    model = resolve_model_path(args.model)
    hf_config = load_hf_config(model)
    requests = synthetic_requests(args.num_requests, args.seed, (args.prompt_len, args.prompt_len),
                                  (args.max_tokens, args.max_tokens), hf_config.vocab_size)
    largest = max(args.adapters)
    results = []
    with tempfile.TemporaryDirectory(prefix="pagoda-bench-lora-") as root:
        paths = [write_adapter(Path(root) / f"a{i}", hf_config, args.rank, args.seed + i) for i in range(largest + 2)]
        adapters = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths)]
        # no prefix caching: each measured run computes its prompts, as its warm-up did (see the docstring)
        common = dict(dtype=args.dtype, seed=args.seed, max_num_seqs=args.num_requests,
                      max_model_len=args.prompt_len + args.max_tokens + 16, enable_prefix_caching=False)
        with LLM(model, **common) as llm:
            run_batch(llm, requests, [None] * len(requests))  # warm-up, the same batch as the adapter runs
            runs = [run_batch(llm, requests, [None] * len(requests)) for _ in range(args.repeats)]
            base = {"adapters": 0, "lora_enabled": False, **median_run(runs)}
        print(json.dumps(base), flush=True)
        results.append(base)
        with LLM(model, enable_lora=True, max_loras=largest, max_lora_rank=args.rank,
                 max_cpu_loras=largest + 2, **common) as llm:
            loras = {count: [adapters[i % count] for i in range(len(requests))] for count in args.adapters}
            for count in args.adapters:
                run_batch(llm, requests, loras[count])  # warm-up: every adapter read and put in its slot
            runs = {count: [] for count in args.adapters}
            for _ in range(args.repeats):  # round after round
                for count in args.adapters:
                    runs[count].append(run_batch(llm, requests, loras[count]))
            for count in args.adapters:
                result = {"adapters": count, "lora_enabled": True, **median_run(runs[count])}
                result["throughput_ratio_to_base"] = round(result["output_tokens_per_s"] / base["output_tokens_per_s"], 3)
                result["tpot_ratio_to_base"] = round(result["median_tpot_ms"] / base["median_tpot_ms"], 3)
                result["cpu_throughput_ratio_to_base"] = round(base["cpu_seconds"] / result["cpu_seconds"], 3)
                print(json.dumps(result), flush=True)
                results.append(result)
            loaded = first_token_ms(llm, requests[0], adapters[0])
            cold = first_token_ms(llm, requests[0], adapters[largest + 1])  # never seen: checked, read, slotted
            ttft = {"ttft_loaded_adapter_ms": loaded, "ttft_new_adapter_ms": cold}
            print(json.dumps(ttft), flush=True)
            results.append(ttft)
        if args.vllm_python:
            from pagoda.bench.vllm_peer import check_vllm_python, run_lora_offline

            python = check_vllm_python(args.vllm_python)
            for count in [0, *args.adapters]:
                peer = run_lora_offline(python, model, requests, [str(p) for p in paths[:count]], dtype=args.dtype,
                                        seed=args.seed, max_num_seqs=args.num_requests,
                                        max_model_len=common["max_model_len"], max_loras=largest, rank=args.rank)
                peer = {"peer": "vllm", "adapters": count, **peer,
                        "output_tokens_per_s": round(peer["output_tokens"] / peer["seconds"], 1)}
                print(json.dumps(peer), flush=True)
                results.append(peer)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
