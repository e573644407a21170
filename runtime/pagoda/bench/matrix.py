"""`pagoda bench serve --matrix`: a named matrix of serving loads, each run against Pagoda and (with
`--vllm-python`) against vLLM's CPU build, reported as one table.

A scheduler tuned on one load can lose on the next (issue 54: time to first token worse on every load but the one
it was fitted on), so the matrix spans the shapes users send: prompts of 32 to 1,500 tokens, answers of 16 to 512,
concurrency 1 to 64, one load of Poisson arrivals and one of random length ratios; OTHER_LOADS, run by name, are
shapes beyond it that the rules were not designed on. The engines run in alternating
pairs, Pagoda then vLLM on one load, vLLM then Pagoda on the next: a shared machine's pace drifts over minutes
(docs/benchmarks.md), and alternating gives each engine the same share of its slow and fast phases. A load of a
few seconds runs in rounds of such pairs, each engine's rounds pooled (bench.figures.pooled).
"""

import argparse
import asyncio
from dataclasses import dataclass

from pagoda.bench.figures import pooled


@dataclass(frozen=True)
class Load:
    name: str
    input_len: int  # prompt tokens (center)
    output_len: int  # answer tokens (center)
    concurrency: int | None  # requests in flight at most (None: as many as arrive)
    num_prompts: int
    range_ratio: float = 0.0  # lengths uniform within +- this fraction of the centers
    request_rate: float = float("inf")  # Poisson arrivals per second (inf: all at once)
    what: str = ""  # the user it stands for
    rounds: int = 1  # alternating pairs of it to run, each engine's runs pooled: a run of a few seconds samples
    # the machine's phase more than the engines (tiny-c32's single pairs: 1.01-1.36x within an hour, benchmarks.md)


MATRIX: tuple[Load, ...] = (
    Load("single", 256, 128, 1, 16, what="one user: the time a token takes (TPOT at one sequence)"),
    Load("long-prompt-c4", 1500, 64, 4, 16, what="documents in, short answers, a few users"),
    Load("mid-c8", 768, 128, 8, 32, what="retrieval-augmented chat"),
    Load("long-short-c16", 1500, 16, 16, 48, what="classification or extraction over long inputs"),
    Load("chat-c32", 256, 128, 32, 96, what="the headline load (README)"),
    Load("short-long-c64", 32, 512, 64, 128, what="short questions, long answers, many users"),
    Load("random-ratio-c16", 512, 256, 16, 64, range_ratio=0.9,
         what="mixed lengths: prompts 51-972, answers 25-486 tokens"),
    Load("poisson-2rps", 256, 128, 64, 96, request_rate=2.0,
         what="open loop: requests arrive at 2/s (Poisson), at most 64 in flight"),
    Load("tiny-c32", 32, 16, 32, 128, what="short calls: scheduling and HTTP overhead dominate", rounds=4),
)

# Loads the scheduler was not designed on, named by `--matrix-loads` (not run by default): a rule that holds on the
# matrix must hold here too (issue 54: "and on others not named here"). Concurrency past the matrix's 64, long
# prompts beside long answers, Poisson rates the machine cannot keep up with (4/s on two Zen cores, 8/s on a Xeon),
# and a closed loop whose users all send again at once, as `vllm bench serve`'s random dataset does by default.
OTHER_LOADS: tuple[Load, ...] = (
    Load("rag-c24", 1024, 256, 24, 48, what="retrieval-augmented answers of some length, more users"),
    Load("c128", 128, 128, 128, 256, what="many users at once: a decode step of 128 sequences"),
    Load("poisson-4rps", 256, 128, 64, 128, request_rate=4.0,
         what="open loop past what the machine serves: requests arrive at 4/s, at most 64 in flight"),
    Load("long-answer-c4", 128, 1024, 4, 12, what="a few users, long generations"),
    Load("mid-c48", 384, 192, 48, 96, what="mid prompts and answers, many users"),
    Load("ratio-c8", 768, 384, 8, 24, range_ratio=0.5, what="long mixed lengths: prompts 384-1,152, answers 192-576"),
    Load("long-c32", 1024, 64, 32, 64, what="documents in, short answers, many users: a wave of long prompts"),
    Load("poisson-8rps", 128, 128, 128, 160, request_rate=8.0,
         what="open loop past what a faster machine serves: requests arrive at 8/s, at most 128 in flight"),
    Load("waves-c16", 256, 256, 16, 48,
         what="fixed lengths, so its users' answers end together and their next prompts arrive at once"),
    Load("waves-c32", 128, 128, 32, 96, what="the same, at twice the users and half the lengths"),
)
NAMED_LOADS = (*MATRIX, *OTHER_LOADS)  # every load --matrix-loads can name, in the order they run


