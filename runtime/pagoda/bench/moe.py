"""`pagoda bench moe`: a mixture-of-experts model to benchmark, and where its decode step's time goes.

    pagoda bench moe write DIR [--hidden-size 1024 --num-experts 8 --top-k 2 ...]
        a Mixtral-shaped checkpoint with random weights, written by transformers (bfloat16 safetensors, the
        default model's tokenizer), that vLLM's CPU build loads as well as Pagoda
    pagoda bench moe profile --model DIR [--batch 16 --context 256 --steps 8 --tensor-parallel-size 2 ...]
        pure decode steps under torch.profiler (rank 0's process): the share of a step spent in the MoE layers,
        split into routing (router matmul, top-k, sort, counts), gathering and combining (index_select,
        index_add, scaling, copies), the experts' matmuls, their activation, the all-reduce (TP/EP), and the
        Python between ops

Throughput and TPOT, TP=2 against EP=2: ``pagoda bench throughput --model DIR --tensor-parallel-size 2
[--enable-expert-parallel]`` (docs/benchmarks.md).
"""

import argparse
import shutil
from collections import defaultdict
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja")


def write_moe_checkpoint(out: str | Path, hidden_size: int = 1024, num_layers: int = 4, num_experts: int = 8,
                         top_k: int = 2, intermediate_size: int = 3584, num_heads: int = 16, num_kv_heads: int = 8,
                         seed: int = 0, tokenizer_dir: str | None = None) -> Path:
    """A MixtralForCausalLM directory: config.json, random bfloat16 weights as transformers initialises and
    saves them (per-expert tensors, the checkpoint format), and a real tokenizer (default: the default
    model's) so that both engines tokenise alike."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from pagoda.config.default_model import default_model_path

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    source = Path(tokenizer_dir or default_model_path())
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    tokenizer = AutoTokenizer.from_pretrained(out)
    config = AutoConfig.for_model(
        "mixtral", architectures=["MixtralForCausalLM"], vocab_size=len(tokenizer), hidden_size=hidden_size,
        intermediate_size=intermediate_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, num_local_experts=num_experts, num_experts_per_tok=top_k,
        max_position_embeddings=4096, sliding_window=None, tie_word_embeddings=False, rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, initializer_range=0.02)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    return out


# What a profiler event directly inside a MoE layer is: the labels ``instrument`` puts on the routers, the
# experts' matmuls, their activation and the all-reduce, then the remaining ops by name (the first match wins).
CATEGORIES = [
    ("routing", ("pagoda.moe.router", "topk", "softmax", "sigmoid", "sort", "bincount", "div", "sum", "clamp")),
    ("expert matmuls", ("pagoda.moe.expert_matmul",)),
    ("activation", ("pagoda.moe.activation",)),
    ("all-reduce", ("pagoda.moe.all_reduce",)),
    ("gather / combine", ("index_select", "index_add", "index_put", "zeros", "mul", "copy", "to", "empty", "sub", "add",
                          "local_scalar")),
]
BETWEEN_OPS = "Python between ops"


def category(event_name: str) -> str:
    name = event_name.lower()
    for label, needles in CATEGORIES:
        if any(n in name for n in needles):
            return label
    return "other"


def _labelled(function, label: str):
    def run(*args, **kwargs):
        with torch.profiler.record_function(label):
            return function(*args, **kwargs)
    return run


def instrument(model: torch.nn.Module) -> int:
    """Label, for the profiler, every MoE layer's forward and within it the routers, the experts' matmuls and
    their activation: on these instances only (the model's layers skip nn.Module hooks, and nothing outside
    this benchmark is labelled). Returns how many MoE layers were found."""
    from pagoda.layers.moe import Router, SparseMoE

    count = 0
    for module in model.modules():
        if isinstance(module, SparseMoE):
            module.forward = _labelled(module.forward, "pagoda.moe")
            module.act_and_mul = _labelled(module.act_and_mul, "pagoda.moe.activation")
            for expert in module.experts:
                for linear in (expert.gate_up_proj, expert.down_proj):
                    linear.matmul = _labelled(linear.matmul, "pagoda.moe.expert_matmul")
            count += 1
        elif isinstance(module, Router):
            module.forward = _labelled(module.forward, "pagoda.moe.router")
    return count


def breakdown(events) -> dict:
    """From the profiler's events: step time, MoE time, and the MoE time by category (direct children of each
    MoE range by name; the range's time not in any child is Python between ops), all in microseconds."""
    steps = [e for e in events if e.name == "pagoda.decode_step"]
    layers = [e for e in events if e.name == "pagoda.moe"]
    by_category: dict[str, float] = defaultdict(float)
    by_op: dict[str, float] = defaultdict(float)
    for layer in layers:
        inside = 0.0
        for child in layer.cpu_children:
            by_category[category(child.name)] += child.cpu_time_total
            by_op[child.name] += child.cpu_time_total
            inside += child.cpu_time_total
        by_category[BETWEEN_OPS] += max(layer.cpu_time_total - inside, 0.0)
    return {"num_steps": len(steps), "step_us": sum(e.cpu_time_total for e in steps),
            "moe_us": sum(e.cpu_time_total for e in layers), "by_category": dict(by_category), "by_op": dict(by_op)}


