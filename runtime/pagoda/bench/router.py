"""`pagoda bench router`: a multi-turn chat workload through `pagoda router`, once per policy.

Many conversations share a few system prompts, each opens with its own document (a long first user
message) and goes on for several turns, each turn sending the whole conversation so far. The replicas' prefix caches can serve a turn's shared part only if it lands
where that part was computed before: round-robin spreads a conversation's turns over every replica,
`prefix` keeps them together. For each policy the benchmark reports
  - the prefix-cache hit rate: prompt tokens the replicas served from cache (usage.prompt_tokens_details.
    cached_tokens) over all prompt tokens;
  - TTFT median and p99, output tokens/s;
  - the router's own overhead per request (its pagoda_router:proxy_overhead_seconds histogram).

It starts `--replicas` `pagoda serve MODEL` processes (or uses `--backend` URLs) and a fresh `pagoda router`
per policy; each policy gets its own conversations (a different seed), so no policy finds the caches
warmed by another.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pagoda.bench.serve import _WORDS

POLICIES = ("round-robin", "least-load", "prefix")


@dataclass
class TurnResult:
    ttft: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    backend: str


@dataclass
class PolicyResult:
    policy: str
    turns: list[TurnResult] = field(default_factory=list)
    errors: int = 0
    duration: float = 0.0
    overhead: dict = field(default_factory=dict)
    hop: dict = field(default_factory=dict)
    reasons: dict = field(default_factory=dict)

    def summary(self) -> dict:
        ttfts = sorted(t.ttft for t in self.turns)
        prompt = sum(t.prompt_tokens for t in self.turns)
        return {
            "policy": self.policy, "requests": len(self.turns), "errors": self.errors,
            "prefix_hit_rate": sum(t.cached_tokens for t in self.turns) / prompt if prompt else 0.0,
            "ttft_ms_median": 1000 * statistics.median(ttfts) if ttfts else None,
            "ttft_ms_p99": 1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else None,
            "output_tok_s": sum(t.output_tokens for t in self.turns) / self.duration if self.duration else 0.0,
            "requests_per_backend": {b: sum(t.backend == b for t in self.turns)
                                     for b in sorted({t.backend for t in self.turns})},
            "router_overhead_ms": self.overhead,
            "added_latency_ms": self.hop,
            "routing_reasons": self.reasons,
        }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def conversations(seed: int, n: int, systems: int, system_words: int) -> list[list[dict]]:
    rng = random.Random(seed)
    prompts = [f"You are assistant {seed}-{i}. " + words(rng, system_words) for i in range(systems)]
    return [[{"role": "system", "content": prompts[c % systems]}] for c in range(n)]


async def chat_turn(client: httpx.AsyncClient, model: str, messages: list[dict], max_tokens: int) -> TurnResult:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, text, usage = None, [], {}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:200]!r}")
        backend = r.headers.get("x-pagoda-backend", "?")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"].get("message"))
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    text.append(piece)
            usage = event.get("usage") or usage
    messages.append({"role": "assistant", "content": "".join(text)})
    return TurnResult(ttft or time.perf_counter() - start, usage.get("prompt_tokens", 0),
                      (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                      usage.get("completion_tokens", 0), backend)


def overhead_ms(metrics_text: str) -> dict:
    """Median (interpolated in its bucket) and mean of the router's proxy_overhead_seconds histogram."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets, total, count = [], 0.0, 0.0
    for family in text_string_to_metric_families(metrics_text):
        if family.name != "pagoda_router:proxy_overhead_seconds":
            continue
        for s in family.samples:
            if s.name.endswith("_bucket"):
                buckets.append((float(s.labels["le"]), s.value))
            elif s.name.endswith("_sum"):
                total = s.value
            elif s.name.endswith("_count"):
                count = s.value
    if not count:
        return {}
    buckets.sort()
    half, lower, below = count / 2, 0.0, 0.0
    median = buckets[-1][0]
    for le, cumulative in buckets:
        if cumulative >= half:
            span = cumulative - below
            median = lower + (le - lower) * ((half - below) / span if span else 0) if le != float("inf") else lower
            break
        lower, below = le, cumulative
    return {"median": 1000 * median, "mean": 1000 * total / count, "count": int(count)}


