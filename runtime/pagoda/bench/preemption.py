"""`python -m pagoda.bench.preemption`: throughput under KV-cache pressure, preempting by swap vs recompute.

A fixed synthetic workload (all requests at once) through `LLM` with a KV cache far smaller than the
requests need, so sequences are preempted again and again; each preemption mode runs the same requests.
Also reports how many requests' greedy outputs agree between the modes: in float32 all of them; in
bfloat16 a recomputed prefill's KV differs in its last bits from the KV computed token by token (and
swapped back unchanged), so a few greedy continuations may part.
"""

import argparse
import json
import time

from pagoda.bench.workload import synthetic_requests


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m pagoda.bench.preemption", description=__doc__)
    p.add_argument("--model", default=None, help="model path (default: the default model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(64, 256), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(64, 192), metavar=("MIN", "MAX"))
    p.add_argument("--kv-cache-blocks", type=int, default=64, help="KV-cache size in blocks of 16 tokens")
    p.add_argument("--swap-space", type=float, default=0.5, help="GiB of swap space in the swap run")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--modes", nargs="+", default=["recompute", "swap"], choices=["recompute", "swap"])
    p.add_argument("--json", dest="json_out", default=None, help="also write the results to this file")
    return p.parse_args(argv)


def run_mode(args, mode: str, requests) -> dict:
    from pagoda import LLM, SamplingParams
    from pagoda.config import EngineArgs, create_engine_config

    probe = create_engine_config(EngineArgs(model=args.model, dtype=args.dtype, swap_space=0))
    hf = probe.model.hf_config
    head_size = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    block_bytes = (2 * 16 * hf.num_key_value_heads * head_size * hf.num_hidden_layers
                   * (4 if probe.model.dtype == "float32" else 2))
    swap = args.swap_space if mode == "swap" else 0
    with LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
             kv_cache_memory=args.kv_cache_blocks * block_bytes / 2**30, swap_space=swap,
             preemption_mode=mode) as llm:
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
        params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
        started = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        stats = llm.engine.get_stats()
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "mode": mode, "seconds": round(seconds, 2), "output_tok_s": round(output_tokens / seconds, 1),
        "kv_blocks": llm.engine.num_blocks, "swap_blocks": stats.num_swap_blocks_total,
        "preemptions": stats.num_preemptions, "swapped_out": stats.num_swapped_out,
        "recomputed": stats.num_recomputed, "tokens": [o.outputs[0].token_ids for o in outs],
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    requests = synthetic_requests(args.num_requests, args.seed, tuple(args.prompt_len), tuple(args.output_len),
                                  vocab_size=32000, special_ids={0, 1, 2})
    results = [run_mode(args, mode, requests) for mode in args.modes]
    same = sum(all(r["tokens"][i] == results[0]["tokens"][i] for r in results) for i in range(len(requests)))
    print("| mode | seconds | output tok/s | KV blocks | swap blocks | preemptions | swapped out | recomputed |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['mode']} | {r['seconds']} | {r['output_tok_s']} | {r['kv_blocks']} | {r['swap_blocks']} | "
              f"{r['preemptions']} | {r['swapped_out']} | {r['recomputed']} |")
    print(f"identical greedy outputs in every mode: {same}/{len(requests)} requests")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"identical_outputs": same, "runs": [{k: v for k, v in r.items() if k != "tokens"}
                                                           for r in results]}, f, indent=2)


if __name__ == "__main__":
    main()
