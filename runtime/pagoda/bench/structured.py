"""`python -m pagoda.bench.structured`: the cost of structured outputs. One batch of requests decoded
twice: all free, then half of them constrained by a JSON schema (the other half free, one forward pass
per step). Every output runs to max_tokens (the schema asks for a long array), so both runs compute the
same number of tokens and the difference in time is the grammar's cost."""

import argparse
import time

from pagoda.sampling_params import StructuredOutputsParams

ITEM = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "kind": {"enum": ["cat", "dog", "fox"]}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
    "required": ["name", "age", "kind", "tags"], "additionalProperties": False}
SCHEMA = {"type": "array", "items": ITEM, "minItems": 1000}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m pagoda.bench.structured", description=__doc__)
    p.add_argument("--model", default=None, help="model path (default: the default model)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=2, help="runs of each kind (the fastest counts)")
    return p.parse_args(argv)


def timed_run(llm, batch: int, max_tokens: int, constrained: bool) -> tuple[float, int]:
    from pagoda import SamplingParams

    free = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    json_ = SamplingParams(temperature=0, max_tokens=max_tokens,
                           structured_outputs=StructuredOutputsParams(json=SCHEMA))
    params = [json_ if constrained and i % 2 else free for i in range(batch)]
    prompts = [f"Write JSON about animal number {i}:" for i in range(batch)]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)


def main(argv=None) -> None:
    from pagoda import LLM

    args = parse_args(argv)
    llm = LLM(args.model, max_num_seqs=args.batch)
    timed_run(llm, 4, 4, True)  # warm up: the grammar compiled and cached, kernels built
    best = {}
    for _ in range(args.repeats):
        for constrained in (False, True):
            elapsed, tokens = timed_run(llm, args.batch, args.max_tokens, constrained)
            best[constrained] = min(best.get(constrained, (float("inf"), 0)), (elapsed, tokens))
    (free_s, free_tokens), (mixed_s, mixed_tokens) = best[False], best[True]
    print(f"batch {args.batch}, {args.max_tokens} tokens each")
    print(f"  all free:              {free_tokens} tokens in {free_s:.2f} s, {1e3 * free_s / free_tokens:.2f} ms/token")
    print(f"  half JSON-constrained: {mixed_tokens} tokens in {mixed_s:.2f} s, "
          f"{1e3 * mixed_s / mixed_tokens:.2f} ms/token")
    extra = (mixed_s / mixed_tokens) / (free_s / free_tokens) - 1
    print(f"  cost: {100 * extra:+.1f}% per token over the batch, {200 * extra:+.1f}% per constrained token")
    llm.shutdown()


if __name__ == "__main__":
    main()
