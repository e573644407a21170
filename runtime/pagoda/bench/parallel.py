"""`pagoda bench parallel`: the throughput workload at TP=1, TP=2, DP=2, and PP=2 with and without a full
pipeline, each in its own run; prints tokens/s, the ratios, and TP=2's per-step overhead
(TP collectives + scheduling) as a fraction of step time.

The default model has 9 attention heads over 3 KV heads, which TP=2 cannot split; without --model the
benchmark runs a model of the same shape but 8 heads over 2 KV heads, with random weights (throughput
does not depend on them), written once into the cache directory."""

import argparse
import json
import time
from pathlib import Path

from pagoda.bench.memory import PeakMemory
from pagoda.bench.throughput import print_table, summarize
from pagoda.bench.workload import check_workload_args, synthetic_requests

CONFIGS = {
    "TP=1": dict(tensor_parallel_size=1),
    "TP=2": dict(tensor_parallel_size=2),
    "DP=2": dict(data_parallel_size=2),
    "PP=2, pipeline full": dict(pipeline_parallel_size=2, pipeline_fill=True),
    "PP=2, one batch at a time": dict(pipeline_parallel_size=2, pipeline_fill=False),
}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="pagoda bench parallel", description=__doc__)
    p.add_argument("--model", default=None,
                   help="model path (default: the default model's shape with 8 heads, random weights)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    args = p.parse_args(argv)
    check_workload_args(p, args)
    return args


def splittable_default_model() -> str:
    """The default model with 8 attention heads over 2 KV heads (head size 72) and random weights."""
    from pagoda.config.default_model import default_model_path, write_model_dir_once
    from pagoda.config.paths import cache_dir

    source = Path(default_model_path())

    def write(out: Path) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        config = json.loads((source / "config.json").read_text())
        config.update(num_attention_heads=8, num_key_value_heads=2, head_dim=config["hidden_size"] // 8)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32).save_pretrained(out)
        AutoTokenizer.from_pretrained(source).save_pretrained(out)

    return str(write_model_dir_once(cache_dir() / "bench" / f"{source.name}-8-heads", write))


def run(args, name: str, requests) -> dict:
    from pagoda import LLM, SamplingParams
    from pagoda.distributed import parallel_state

    llm = LLM(args.model, dtype=args.dtype, seed=args.seed, max_num_seqs=args.max_num_seqs, **CONFIGS[name])
    engine = llm.engine
    for i, r in enumerate(requests):
        engine.add_request(str(i), None, SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True),
                           prompt_token_ids=r.prompt_token_ids)
    parallel_state.comm_seconds = 0.0
    engine.core.schedule_seconds = 0.0
    steps = 0
    with PeakMemory() as mem:
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        elapsed = time.perf_counter() - start
    result = summarize(f"pagoda {name}", requests, elapsed, mem.peak_bytes)
    result["steps"] = steps
    result["overhead_fraction"] = (parallel_state.comm_seconds + engine.core.schedule_seconds) / elapsed
    result["comm_fraction"] = parallel_state.comm_seconds / elapsed
    result["schedule_fraction"] = engine.core.schedule_seconds / elapsed
    engine.shutdown()
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from pagoda.config.model_files import load_hf_config, resolve_model_path

    path = resolve_model_path(args.model) if args.model else splittable_default_model()
    args.model = path
    print(f"model: {path}")
    tok = AutoTokenizer.from_pretrained(path)
    requests = synthetic_requests(args.num_requests, args.seed, tuple(args.prompt_len), tuple(args.output_len),
                                  load_hf_config(path).vocab_size, set(tok.all_special_ids))
    results = {}
    for name in args.configs:
        try:
            results[name] = run(args, name, requests)
        except ValueError as e:  # e.g. a --model whose heads TP=2 cannot split
            print(f"{name}: skipped: {e}")
    if not results:
        return 1
    print_table(list(results.values()))
    print()
    for name, r in results.items():
        print(f"{name}: {r['steps']} steps, {1000 * r['seconds'] / max(r['steps'], 1):.0f} ms/step; overhead "
              f"(TP collectives {100 * r['comm_fraction']:.1f}% + scheduling {100 * r['schedule_fraction']:.1f}%)"
              f" = {100 * r['overhead_fraction']:.1f}% of step time")
    out = {name: r["output_tokens_per_s"] for name, r in results.items()}
    if "TP=1" in out and "TP=2" in out:
        step_ms = {name: r["seconds"] / max(r["steps"], 1) for name, r in results.items()}
        print(f"TP=2 / TP=1 output tokens/s: {out['TP=2'] / out['TP=1']:.2f}x; "
              f"step time {step_ms['TP=2'] / step_ms['TP=1']:.2f}x (target <= 1.1x)")
    if "TP=1" in out and "DP=2" in out:
        print(f"DP=2 / TP=1 output tokens/s: {out['DP=2'] / out['TP=1']:.2f}x")
    if "PP=2, pipeline full" in out and "PP=2, one batch at a time" in out:
        print(f"PP=2 full pipeline / one batch at a time: "
              f"{out['PP=2, pipeline full'] / out['PP=2, one batch at a time']:.2f}x (target >= 1.5x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
