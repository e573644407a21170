"""vLLM's own benchmark client, `vllm bench serve`, as a measurer for `pagoda bench serve --matrix --client vllm`.

Pagoda's client (bench.serve) and vLLM's count the same things, but a figure quoted against vLLM is more
convincing from vLLM's own tool: this runs it from the vLLM installation `--vllm-python` names, on each load's
shape (its random dataset draws its own prompts of those lengths, so they are not the ones Pagoda's client would
send), against either server, and reads back the result file it saves, in the figures' form bench.figures'
summarize() gives, so that the matrix's table and JSON are the same whichever client measured.
"""

import asyncio
import json
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pagoda.bench.figures import RequestResult

PERCENTILES = (50, 90, 99)  # the matrix's table reads medians, p90 and p99


@dataclass(frozen=True)
class VllmBenchClient:
    python: str  # the vLLM installation's interpreter
    tokenizer: str  # the model directory: the client counts prompt tokens with it
    model: str  # the served model name both servers answer to
    api_key: str | None = None  # Pagoda's --api-key, sent as vLLM's client sends one: from OPENAI_API_KEY

    # `load` below is a bench.matrix.Load (not imported: bench.matrix imports this module)
    def command(self, base_url: str, load, seed: int, warmup: int, result_dir: str, result_name: str) -> list[str]:
        cmd = [self.python, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "openai",
               "--base-url", base_url.rstrip("/"), "--endpoint", "/v1/completions", "--model", self.model,
               "--tokenizer", self.tokenizer, "--dataset-name", "random",
               "--random-input-len", str(load.input_len), "--random-output-len", str(load.output_len),
               "--random-range-ratio", str(load.range_ratio), "--ignore-eos",
               "--num-prompts", str(load.num_prompts), "--num-warmups", str(warmup), "--seed", str(seed),
               "--percentile-metrics", "ttft,tpot,itl,e2el",
               "--metric-percentiles", ",".join(str(p) for p in PERCENTILES),
               "--save-result", "--save-detailed",  # detailed: the failed requests' error texts too
               "--result-dir", result_dir, "--result-filename", result_name]
        if load.concurrency is not None:
            cmd += ["--max-concurrency", str(load.concurrency)]
        if load.request_rate != float("inf"):
            cmd += ["--request-rate", str(load.request_rate)]
        return cmd

    async def measure(self, base_url: str, load, seed: int, warmup: int) -> dict:
        """One load against the server at base_url: the figures of its saved result."""
        from pagoda.bench.vllm_peer import peer_env

        with tempfile.TemporaryDirectory(prefix="vllm-bench-") as result_dir:
            cmd = self.command(base_url, load, seed, warmup, result_dir, "result.json")
            env = peer_env(self.python)
            if self.api_key:  # vLLM's server, started without a key, takes any
                env["OPENAI_API_KEY"] = self.api_key
            proc = await asyncio.to_thread(subprocess.run, cmd, env=env, capture_output=True, text=True,
                                           timeout=3600)
            result = Path(result_dir) / "result.json"
            if proc.returncode != 0 or not result.is_file():
                raise RuntimeError(f"vllm bench serve on {load.name} against {base_url} failed (exit "
                                   f"{proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
            saved = json.loads(result.read_text())
            figures = summary_of(saved)
            figures["results"] = results_of(saved)  # the matrix pools a load's rounds from them
        figures.update(client="vllm bench serve", max_concurrency=load.concurrency,
                       request_rate=str(load.request_rate), input_len=load.input_len, output_len=load.output_len)
        return figures


def results_of(result: dict) -> list[RequestResult]:
    """Every request's result from vllm bench serve's saved result (its per-request lists, saved with
    --save-detailed; seconds, as bench.figures keeps them). A failed request has its error, or at least no
    output (vLLM counts it 0 tokens)."""
    return [RequestResult(ok=not error and output > 0, error=error or ("" if output > 0 else "no output"),
                          ttft=ttft, latency=latency, itl=list(itl), prompt_tokens=prompt, output_tokens=output)
            for error, ttft, latency, itl, prompt, output in zip(
                result["errors"], result["ttfts"], result["latencies"], result["itls"], result["input_lens"],
                result["output_lens"], strict=True)]


def summary_of(result: dict) -> dict:
    """vllm bench serve's saved result as bench.figures.summarize()'s figures (milliseconds, mean / median / p90 /
    p99 per latency)."""
    def stats(metric: str) -> dict:
        return {"mean": result[f"mean_{metric}_ms"], "median": result[f"median_{metric}_ms"],
                "p90": result[f"p90_{metric}_ms"], "p99": result[f"p99_{metric}_ms"]}

    # per request, one text ("" when it succeeded): saved with --save-detailed, which command() passes
    errors = sorted({e for e in result.get("errors") or () if e})[:5]
    return {
        "duration_s": result["duration"],
        "completed": result["completed"],
        "failed": result.get("failed", result["num_prompts"] - result["completed"]),
        "errors": errors,
        "total_input_tokens": result["total_input_tokens"],
        "total_output_tokens": result["total_output_tokens"],
        "request_throughput": result["request_throughput"],
        "output_token_throughput": result["output_throughput"],
        "total_token_throughput": result["total_token_throughput"],
        "ttft_ms": stats("ttft"),
        "tpot_ms": stats("tpot"),
        "itl_ms": stats("itl"),
        "e2e_ms": stats("e2el"),
    }