def loads(names: str | None) -> list[Load]:
    """The matrix, or the loads named (comma-separated; the matrix's or OTHER_LOADS'), in the order they are
    declared."""
    if not names:
        return list(MATRIX)
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    known = {load.name for load in NAMED_LOADS}
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise ValueError(f"--matrix-loads: unknown load(s) {', '.join(unknown)}; the matrix has "
                         f"{', '.join(load.name for load in MATRIX)}, and beside it "
                         f"{', '.join(load.name for load in OTHER_LOADS)}")
    return [load for load in NAMED_LOADS if load.name in wanted]


def engine_order(index: int, with_vllm: bool) -> tuple[str, ...]:
    """Who runs first on the index-th load: Pagoda, vLLM, then vLLM, Pagoda, and so on (alternating pairs)."""
    if not with_vllm:
        return ("pagoda",)
    return ("pagoda", "vllm") if index % 2 == 0 else ("vllm", "pagoda")


def load_args(args: argparse.Namespace, load: Load, round_: int = 0) -> argparse.Namespace:
    """`pagoda bench serve`'s arguments for one round of one load. Its seed is the run's plus the load's place in
    NAMED_LOADS, plus the matrix's length per round: loads of one shape (single, chat-c32, poisson-2rps), or a load's
    rounds, would otherwise send the same prompts, and the second would find the first's in Pagoda's prefix cache."""
    return argparse.Namespace(**{**vars(args), "input_len": load.input_len, "output_len": load.output_len,
                                 "range_ratio": load.range_ratio, "max_concurrency": load.concurrency,
                                 "request_rate": load.request_rate, "num_prompts": load.num_prompts,
                                 "seed": args.seed + NAMED_LOADS.index(load) + round_ * len(MATRIX)})


# --- the table ---------------------------------------------------------------------------------------

def _ms(value: float) -> str:
    return f"{value / 1000:.2f} s" if value >= 1000 else f"{value:.0f} ms"


def _pair(pagoda: dict, vllm: dict | None, key: str, stat: str) -> str:
    mine = _ms(pagoda[key][stat])
    return mine if vllm is None else f"{mine} / {_ms(vllm[key][stat])}"


def row(load: Load, pagoda: dict, vllm: dict | None) -> list[str]:
    """One load's cells: its shape, output tok/s (and the ratio to vLLM's), TTFT median and p90, ITL median and
    p99, each as Pagoda's / vLLM's."""
    shape = f"{load.input_len}/{load.output_len}" + (f" ±{load.range_ratio:.0%}" if load.range_ratio else "")
    arrivals = f"c={load.concurrency}" if load.request_rate == float("inf") else \
        f"{load.request_rate:g}/s" + (f", c≤{load.concurrency}" if load.concurrency else "")
    tok_s = f"{pagoda['output_token_throughput']:.0f}"
    if vllm is not None:
        theirs = vllm["output_token_throughput"]
        tok_s += f" / {theirs:.0f} (**{pagoda['output_token_throughput'] / theirs:.2f}x**)" if theirs else " / 0"
    failed = pagoda["failed"] + (vllm["failed"] if vllm is not None else 0)
    return [load.name + (f" ({failed} failed)" if failed else ""), shape, arrivals, tok_s,
            _pair(pagoda, vllm, "ttft_ms", "median"), _pair(pagoda, vllm, "ttft_ms", "p90"),
            _pair(pagoda, vllm, "itl_ms", "median"), _pair(pagoda, vllm, "itl_ms", "p99")]


HEADER = ("load", "prompt/answer tokens", "arrivals", "output tok/s", "TTFT median", "TTFT p90", "ITL median",
          "ITL p99")


def table(results: list[tuple[Load, dict, dict | None]]) -> str:
    """The matrix as one Markdown table; with vLLM's figures, each cell is Pagoda's / vLLM's."""
    with_vllm = any(v is not None for _, _, v in results)
    header = list(HEADER)
    if with_vllm:
        header[3] = "output tok/s (ratio)"
        header[4:] = [f"{h}, Pagoda / vLLM" for h in header[4:]]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(row(load, p, v)) + " |" for load, p, v in results]
    return "\n".join(lines)


