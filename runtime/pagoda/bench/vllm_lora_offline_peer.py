"""Run by a vLLM installation's Python, not Pagoda's (it imports only vLLM and the standard library):
`pagoda bench lora`'s batch through `vllm.LLM(enable_lora=True)`, the adapters spread round-robin over the
requests (none: the base model, LoRA off). Reads the spec as JSON from argv[1]; prints one JSON line."""

import json
import statistics
import sys
import time


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    adapters = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(spec["adapters"])]
    lora = dict(enable_lora=True, max_loras=spec["max_loras"], max_lora_rank=spec["max_lora_rank"],
                max_cpu_loras=max(spec["max_loras"], len(adapters))) if adapters else {}
    start = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec["dtype"], seed=spec["seed"], max_num_seqs=spec["max_num_seqs"],
              max_model_len=spec["max_model_len"], enable_prefix_caching=False, **lora)
    startup = time.perf_counter() - start
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in spec["requests"]]
    params = [SamplingParams(temperature=0, max_tokens=r["output_len"], ignore_eos=True) for r in spec["requests"]]
    loras = [adapters[i % len(adapters)] for i in range(len(prompts))] if adapters else None
    llm.generate(prompts, params, use_tqdm=False, lora_request=loras)  # warm-up: the adapters in their slots
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    tpots = []
    for o in outputs:
        m, n = o.metrics, len(o.outputs[0].token_ids)
        if m is not None and n > 1 and getattr(m, "last_token_time", None) and getattr(m, "first_token_time", None):
            tpots.append((m.last_token_time - m.first_token_time) / (n - 1))
    print("VLLM_PEER_RESULT " + json.dumps({
        "seconds": elapsed, "startup_seconds": startup, "output_tokens": produced,
        "median_tpot_ms": round(1000 * statistics.median(tpots), 2) if tpots else None}), flush=True)


if __name__ == "__main__":  # vLLM's CPU engine starts worker processes: the guard is required
    main()
