"""Speculative decoding: TPOT at concurrency 1 on an input-grounded workload, without speculation, with
n-gram (prompt lookup) drafts and with a draft model.

Each request asks the chat model to repeat or lightly edit a paragraph it is given, the workload where
prompt lookup finds its drafts (editing code or documents, quoting a retrieved passage). Requests run one at
a time, greedy; TPOT is (last token time - first token time) / (tokens - 1) per request, the median is
reported with the acceptance figures and whether the tokens equal the run without speculation.

    pagoda bench spec-decode [--model PATH] [--draft-model PATH] [--configs none ngram draft]

The draft model defaults to the target itself: that checks the mechanics (every greedy draft is accepted)
but saves nothing, since the draft costs as much as the target; a real draft is several times smaller.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

from pagoda import LLM, SamplingParams

PARAGRAPHS = [
    "Paged attention stores the keys and values of every sequence in fixed-size blocks, so memory is allocated "
    "on demand and blocks can be shared between requests that start with the same prompt.",
    "Continuous batching lets new requests join the running batch between two steps of the model, instead of "
    "waiting for the slowest request of a static batch to finish.",
    "A Kubernetes operator watches custom resources and turns each of them into the StatefulSets, Services and "
    "autoscalers that run it, updating their status as the pods come and go.",
    "Speculative decoding lets a cheap proposer guess several tokens ahead; the large model checks all the "
    "guesses in one forward pass and keeps the longest prefix it agrees with.",
]
INSTRUCTIONS = ["Repeat this text exactly, word for word:", "Rewrite this text with every sentence on its own line:"]


def parse_args(argv):
    p = argparse.ArgumentParser(prog="pagoda bench spec-decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="the target (default: the default model)")
    p.add_argument("--draft-model", default=None, help="the draft model (default: the target itself)")
    p.add_argument("--configs", nargs="+", default=["none", "ngram", "draft"], choices=["none", "ngram", "draft"])
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--json", dest="json_out", default=None)
    return p.parse_args(argv)


def speculative_config(args, name: str) -> dict | None:
    if name == "ngram":
        return {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
                "prompt_lookup_max": args.prompt_lookup_max, "prompt_lookup_min": args.prompt_lookup_min}
    if name == "draft":
        from pagoda.config.model_files import resolve_model_path

        return {"model": args.draft_model or resolve_model_path(args.model),
                "num_speculative_tokens": args.num_speculative_tokens}
    return None


def run_config(args, name: str) -> tuple[dict, list[list[int]]]:
    llm = LLM(args.model, dtype=args.dtype, max_model_len=1024, speculative_config=speculative_config(args, name))
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    conversations = [[{"role": "user", "content": f"{instruction}\n\n{text}"}]
                     for instruction in INSTRUCTIONS for text in PARAGRAPHS]
    try:
        llm.chat(conversations[0], params, use_tqdm=False)  # warm-up
        before = llm.engine.get_stats()
        tpots, tokens = [], []
        started = time.perf_counter()
        for conversation in conversations:  # concurrency 1
            out = llm.chat(conversation, params, use_tqdm=False)[0]
            ids, m = out.outputs[0].token_ids, out.metrics
            tokens.append(ids)
            if len(ids) > 1:
                tpots.append((m.last_token_time - m.first_token_time) / (len(ids) - 1))
        seconds = time.perf_counter() - started
        stats = llm.engine.get_stats()
    finally:
        llm.shutdown()
    drafts = stats.spec_decode_num_drafts - before.spec_decode_num_drafts
    drafted = stats.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = stats.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    return {
        "config": name, "speculative_config": speculative_config(args, name), "requests": len(conversations),
        "output_tokens": sum(map(len, tokens)), "seconds": round(seconds, 2),
        "median_tpot_ms": round(1000 * statistics.median(tpots), 2),
        "draft_acceptance_rate": round(accepted / drafted, 3) if drafted else None,
        "mean_acceptance_length": round(1 + accepted / drafts, 2) if drafts else None,
    }, tokens


def main(argv=None) -> int:
    args = parse_args(argv)
    results, first = [], None
    for name in args.configs:
        result, tokens = run_config(args, name)
        if first is None:
            first = tokens
        result["same_tokens_as_first_config"] = tokens == first
        if results:
            result["tpot_ratio_to_first_config"] = round(result["median_tpot_ms"] / results[0]["median_tpot_ms"], 3)
        results.append(result)
        print(json.dumps(result), flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