def routing_reasons(metrics_text: str) -> dict:
    """The router's routing_decisions_total by reason (requests only; health probes are not routed)."""
    from prometheus_client.parser import text_string_to_metric_families

    reasons = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name == "pagoda_router:routing_decisions":
            for s in family.samples:
                if s.name.endswith("_total") and s.value:
                    reasons[s.labels["reason"]] = int(s.value)
    return reasons


async def run_policy(router_url: str, model: str, policy: str, args, seed: int) -> PolicyResult:
    convs = conversations(seed, args.conversations, args.system_prompts, args.system_words)
    rng = random.Random(seed + 1)
    result = PolicyResult(policy)
    gate = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    async with httpx.AsyncClient(base_url=router_url, timeout=600, limits=limits, headers=headers) as client:
        async def converse(messages: list[dict]) -> None:
            for turn in range(args.turns):
                # a user reads and types between turns: without the pause, conversations advance in lockstep
                # and round-robin sends each one back to the same replica by accident whenever the
                # concurrency is a multiple of the replica count
                await asyncio.sleep(rng.expovariate(1 / args.think_time) if args.think_time > 0 else 0)
                document = f"Read this: {words(rng, args.document_words)}\n" if turn == 0 else ""
                messages.append({"role": "user", "content": document + f"Turn {turn}: " + words(rng, args.user_words)})
                async with gate:
                    try:
                        result.turns.append(await chat_turn(client, model, messages, args.output_len))
                    except (RuntimeError, httpx.HTTPError) as e:
                        result.errors += 1
                        print(f"  {policy}: a turn failed: {e}", file=sys.stderr)
                        return

        start = time.perf_counter()
        await asyncio.gather(*(converse(m) for m in convs))
        result.duration = time.perf_counter() - start
        metrics = (await client.get("/metrics")).text
        result.overhead, result.reasons = overhead_ms(metrics), routing_reasons(metrics)
    result.hop = await asyncio.to_thread(added_latency, router_url, args.backend_urls, headers, args.probes)
    return result


def added_latency(router_url: str, backends: list[str], headers: dict, probes: int) -> dict:
    """The extra hop end to end: GET /v1/models straight to a replica and through the router, alternating
    (keep-alive connections both ways); the difference of the medians is what the router adds."""
    if probes < 1:
        return {}
    direct, routed = [], []
    with httpx.Client(headers=headers, timeout=30) as client:
        for i in range(probes):
            for url, into in ((backends[i % len(backends)], direct), (router_url, routed)):
                start = time.perf_counter()
                client.get(url + "/v1/models").raise_for_status()
                into.append(time.perf_counter() - start)
    d, r = statistics.median(direct), statistics.median(routed)
    return {"direct_median": 1000 * d, "routed_median": 1000 * r, "added_median": 1000 * (r - d)}


def wait_healthy(url: str, process: subprocess.Popen, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{what} not healthy after {timeout}s")


def start(command: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="pagoda bench router", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint for the replicas this benchmark starts (default: the built-in)")
    p.add_argument("--backend", action="append", metavar="URL", help="use running replicas instead (repeatable)")
    p.add_argument("--replicas", type=int, default=2, help="replicas to start (default: %(default)s)")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="an extra `pagoda serve` argument for the replicas (repeatable, e.g. --serve-arg=--dtype=bfloat16)")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated (default: %(default)s)")
    p.add_argument("--conversations", type=int, default=12)
    p.add_argument("--system-prompts", type=int, default=3, help="distinct system prompts the conversations share")
    p.add_argument("--system-words", type=int, default=60)
    p.add_argument("--document-words", type=int, default=200, help="the first turn's document, one per conversation")
    p.add_argument("--user-words", type=int, default=25)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4, help="turns in flight at once")
    p.add_argument("--think-time", type=float, default=2.0,
                   help="mean seconds a user pauses before each turn (exponential; 0: none)")
    p.add_argument("--api-key")
    p.add_argument("--probes", type=int, default=200,
                   help="GET /v1/models pairs (direct, routed) measuring the added hop (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-json", help="write the summaries here")
    args = p.parse_args(argv)
    unknown = set(args.policies.split(",")) - {"round-robin", "least-load", "prefix", "session"}
    if unknown:
        p.error(f"--policies: unknown {sorted(unknown)}")
    if args.think_time < 0:
        p.error("--think-time must be >= 0")
    if args.replicas < 1 or args.conversations < 1 or args.turns < 1 or args.concurrency < 1:
        p.error("--replicas, --conversations, --turns and --concurrency must be >= 1")
    return args