def profile_decode(model: str, batch: int, context: int, steps: int, dtype: str = "auto", seed: int = 0,
                   **engine_kwargs) -> dict:
    """`batch` sequences of `context` random prompt tokens are prefilled, decoded 2 steps, then `steps` pure
    decode steps run under the profiler."""
    from pagoda import LLM, SamplingParams
    from pagoda.layers import moe

    llm = LLM(model, dtype=dtype, seed=seed, max_num_seqs=batch, enable_prefix_caching=False, **engine_kwargs)
    engine = llm.engine
    all_reduce = moe.tp_all_reduce
    moe.tp_all_reduce = _labelled(all_reduce, "pagoda.moe.all_reduce")  # the MoE layers' own, in this process
    try:
        found = instrument(engine.executor.runner.model)
        if not found:
            raise SystemExit(f"{model}: no mixture-of-experts layer on rank 0 (a dense model, or PP put none here)")
        generator = torch.Generator().manual_seed(seed)
        vocab = engine.config.model.hf_config.vocab_size
        params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
        for i in range(batch):
            prompt = torch.randint(100, vocab - 1, (context,), generator=generator).tolist()
            engine.add_request(str(i), None, params, prompt_token_ids=prompt)
        running = lambda: [s for sc in engine.schedulers for s in sc.running]  # noqa: E731
        while len(running()) < batch or any(s.num_computed_tokens < s.num_tokens - 1 for s in running()):
            engine.step()
        for _ in range(2):
            engine.step()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                with torch.profiler.record_function("pagoda.decode_step"):
                    engine.step()
        result = breakdown(prof.events())
        result.update(batch=batch, context=context, moe_layers=found, dtype=engine.config.model.dtype,
                      tensor_parallel_size=engine.config.parallel.tensor_parallel_size,
                      expert_parallel=engine.config.parallel.enable_expert_parallel)
        return result
    finally:
        moe.tp_all_reduce = all_reduce
        engine.shutdown()


def print_breakdown(r: dict) -> None:
    step_ms = r["step_us"] / r["num_steps"] / 1000
    moe_ms = r["moe_us"] / r["num_steps"] / 1000
    split = "EP" if r["expert_parallel"] else "TP"
    print(f"decode step, batch {r['batch']}, context {r['context']}, {r['dtype']}, {split}={r['tensor_parallel_size']} "
          f"(rank 0): {step_ms:.2f} ms; its {r['moe_layers']} MoE layers {moe_ms:.2f} ms "
          f"({100 * r['moe_us'] / r['step_us']:.1f}% of the step)")
    print(f"{'in the MoE layers':<28} {'ms/step':>8} {'% of MoE':>9} {'% of step':>10}")
    for label, us in sorted(r["by_category"].items(), key=lambda kv: -kv[1]):
        print(f"{label:<28} {us / r['num_steps'] / 1000:>8.3f} {100 * us / r['moe_us']:>9.1f} "
              f"{100 * us / r['step_us']:>10.1f}")
    print("ops in the MoE layers (ms/step): " + ", ".join(
        f"{name} {us / r['num_steps'] / 1000:.3f} [{category(name)}]"
        for name, us in sorted(r["by_op"].items(), key=lambda kv: -kv[1])[:12]))


def parse_args(argv):
    p = argparse.ArgumentParser(prog="pagoda bench moe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="action", required=True)
    w = sub.add_parser("write", help="write a Mixtral-shaped checkpoint with random weights")
    w.add_argument("dir")
    w.add_argument("--hidden-size", type=int, default=1024)
    w.add_argument("--num-layers", type=int, default=4)
    w.add_argument("--num-experts", type=int, default=8)
    w.add_argument("--top-k", type=int, default=2)
    w.add_argument("--intermediate-size", type=int, default=3584, help="of each expert")
    w.add_argument("--num-heads", type=int, default=16)
    w.add_argument("--num-kv-heads", type=int, default=8)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--tokenizer", default=None, help="copy the tokenizer from this directory (default: the "
                                                     "default model's)")
    r = sub.add_parser("profile", help="where a decode step's time goes in the MoE layers")
    r.add_argument("--model", required=True)
    r.add_argument("--dtype", default="auto")
    r.add_argument("--batch", type=int, default=16)
    r.add_argument("--context", type=int, default=256)
    r.add_argument("--steps", type=int, default=8)
    r.add_argument("--tensor-parallel-size", type=int, default=1)
    r.add_argument("--enable-expert-parallel", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.action == "write":
        for flag in ("hidden_size", "num_layers", "num_experts", "top_k", "intermediate_size", "num_heads",
                     "num_kv_heads"):
            if getattr(args, flag) < 1:
                raise SystemExit(f"pagoda bench moe write: error: --{flag.replace('_', '-')} must be >= 1")
        if args.top_k > args.num_experts:
            raise SystemExit("pagoda bench moe write: error: --top-k must be <= --num-experts")
        if args.hidden_size % args.num_heads or args.num_heads % args.num_kv_heads:
            raise SystemExit("pagoda bench moe write: error: --num-heads must divide --hidden-size and "
                             "--num-kv-heads must divide --num-heads")
        out = write_moe_checkpoint(args.dir, args.hidden_size, args.num_layers, args.num_experts, args.top_k,
                                   args.intermediate_size, args.num_heads, args.num_kv_heads, args.seed, args.tokenizer)
        print(out)
        return 0
    from pagoda import platform

    result = profile_decode(args.model, args.batch, args.context, args.steps, args.dtype,
                            tensor_parallel_size=args.tensor_parallel_size,
                            enable_expert_parallel=args.enable_expert_parallel)
    print(f"CPU: {platform.cpu_isa().model}; {torch.get_num_threads()} threads")
    print_breakdown(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
