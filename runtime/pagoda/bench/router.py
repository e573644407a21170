"""`pagoda bench router`: a multi-turn chat workload through `pagoda router`, once per policy.

A chat service: users (`--active` at once) hold conversations one after another; a conversation opens
with one of a few shared system prompts (a few hundred tokens), goes on for a varying number of turns,
each turn resending the conversation so far plus a new user message, and waits for the answer and the
user's think time before the next. The shared system prompts are warmed on every replica first (as on a
long-running service). A turn's history can come from a replica's prefix cache only if the turn lands
where the history was computed: round-robin spreads a conversation's turns over every replica, `prefix`
keeps them together. For each policy the benchmark reports
  - the prefix-cache hit rate: prompt tokens the replicas served from cache (usage.prompt_tokens_details.
    cached_tokens) over all prompt tokens, between its floor (the shared system prompts, cached on every
    replica) and its ceiling (every turn's history and system prompt hit);
  - the prompt tokens the replicas computed (prompt - cached): the prefill work the policy left;
  - TTFT median, p90 and p99, output tokens/s;
  - each replica's prefix-cache evictions during the run (its pagoda:prefix_cache_evicted_blocks_total,
    before and after): how evenly the policy spread the cache's load;
  - the router's own overhead per request (its pagoda_router:proxy_overhead_seconds histogram).

Cache pressure: `--kv-cache-memory GIB` sizes each started replica's KV cache, and the benchmark prints
each replica's KV blocks beside the live working set (the shared system prompts plus every live
conversation's history, in blocks) and the replicas' preemptions. Round-robin needs the whole working set
on every replica; a router that partitions conversations needs about 1/replicas of the histories there.

It starts `--replicas` `pagoda serve MODEL` processes (or uses `--backend` URLs) and a fresh `pagoda router`
per policy. The replicas it starts publish KV events (`--kv-events-config`, on ipc sockets in the log folder)
for the `precise` policy; `--backend` replicas must publish them at `--kv-events-endpoint`. Every policy gets the same conversations (lengths, user messages) behind system prompts that
open differently, so no policy finds blocks another left in the replicas' caches.
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

POLICIES = ("round-robin", "least-load", "prefix", "precise")


@dataclass
class TurnResult:
    ttft: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    backend: str
    conversation: int = 0
    turn: int = 0
    end: float = 0.0  # perf_counter when the answer ended: the conversation's history has grown by then


BLOCK_TOKENS = 16  # the engine's default block size: only full blocks are cached


@dataclass
class PolicyResult:
    policy: str
    turns: list[TurnResult] = field(default_factory=list)
    errors: int = 0
    duration: float = 0.0
    overhead: dict = field(default_factory=dict)
    hop: dict = field(default_factory=dict)
    reasons: dict = field(default_factory=dict)
    system_tokens: dict[int, int] = field(default_factory=dict)  # conversation -> its system prompt's tokens
    system_prompt_tokens: list[int] = field(default_factory=list)  # each shared system prompt's tokens
    replicas: dict = field(default_factory=dict)  # the replicas' KV blocks and preemptions during the run
    backends: list[str] = field(default_factory=list)  # the replicas' URLs: the order of every per-replica list

    def ceiling(self) -> int:
        """The prompt tokens a perfect router could serve from cache: a turn's history (the previous turn's
        prompt and answer) and, on a first turn, the shared system prompt, in full blocks."""
        by_conv: dict[int, list[TurnResult]] = {}
        for t in self.turns:
            by_conv.setdefault(t.conversation, []).append(t)
        total = 0
        for conv, turns in by_conv.items():
            turns.sort(key=lambda t: t.turn)
            previous = self.system_tokens.get(conv, 0)
            for t in turns:
                total += min(previous, t.prompt_tokens - 1) // BLOCK_TOKENS * BLOCK_TOKENS
                previous = t.prompt_tokens + t.output_tokens
        return total

    def floor(self) -> int:
        """The prompt tokens every policy serves from cache: the shared system prompts (warmed on every
        replica), in full blocks. Round-robin's hit rate tends to it as the replicas grow."""
        return sum(min(self.system_tokens.get(t.conversation, 0), t.prompt_tokens - 1) // BLOCK_TOKENS
                   * BLOCK_TOKENS for t in self.turns)

    def working_set_blocks(self) -> dict:
        """The blocks a replica must hold to serve every live conversation's next turn from cache: the shared
        system prompts plus each live conversation's history (its last prompt and answer), from its first
        turn's end to its last's. Mean over the run (time-weighted) and peak. Round-robin needs all of it on
        every replica; a router that partitions conversations, about 1/replicas of the histories."""
        systems = sum(-(-n // BLOCK_TOKENS) for n in self.system_prompt_tokens)
        events = []  # (time, conversation, its blocks from then on)
        by_conv: dict[int, list[TurnResult]] = {}
        for t in self.turns:
            by_conv.setdefault(t.conversation, []).append(t)
        for turns in by_conv.values():
            turns.sort(key=lambda t: t.turn)
            for t in turns[:-1]:
                events.append((t.end, t.conversation, -(-(t.prompt_tokens + t.output_tokens) // BLOCK_TOKENS)))
            events.append((turns[-1].end, turns[-1].conversation, 0))  # ended: nobody asks for it again
        events.sort(key=lambda e: (e[0], e[2] == 0))
        if not events:
            return {"mean": systems, "peak": systems}
        live: dict[int, int] = {}
        total = area = peak = 0
        last = events[0][0]
        for when, conv, blocks in events:
            area += total * (when - last)
            last = when
            total += blocks - live.get(conv, 0)
            live[conv] = blocks
            peak = max(peak, total)
        span = events[-1][0] - events[0][0]
        return {"mean": systems + (area / span if span else peak), "peak": systems + peak}

    def summary(self) -> dict:
        ttfts = sorted(t.ttft for t in self.turns)
        prompt = sum(t.prompt_tokens for t in self.turns)
        cached = sum(t.cached_tokens for t in self.turns)
        return {
            "policy": self.policy, "requests": len(self.turns), "errors": self.errors,
            "prefix_hit_rate": cached / prompt if prompt else 0.0,
            "hit_rate_ceiling": self.ceiling() / prompt if prompt else 0.0,
            "hit_rate_floor": self.floor() / prompt if prompt else 0.0,
            "prompt_tokens": prompt, "prompt_tokens_computed": prompt - cached,
            "ttft_ms_median": 1000 * statistics.median(ttfts) if ttfts else None,
            "ttft_ms_p90": 1000 * percentile(ttfts, 0.90) if ttfts else None,
            "ttft_ms_p99": 1000 * percentile(ttfts, 0.99) if ttfts else None,
            "output_tok_s": sum(t.output_tokens for t in self.turns) / self.duration if self.duration else 0.0,
            "requests_per_backend": {b: sum(t.backend == b for t in self.turns)
                                     for b in self.backends + sorted({t.backend for t in self.turns} - set(self.backends))},
            "router_overhead_ms": self.overhead,
            "added_latency_ms": self.hop,
            "routing_reasons": self.reasons,
            "working_set_blocks": self.working_set_blocks(),
            "replicas": self.replicas,
        }


def percentile(ordered: list[float], q: float) -> float:
    """The q-quantile of sorted values, nearest rank below (as the p99 always was here)."""
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def eviction_spread(evicted: list[int]) -> float | None:
    """The most evicting replica's evictions over the least evicting one's (1 = even; None: no replica
    evicted, inf: one evicted and another did not)."""
    if not evicted or max(evicted) == 0:
        return None
    return max(evicted) / min(evicted) if min(evicted) else float("inf")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def system_prompts(seed: int, systems: int, system_words: int, salt: int = 0) -> list[str]:
    """The shared system prompts: the words come from the seed, the opening from the salt, so every policy
    gets the same workload (the same lengths) behind prompts whose first block differs (no policy finds
    blocks another policy left in the replicas' caches)."""
    rng = random.Random(seed)
    return [f"You are assistant {salt}-{i}. " + words(rng, system_words) for i in range(systems)]


def around(rng: random.Random, mean: int, low: int = 1) -> int:
    """A length uniform over [mean/2, 3 mean/2] (mean `mean`): real turns and answers vary."""
    if mean <= 1:
        return max(low, mean)
    return max(low, rng.randint((mean + 1) // 2, mean + mean // 2))


def turns_of(rng: random.Random, mean: int) -> int:
    """A conversation's turns, uniform over [mean/2, 3 mean/2] (at least 1): conversations end at
    different turns, so the order of requests never settles into a cycle."""
    return around(rng, mean)


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
                      usage.get("completion_tokens", 0), backend, end=time.perf_counter())


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


def replica_counters(metrics_text: str) -> dict:
    """A replica's KV-cache blocks, preemption counts and prefix-cache evictions, from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {"pagoda:kv_cache_total_blocks": "kv_blocks", "pagoda:num_preemptions": "preemptions",
              "pagoda:num_recomputed": "recomputed", "pagoda:num_swapped_out": "swapped_out",
              "pagoda:prefix_cache_evicted_blocks": "evicted"}
    found = {}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name in wanted or s.name.removesuffix("_total") in wanted:
                found[wanted.get(s.name) or wanted[s.name.removesuffix("_total")]] = int(s.value)
    return found


async def scrape_replicas(backends: list[str], headers: dict) -> list[dict]:
    async with httpx.AsyncClient(timeout=30, headers=headers) as client:
        return [replica_counters((await client.get(url + "/metrics")).text) for url in backends]


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


async def warm_system_prompts(backends: list[str], model: str, prompts: list[str], headers: dict) -> list[int]:
    """Each shared system prompt once straight to every replica, so the run starts where a long-running
    service is: a system prompt that many conversations share is in every replica's cache whatever the
    policy (and the router's index knows nothing of it). Returns each prompt's tokens (as a chat alone)."""
    tokens = [0] * len(prompts)
    async with httpx.AsyncClient(timeout=600, headers=headers) as client:
        for url in backends:
            for i, prompt in enumerate(prompts):
                r = await client.post(url + "/v1/chat/completions", json={
                    "model": model, "messages": [{"role": "system", "content": prompt}], "max_tokens": 1})
                r.raise_for_status()
                tokens[i] = r.json()["usage"]["prompt_tokens"]
    return tokens


async def run_policy(router_url: str, model: str, policy: str, args, salt: int) -> PolicyResult:
    seed = args.seed
    prompts = system_prompts(seed, args.system_prompts, args.system_words, salt)
    result = PolicyResult(policy, backends=list(args.backend_urls))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    system_tokens = await warm_system_prompts(args.backend_urls, model, prompts, headers)
    result.system_prompt_tokens = system_tokens
    before = await scrape_replicas(args.backend_urls, headers)
    gate = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    queue = list(range(args.conversations))  # conversations not yet started; `active` run at once

    async with httpx.AsyncClient(base_url=router_url, timeout=600, limits=limits, headers=headers) as client:
        async def converse(c: int) -> None:
            rng = random.Random(seed * 100_003 + c)  # the content: the same for every policy and run of a seed
            think = random.Random()  # the timing varies from run to run anyway
            messages = [{"role": "system", "content": prompts[c % len(prompts)]}]
            result.system_tokens[c] = system_tokens[c % len(prompts)]
            for turn in range(turns_of(rng, args.turns)):
                # a user reads and types between turns: without the pause, conversations advance in lockstep
                # and round-robin sends each one back to the same replica by accident whenever the
                # number of conversations is a multiple of the replica count
                await asyncio.sleep(think.expovariate(1 / args.think_time) if args.think_time > 0 else 0)
                document = (f"Read this: {words(rng, args.document_words)}\n"
                            if turn == 0 and args.document_words else "")
                messages.append({"role": "user",
                                 "content": document + f"Turn {turn}: " + words(rng, around(rng, args.user_words))})
                output_len = around(rng, args.output_len)
                async with gate:
                    try:
                        t = await chat_turn(client, model, messages, output_len)
                    except (RuntimeError, httpx.HTTPError) as e:
                        result.errors += 1
                        print(f"  {policy}: a turn failed: {e}", file=sys.stderr)
                        return
                t.conversation, t.turn = c, turn
                result.turns.append(t)

        async def user() -> None:  # one user at a time per slot: a new conversation when one ends
            while queue:
                await converse(queue.pop(0))

        start = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(min(args.active, args.conversations))))
        result.duration = time.perf_counter() - start
        metrics = (await client.get("/metrics")).text
        result.overhead, result.reasons = overhead_ms(metrics), routing_reasons(metrics)
    after = await scrape_replicas(args.backend_urls, headers)
    result.replicas = {"kv_blocks": [a.get("kv_blocks") for a in after],
                       **{k: [a.get(k, 0) - b.get(k, 0) for a, b in zip(after, before)]
                          for k in ("preemptions", "recomputed", "swapped_out", "evicted")}}
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
    p.add_argument("--kv-cache-memory", type=float, metavar="GIB",
                   help="each started replica's KV cache (`pagoda serve --kv-cache-memory`); small caches put the "
                        "replicas under cache pressure: compare its KV blocks with the printed working set")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated (default: %(default)s)")
    p.add_argument("--kv-events-endpoint", metavar="TEMPLATE",
                   help="precise with --backend: the replicas' KV events endpoint, as `pagoda router "
                        "--kv-events-endpoint` (default: its default; the replicas started here publish on ipc)")
    p.add_argument("--conversations", type=int, default=24, help="conversations in all (default: %(default)s)")
    p.add_argument("--active", type=int, default=8,
                   help="conversations open at once (users online); a new one starts when one ends (default: %(default)s)")
    p.add_argument("--system-prompts", type=int, default=4,
                   help="distinct system prompts the conversations share (default: %(default)s)")
    p.add_argument("--system-words", type=int, default=250, help="words a system prompt has (default: %(default)s)")
    p.add_argument("--document-words", type=int, default=0,
                   help="a document opening each conversation's first turn, words (default: %(default)s, none)")
    p.add_argument("--user-words", type=int, default=40,
                   help="a user message's words, mean (uniform over half to 1.5x; default: %(default)s)")
    p.add_argument("--turns", type=int, default=4,
                   help="a conversation's turns, mean (uniform over half to 1.5x; default: %(default)s)")
    p.add_argument("--output-len", type=int, default=64,
                   help="an answer's tokens, mean (uniform over half to 1.5x; default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=4, help="turns in flight at once, at most (default: %(default)s)")
    p.add_argument("--think-time", type=float, default=2.0,
                   help="mean seconds a user pauses before each turn (exponential; 0: none)")
    p.add_argument("--api-key")
    p.add_argument("--probes", type=int, default=200,
                   help="GET /v1/models pairs (direct, routed) measuring the added hop (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-json", help="write the summaries here")
    args = p.parse_args(argv)
    unknown = set(args.policies.split(",")) - {"round-robin", "least-load", "prefix", "session", "precise"}
    if unknown:
        p.error(f"--policies: unknown {sorted(unknown)}")
    if args.kv_cache_memory is not None and not args.kv_cache_memory > 0:
        p.error(f"--kv-cache-memory must be > 0 GiB; got {args.kv_cache_memory}")
    if args.kv_cache_memory is not None and args.backend:
        p.error("--kv-cache-memory sizes the replicas this benchmark starts; it cannot resize --backend ones")
    if args.think_time < 0:
        p.error("--think-time must be >= 0")
    if min(args.replicas, args.conversations, args.active, args.turns, args.concurrency, args.output_len,
           args.system_prompts) < 1:
        p.error("--replicas, --conversations, --active, --turns, --concurrency, --output-len and --system-prompts "
                "must be >= 1")
    if min(args.system_words, args.document_words, args.user_words) < 0:
        p.error("--system-words, --document-words and --user-words must be >= 0")
    return args


def table(summaries: list[dict]) -> str:
    lines = [f"{'policy':<12} {'hit rate':>8} {'floor':>6} {'ceiling':>7} {'computed':>8} {'TTFT med':>9} {'TTFT p90':>9} "
             f"{'TTFT p99':>9} {'out tok/s':>9} {'overhead med/mean':>18} {'hop added':>9}  requests per backend"
             "  evicted per replica (max/min)"]
    for s in summaries:
        o = s["router_overhead_ms"]
        lines.append(f"{s['policy']:<12} {s['prefix_hit_rate']:>8.1%} {s['hit_rate_floor']:>6.1%} {s['hit_rate_ceiling']:>7.1%} "
                     f"{s['prompt_tokens_computed']:>8} {s['ttft_ms_median']:>7.0f}ms {s['ttft_ms_p90']:>7.0f}ms "
                     f"{s['ttft_ms_p99']:>7.0f}ms {s['output_tok_s']:>9.1f} "
                     f"{o.get('median', 0):>8.3f}/{o.get('mean', 0):.3f}ms "
                     f"{s['added_latency_ms'].get('added_median', 0):>7.3f}ms  "
                     f"{list(s['requests_per_backend'].values())}" + evictions(s.get("replicas") or {})
                     + (f"  errors {s['errors']}" if s["errors"] else ""))
        w, r = s.get("working_set_blocks") or {}, s.get("replicas") or {}
        if w and r.get("kv_blocks"):
            pressure = w["mean"] / min(r["kv_blocks"])
            lines.append(f"{'':<12} KV blocks per replica {r['kv_blocks']}; live working set {w['mean']:.0f} blocks "
                         f"mean, {w['peak']} peak ({pressure:.2f}x a replica's cache); preemptions "
                         f"{r.get('preemptions')} (recomputed {r.get('recomputed')}, swapped out {r.get('swapped_out')})")
        if len(s["routing_reasons"]) > 1:
            lines.append(f"{'':<12} decisions: " + ", ".join(f"{k} {v}" for k, v in sorted(s["routing_reasons"].items())))
    return "\n".join(lines)


def evictions(replicas: dict) -> str:
    evicted = replicas.get("evicted")
    if not evicted:
        return ""
    spread = eviction_spread(evicted)
    return f"  {evicted}" + (f" ({spread:.2f}x)" if spread is not None else "")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv if argv is not None else sys.argv[1:])
    logs = Path(tempfile.mkdtemp(prefix="pagoda-bench-router-"))
    replicas: list[subprocess.Popen] = []
    urls = list(args.backend or [])
    summaries = []
    events_flags = ["--kv-events-endpoint", args.kv_events_endpoint] if args.kv_events_endpoint else []
    try:
        if not urls:
            events_flags = ["--kv-events-endpoint", f"ipc://{logs}/kv-{{port}}",
                            "--kv-events-replay-endpoint", f"ipc://{logs}/replay-{{port}}"]
            for _ in range(args.replicas):
                port = free_port()
                events = {"enable_kv_cache_events": True, "endpoint": f"ipc://{logs}/kv-{port}",
                          "replay_endpoint": f"ipc://{logs}/replay-{port}"}
                command = [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", *([args.model] if args.model
                           else []), "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
                           *(["--kv-cache-memory", str(args.kv_cache_memory)] if args.kv_cache_memory else []),
                           "--kv-events-config", json.dumps(events), *args.serve_arg]
                replicas.append(start(command, logs / f"serve-{port}.log",
                                      {"PAGODA_API_KEY": args.api_key} if args.api_key else None))
                urls.append(f"http://127.0.0.1:{port}")
            for url, process in zip(urls, replicas):
                wait_healthy(url, process, 600, f"pagoda serve at {url}")
        args.backend_urls = urls
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        model = httpx.get(urls[0] + "/v1/models", headers=headers, timeout=10).json()["data"][0]["id"]
        print(f"{len(urls)} replicas of {model}; {args.conversations} conversations ({args.active} open at once) "
              f"of ~{args.turns} turns, {args.system_prompts} shared system prompts of {args.system_words} words, "
              f"user messages of ~{args.user_words} words, answers of ~{args.output_len} tokens, documents of "
              f"{args.document_words} words, concurrency {args.concurrency}, think time {args.think_time} s; "
              f"logs in {logs}", flush=True)
        for i, policy in enumerate(args.policies.split(",")):
            port = free_port()
            router = start([sys.executable, "-m", "pagoda.entrypoints.cli", "router", "--policy", policy,
                            "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
                            *[a for u in urls for a in ("--backend", u)],
                            *(events_flags if policy == "precise" else [])], logs / f"router-{policy}.log")
            try:
                wait_healthy(f"http://127.0.0.1:{port}", router, 60, "pagoda router")
                time.sleep(1.0)  # every backend probed at least once
                result = asyncio.run(run_policy(f"http://127.0.0.1:{port}", model, policy, args, salt=i))
            finally:
                stop(router)
            summaries.append(result.summary())
            print("\n".join(table(summaries[-1:]).splitlines()[1:]), flush=True)
    finally:
        for process in replicas:
            stop(process)
    print(table(summaries))
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(summaries, indent=2))
    return 0 if all(s["errors"] == 0 for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