def table(summaries: list[dict]) -> str:
    lines = [f"{'policy':<12} {'hit rate':>8} {'TTFT med':>9} {'TTFT p99':>9} {'out tok/s':>9} "
             f"{'overhead med/mean':>18} {'hop added':>9}  requests per backend"]
    for s in summaries:
        o = s["router_overhead_ms"]
        lines.append(f"{s['policy']:<12} {s['prefix_hit_rate']:>8.1%} {s['ttft_ms_median']:>7.0f}ms "
                     f"{s['ttft_ms_p99']:>7.0f}ms {s['output_tok_s']:>9.1f} "
                     f"{o.get('median', 0):>8.3f}/{o.get('mean', 0):.3f}ms "
                     f"{s['added_latency_ms'].get('added_median', 0):>7.3f}ms  "
                     f"{list(s['requests_per_backend'].values())}" + (f"  errors {s['errors']}" if s["errors"] else ""))
        if len(s["routing_reasons"]) > 1:
            lines.append(f"{'':<12} decisions: " + ", ".join(f"{k} {v}" for k, v in sorted(s["routing_reasons"].items())))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv if argv is not None else sys.argv[1:])
    logs = Path(tempfile.mkdtemp(prefix="pagoda-bench-router-"))
    replicas: list[subprocess.Popen] = []
    urls = list(args.backend or [])
    summaries = []
    try:
        if not urls:
            for _ in range(args.replicas):
                port = free_port()
                command = [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", *([args.model] if args.model
                           else []), "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
                           *args.serve_arg]
                replicas.append(start(command, logs / f"serve-{port}.log",
                                      {"PAGODA_API_KEY": args.api_key} if args.api_key else None))
                urls.append(f"http://127.0.0.1:{port}")
            for url, process in zip(urls, replicas):
                wait_healthy(url, process, 600, f"pagoda serve at {url}")
        args.backend_urls = urls
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        model = httpx.get(urls[0] + "/v1/models", headers=headers, timeout=10).json()["data"][0]["id"]
        print(f"{len(urls)} replicas of {model}; {args.conversations} conversations x {args.turns} turns, "
              f"{args.system_prompts} shared system prompts of {args.system_words} words, documents of "
              f"{args.document_words} words, "
              f"concurrency {args.concurrency}, think time {args.think_time} s; logs in {logs}", flush=True)
        for i, policy in enumerate(args.policies.split(",")):
            port = free_port()
            router = start([sys.executable, "-m", "pagoda.entrypoints.cli", "router", "--policy", policy,
                            "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
                            *[a for u in urls for a in ("--backend", u)]], logs / f"router-{policy}.log")
            try:
                wait_healthy(f"http://127.0.0.1:{port}", router, 60, "pagoda router")
                time.sleep(1.0)  # every backend probed at least once
                result = asyncio.run(run_policy(f"http://127.0.0.1:{port}", model, policy, args,
                                                seed=args.seed * 1000 + i))
            finally:
                stop(router)
            summaries.append(result.summary())
            print(table(summaries[-1:]).splitlines()[-1], flush=True)
    finally:
        for process in replicas:
            stop(process)
    print(table(summaries))
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(summaries, indent=2))
    return 0 if all(s["errors"] == 0 for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
