"""A serving benchmark's figures: every request's result, and the throughput and latency statistics of a run
(mean, median, p90, p99, as `vllm bench serve` reports them), whichever client measured it."""

import statistics
from dataclasses import dataclass, field


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0


def percentile(ordered: list[float], q: float) -> float:
    """The q-quantile of sorted values, between the two nearest ranks (numpy's default, as vllm bench serve's)."""
    position = q * (len(ordered) - 1)
    below = int(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    ms = 1000.0

    def stats(values: list[float]) -> dict:
        if not values:
            return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}
        ordered = sorted(values)
        return {"mean": statistics.fmean(values) * ms, "median": statistics.median(values) * ms,
                "p90": percentile(ordered, 0.90) * ms, "p99": percentile(ordered, 0.99) * ms}

    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    return {
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "ttft_ms": stats([r.ttft for r in ok]),
        "tpot_ms": stats(tpot),
        "itl_ms": stats([gap for r in ok for gap in r.itl]),
        "e2e_ms": stats([r.latency for r in ok]),
    }


def pooled(runs: list[dict]) -> dict:
    """One engine's figures over its runs of one load (the matrix's rounds), less the per-request "results" they
    carry. One run: its figures as measured (vLLM's own, from its client). Several: the statistics over every
    request of every run, the throughput over the runs' summed time; the rest (the load's shape, the client) from
    the first run, the server's preemptions summed."""
    if len(runs) == 1:
        figures = dict(runs[0])
        figures.pop("results", None)
        return figures
    figures = {**runs[0], **summarize([r for run in runs for r in run["results"]],
                                      sum(run["duration_s"] for run in runs))}
    if all("preemptions" in run for run in runs):
        figures["preemptions"] = sum(run["preemptions"] for run in runs)
    figures["num_prompts"] = figures["completed"] + figures["failed"]
    figures["rounds"] = len(runs)
    del figures["results"]
    return figures
