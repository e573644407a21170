"""Run by test_engine_lifecycle.py in a fresh interpreter: several TP=2 / PP=2 `LLM`s one after another in one
process, each dropped with `del` and garbage collection only (no explicit shutdown), plus one used as a
context manager. Prints each run's greedy tokens as one JSON line."""

import gc
import json
import sys

from pagoda import LLM, SamplingParams


def main(model_a: str, model_b: str, prompt: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    runs = [(model_a, dict(tensor_parallel_size=2)), (model_b, dict(tensor_parallel_size=2)),
            (model_a, dict(pipeline_parallel_size=2)), (model_b, dict(pipeline_parallel_size=2))]
    for path, kwargs in runs:
        llm = LLM(path, dtype="float32", kv_cache_memory=0.02, **kwargs)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        print(json.dumps({"model": path, **kwargs, "tokens": out.outputs[0].token_ids}), flush=True)
        del llm, out
        gc.collect()
    with LLM(model_a, dtype="float32", kv_cache_memory=0.02, tensor_parallel_size=2) as llm:
        out = llm.generate([prompt], params, use_tqdm=False)[0]
    print(json.dumps({"model": model_a, "tensor_parallel_size": 2, "tokens": out.outputs[0].token_ids}),
          flush=True)
    llm.shutdown()  # again: idempotent


if __name__ == "__main__":
    main(*sys.argv[1:4])
