"""Run by a vLLM installation's Python, not Pagoda's (it imports only vLLM and the standard library):
the offline throughput workload through `vllm.LLM`. Reads the requests as JSON from argv[1]; prints one
JSON line with the timing. `pagoda bench throughput --vllm-python PATH` runs it."""

import json
import sys
import time


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec["dtype"], seed=spec["seed"], max_num_seqs=spec["max_num_seqs"],
              max_model_len=spec["max_model_len"], enable_prefix_caching=False)
    startup = time.perf_counter() - start
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in spec["requests"]]
    params = [SamplingParams(temperature=0, max_tokens=r["output_len"], ignore_eos=True) for r in spec["requests"]]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    print("VLLM_PEER_RESULT " + json.dumps({"seconds": elapsed, "startup_seconds": startup,
                                            "output_tokens": produced}), flush=True)


if __name__ == "__main__":  # vLLM's CPU engine starts worker processes: the guard is required
    main()