def empty_table() -> str:
    """The table's rows with no figures: for docs/benchmarks.md until it is measured on a quiet machine."""
    header = list(HEADER)
    header[3] = "output tok/s, Pagoda / vLLM (ratio)"
    header[4:] = [f"{h}, Pagoda / vLLM" for h in header[4:]]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for load in MATRIX:
        shape = f"{load.input_len}/{load.output_len}" + (f" ±{load.range_ratio:.0%}" if load.range_ratio else "")
        arrivals = f"c={load.concurrency}" if load.request_rate == float("inf") else \
            f"{load.request_rate:g}/s, c≤{load.concurrency}"
        lines.append("| " + " | ".join([load.name, shape, arrivals] + ["–"] * (len(header) - 3)) + " |")
    return "\n".join(lines)


def progress(figures: dict) -> str:
    """One engine's figures on one load as the matrix prints them as it goes: a long run cut short keeps them."""
    ttft, itl, e2e = figures["ttft_ms"], figures["itl_ms"], figures["e2e_ms"]
    return (f"{figures['output_token_throughput']:.0f} tok/s, TTFT median/p90 {ttft['median']:.0f}/{ttft['p90']:.0f} "
            f"ms, ITL median/p99 {itl['median']:.0f}/{itl['p99']:.0f} ms, E2E median {e2e['median']:.0f} ms")


# --- the run -----------------------------------------------------------------------------------------

async def run_matrix(args: argparse.Namespace, pagoda_sender, tokenizer, model: str, model_dir: str | None,
                     *, measure, synthetic_requests, http_sender) -> list[tuple[Load, dict, dict | None]]:
    """Every load on Pagoda (`pagoda_sender`) and, with args.vllm_python, on one `vllm serve` kept up for the
    whole matrix, in alternating pairs, measured by Pagoda's client or (args.client "vllm") by `vllm bench serve`
    (bench.vllm_client). The callables are serve.py's (passed in: serve.py imports this module)."""
    from contextlib import nullcontext
    from pathlib import Path

    peer = nullcontext(None)
    if args.vllm_python:
        from pagoda.bench.vllm_peer import check_vllm_python, vllm_server

        if not model_dir or not Path(model_dir).is_dir():
            raise SystemExit(f"--vllm-python needs the model directory: the server reports {model_dir!r}; "
                             "give --vllm-model DIR")
        peer = vllm_server(check_vllm_python(args.vllm_python), model_dir, model, dtype=args.vllm_dtype,
                           kv_cache_dtype=args.vllm_kv_cache_dtype, kv_cache_gib=args.vllm_kv_cache_gib)
    results = []
    with peer as vllm_url:
        client = vllm_sender = None
        if args.client == "vllm":  # vLLM's own `vllm bench serve` measures both servers
            from pagoda.bench.vllm_client import VllmBenchClient

            client = VllmBenchClient(check_vllm_python(args.vllm_python), model_dir, model, args.api_key)
            urls = {"pagoda": args.base_url, "vllm": vllm_url}
        elif vllm_url is not None:
            vllm_sender = http_sender(vllm_url, model)
        pairs = 0  # pairs run so far: each starts with the engine the one before ended with
        for load in loads(args.matrix_loads):
            runs: dict[str, list[dict]] = {}
            for round_ in range(load.rounds):
                per_load = load_args(args, load, round_)
                if client is None:
                    requests = synthetic_requests(load.num_prompts + args.warmup, load.input_len, load.output_len,
                                                  load.range_ratio, per_load.seed, tokenizer)
                    warmup, measured = requests[: args.warmup], requests[args.warmup:]
                for engine in engine_order(pairs, vllm_url is not None):
                    if client is not None:
                        figures = await client.measure(urls[engine], load, per_load.seed, args.warmup)
                    else:
                        sender = pagoda_sender if engine == "pagoda" else vllm_sender
                        figures = await measure(sender, warmup, measured, per_load)
                    runs.setdefault(engine, []).append(figures)
                    what = f" round {round_ + 1}/{load.rounds}" if load.rounds > 1 else ""
                    print(f"[matrix] {load.name}{what}: {engine} {progress(figures)}", flush=True)
                pairs += 1
            pooled_runs = {engine: pooled(engine_runs) for engine, engine_runs in runs.items()}
            if load.rounds > 1:
                for engine, figures in pooled_runs.items():
                    print(f"[matrix] {load.name}, {load.rounds} rounds pooled: {engine} {progress(figures)}",
                          flush=True)
            results.append((load, pooled_runs["pagoda"], pooled_runs.get("vllm")))
            await asyncio.sleep(0)
    return results

