"""Quantization figures on one model (default: the default model): bf16 against int8, int4 and FP8.

Per scheme: weight memory, KV-cache blocks in the default kv_cache_memory, greedy agreement with the
unquantized engine over fixed prompts, perplexity on a fixed text, the chat answer to "What is the capital
of France?", TPOT at one sequence and output throughput at 32. Perplexity runs transformers on the weights
quantized and dequantized by Pagoda's own functions (the engine's quantized layers equal those weights up to
float rounding: tests/model/test_quantization.py); "engine perplexity" is the engine's own, from its prompt
log-probs over the same text, the only one that sees an fp8 KV cache.

    python -m pagoda.bench.quantization [--model PATH] [--schemes none int8 int4 int4-g32 float32 fp8 fp8kv]

A scheme is none (the model dtype, "auto"), int8, int4 (the default group), int4-g<N>, fp8 (online FP8
weights), or float32 (unquantized in float32, to compare with the noise bfloat16 rounding alone causes);
"+fp8kv" adds an fp8 (e4m3) KV cache, and "fp8kv" alone is the model dtype's weights with one
(e.g. fp8+fp8kv). Agreement is measured against the first scheme.
"""

import argparse
import json
import time

import torch

from pagoda import LLM, SamplingParams
from pagoda.layers.linear import LinearBase
from pagoda.layers.quantization import fp8, int4, int8
from pagoda.layers.quantization.methods import weight_bytes

PROMPTS = [
    "The history of the Roman Empire", "def fibonacci(n):", "Photosynthesis is the process by which",
    "Once upon a time, in a small village,", "The three laws of thermodynamics are", "To make a cup of tea,",
    "Kubernetes schedules pods onto nodes", "The capital of Japan is", "In 1969, the first humans",
    "A healthy breakfast includes", "The difference between TCP and UDP is", "Shakespeare wrote",
    "Machine learning models are trained by", "The tallest mountain in the world", "import numpy as np\n",
    "Dear customer, thank you for",
]
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fixed_text() -> str:
    """A stretch of English prose that ships with every Python: argparse's documentation."""
    return argparse.__doc__ + (argparse.ArgumentParser.__doc__ or "")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m pagoda.bench.quantization", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--schemes", nargs="+", default=["none", "int8", "int4"])
    p.add_argument("--max-tokens", type=int, default=48, help="greedy tokens per prompt for agreement")
    p.add_argument("--decode-tokens", type=int, default=64, help="tokens per sequence for TPOT/throughput")
    p.add_argument("--batch", type=int, default=32, help="sequences for the throughput figure (0: skip it)")
    p.add_argument("--timing-only", action="store_true", help="skip agreement, perplexity and chat")
    p.add_argument("--json", dest="json_out", default=None)
    return p.parse_args(argv)


def perplexity(model_path: str, scheme: str, group_size: int | None, dtype: str) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in LINEAR_NAMES and scheme in ("int8", "int4", "fp8"):
                w = module.weight.data
                if scheme == "fp8":
                    q, s = fp8.quantize_rows(w, w.float().abs().amax(dim=1))
                    module.weight.data = fp8.dequantize(q, s).to(w.dtype)
                elif scheme == "int8":
                    q, s = int8.quantize_rows(w, w.float().abs().amax(dim=1))
                    module.weight.data = (q.float() * s.float()[:, None]).to(w.dtype)
                else:
                    codes, s, z = int4.quantize_groups(w, group_size, w.dtype)
                    deq = ((codes.float() - 8) * s.float().repeat_interleave(group_size, 1)
                           + z.float().repeat_interleave(group_size, 1))
                    module.weight.data = deq.to(w.dtype)
        ids = tok(fixed_text(), return_tensors="pt").input_ids[:, :1024]
        loss = model(ids, labels=ids).loss
    return float(torch.exp(loss))


def timed(llm: LLM, prompts, max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def engine_perplexity(llm: LLM) -> float:
    """exp of the mean negative log-prob the engine gives each next token of the fixed text (1024 tokens)."""
    ids = llm.get_tokenizer()(fixed_text()).input_ids[:1024]
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    logprobs = [out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
    return float(torch.tensor(logprobs).neg().mean().exp())


def split_scheme(scheme: str) -> tuple[str, str]:
    """(weights: none | float32 | int8 | int4[-gN] | fp8, kv_cache_dtype)."""
    parts = scheme.split("+")
    kv = "fp8" if "fp8kv" in parts else "auto"
    weights = [p for p in parts if p != "fp8kv"]
    return (weights[0] if weights else "none"), kv


def run_scheme(args, scheme: str) -> tuple[dict, list[list[int]]]:
    weights, kv_cache_dtype = split_scheme(scheme)
    quantization = weights.split("-")[0] if weights.startswith(("int", "fp8")) else None
    group_size = int(weights.split("-g")[1]) if "-g" in weights else None
    llm = LLM(args.model, quantization=quantization, quantization_group_size=group_size,
              dtype="float32" if weights == "float32" else "auto", kv_cache_dtype=kv_cache_dtype)
    try:
        model = llm.engine.executor.runner.model
        linear = [m for m in model.modules() if isinstance(m, LinearBase)]
        config = llm.engine.config.model
        result = {"scheme": scheme, "dtype": config.dtype, "kv_cache_dtype": kv_cache_dtype,
                  "kv_cache_blocks": llm.engine.num_blocks,
                  "group_size": config.quantization.group_size if config.quantization else None,
                  "model_weights_mib": weight_bytes(model) / 2**20,
                  "linear_weights_mib": sum(map(weight_bytes, linear)) / 2**20}
        greedy = []
        if not args.timing_only:
            params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
            greedy = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
            question = [{"role": "user", "content": "What is the capital of France?"}]
            result["chat"] = llm.chat(question, SamplingParams(temperature=0, max_tokens=24),
                                      use_tqdm=False)[0].outputs[0].text
            result["engine_perplexity"] = engine_perplexity(llm)
        n = args.decode_tokens
        timed(llm, PROMPTS[:1], 4)  # warm-up
        # best of three: on a shared machine the minimum is the least disturbed figure
        tpot = min(timed(llm, PROMPTS[:1], n + 1) - timed(llm, PROMPTS[:1], 1) for _ in range(3)) / n
        result["tpot_ms_batch1"] = tpot * 1000
        if args.batch:
            batch = [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(args.batch)]
            result[f"output_tok_s_batch{args.batch}"] = args.batch * n / timed(llm, batch, n)
        return result, greedy
    finally:
        llm.engine.shutdown()


def agreement(reference: list[list[int]], got: list[list[int]]) -> tuple[float, float]:
    """(share of positions with the same token, share of tokens before each prompt's first difference)."""
    same = total = prefix = 0
    for ref, out in zip(reference, got):
        total += len(ref)
        same += sum(a == b for a, b in zip(ref, out))
        k = next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), len(ref))
        prefix += k
    return same / total, prefix / total


def main(argv=None) -> int:
    args = parse_args(argv)
    from pagoda.config.model_files import resolve_model_path

    path = resolve_model_path(args.model)
    results, tokens = [], {}
    for scheme in args.schemes:
        result, tokens[scheme] = run_scheme(args, scheme)
        if not args.timing_only:
            result["perplexity"] = perplexity(path, split_scheme(scheme)[0].split("-")[0], result["group_size"],
                                              result["dtype"])
            first = tokens[args.schemes[0]]
            result["token_agreement"], result["prefix_agreement"] = agreement(first, tokens[scheme])
        results.append(result)
        print(json.dumps(result), flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
