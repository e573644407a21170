"""`pagoda bench serve`: load an OpenAI-compatible server, in the spirit of vLLM's benchmark_serving.

Requests stream from `/v1/completions` (or `/v1/chat/completions`) at a fixed concurrency or with
Poisson arrivals at `--request-rate`; prompts are synthetic (seeded lengths) or come from a JSONL file.
Reports request and token throughput and TTFT, TPOT, ITL and end-to-end latency (mean, median, p99).

`--offline MODEL` runs the same requests, with the same concurrency, through an in-process
`AsyncLLMEngine` instead of HTTP: the difference is what the server adds.

`--matrix` runs the named loads of pagoda/bench/matrix.py instead of one (prompts 32-1,500 tokens, answers
16-512, concurrency 1-64, Poisson arrivals, random lengths), with `--vllm-python` each beside vLLM's in
alternating pairs, and prints one table (`--table FILE` also writes it); `--client vllm` has vLLM's own
`vllm bench serve` measure both servers.
"""

import argparse
import asyncio
import functools
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pagoda.bench import matrix
from pagoda.bench.figures import RequestResult, summarize
from pagoda.bench.vllm_peer import PEER_MAX_MODEL_LEN
from pagoda.platform.isa import ALL_LEVELS

_WORDS = ("the of and to in is was for on are with as by at from his her they be this that have which "
          "one you had not but what all were when we there can an your their said if do will each about "
          "how up out them then she many some so these would other into has more two time like him see "
          "could no make than first been its who now people my made over did down only way find use may "
          "water long little very after words called just where most know get through back much before "
          "go good new write our used me man day too any same right look think also around another came "
          "come work three word must because does part even place well such here take why things help "
          "put years different away again off went old number great tell men say small every found still "
          "between name should home big give air line set own under read last never us left end along "
          "while might next sound below saw something thought both few those always looked show large "
          "often together asked house don't world going want school important until form food keep "
          "children feet land side without boy once animals life enough took sometimes four head above "
          "kind began almost live page got earth need far hand high year mother light parts country "
          "father let night following picture being study second eyes soon times story boys since white "
          "days ever paper hard near sentence better best across during today others however sure means "
          "knew its try told young miles sun ways thing whole hear example heard several change answer "
          "room sea against top turned learn point city play toward five using himself usually").split()


@dataclass
class BenchRequest:
    prompt: str | list[int] | list[dict]  # text, token ids, or chat messages
    output_len: int
    prompt_len: int | None = None  # known when made from token ids


# --- workloads -------------------------------------------------------------------------------------

@functools.cache  # once a path: the --tokenizer check loads it, and the run uses the same one
def load_tokenizer(path: str | None):
    if not path or not Path(path).is_dir():
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except Exception:  # noqa: BLE001 - fall back to word prompts
        return None


def synthetic_requests(n: int, input_len: int, output_len: int, range_ratio: float, seed: int,
                       tokenizer=None) -> list[BenchRequest]:
    """Lengths uniform in [len x (1 - r), len x (1 + r)]. With a tokenizer, prompts are exact token ids."""
    rng = random.Random(seed)

    def length(center: int) -> int:
        return max(1, rng.randint(int(center * (1 - range_ratio)), int(center * (1 + range_ratio))))

    if tokenizer is not None:
        specials = set(tokenizer.all_special_ids)
        allowed = [t for t in range(len(tokenizer)) if t not in specials]
    requests = []
    for _ in range(n):
        plen, olen = length(input_len), length(output_len)
        if tokenizer is not None:
            requests.append(BenchRequest([rng.choice(allowed) for _ in range(plen)], olen, plen))
        else:  # about one token per common word
            requests.append(BenchRequest(" ".join(rng.choice(_WORDS) for _ in range(plen)), olen))
    return requests


def jsonl_requests(path: str, n: int | None, output_len: int) -> list[BenchRequest]:
    """One object a line: {"prompt": str} or {"messages": [...]}, optional "output_len"/"max_tokens"."""
    requests = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}, line {number}: not JSON ({e})") from None
        prompt = item.get("prompt", item.get("messages")) if isinstance(item, dict) else None
        if prompt is None:
            raise ValueError(f"{path}, line {number}: every line needs 'prompt' or 'messages'")
        requests.append(BenchRequest(prompt, int(item.get("output_len", item.get("max_tokens", output_len)))))
        if n is not None and len(requests) >= n:
            break
    return requests


# --- senders ---------------------------------------------------------------------------------------

class HTTPSender:
    def __init__(self, base_url: str, model: str, api_key: str | None, endpoint: str,
                 temperature: float | None = None):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.temperature = temperature  # None: the server's default, as vllm bench serve sends
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.endpoint = endpoint
        self.session = None

    async def __aenter__(self):
        import aiohttp

        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=6 * 3600),
                                             connector=aiohttp.TCPConnector(limit=0))
        return self

    async def __aexit__(self, *exc):
        await self.session.close()

    async def preemptions(self) -> float | None:
        """The server's preemption counter (Pagoda's and vLLM's `*:num_preemptions_total`), or None."""
        try:
            async with self.session.get(f"{self.base_url}/metrics", headers=self.headers) as resp:
                text = await resp.text()
        except Exception:  # noqa: BLE001 - a server without /metrics: the figure is left out
            return None
        values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if not line.startswith("#") and line.split("{")[0].split(" ")[0].endswith(":num_preemptions_total")]
        return sum(values) if values else None

    async def send(self, req: BenchRequest) -> RequestResult:
        body = {"model": self.model, "max_tokens": req.output_len, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True}
        if self.temperature is not None:
            body["temperature"] = self.temperature
        chat = self.endpoint == "chat" or isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], dict)
        if chat:
            messages = req.prompt if isinstance(req.prompt, list) else [{"role": "user", "content": req.prompt}]
            url, body["messages"] = f"{self.base_url}/v1/chat/completions", messages
        else:
            url, body["prompt"] = f"{self.base_url}/v1/completions", req.prompt
        result = RequestResult(start=time.perf_counter())
        last = result.start
        try:
            async with self.session.post(url, json=body, headers=self.headers) as response:
                if response.status != 200:
                    result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                    return result
                async for raw in response.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        result.error = chunk["error"].get("message", "error event")
                        return result
                    if chunk.get("usage"):
                        result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                        result.output_tokens = chunk["usage"]["completion_tokens"]
                    if _brings_tokens(chunk.get("choices")):
                        now = time.perf_counter()
                        if result.ttft == 0.0:
                            result.ttft = now - result.start
                        else:
                            result.itl.append(now - last)
                        last = now
            result.latency = time.perf_counter() - result.start
            result.ok = result.ttft > 0
            if not result.ok:
                result.error = "no tokens received"
        except Exception as e:  # noqa: BLE001 - counted as a failed request
            result.error = repr(e)
        return result


def _brings_tokens(choices: list | None) -> bool:
    """Whether a streamed chunk brings tokens, as `vllm bench serve` times them: every chunk with a choice's text,
    empty too (a server sends one for a token whose text it holds back, half a character), but not the chat
    stream's first chunk, which only names the role."""
    if not choices:
        return False
    choice = choices[0]
    if "text" in choice:
        return choice["text"] is not None
    delta = choice.get("delta") or {}
    return delta.get("role") is None and any(delta.get(key) is not None for key in
                                             ("content", "reasoning", "reasoning_content", "tool_calls"))


class EngineSender:
    """The same requests through an in-process AsyncLLMEngine: the baseline without HTTP."""

    def __init__(self, engine, temperature: float | None = None):
        self.engine = engine
        self.temperature = temperature
        self.count = 0

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return None

    async def preemptions(self) -> float | None:
        return None

    async def send(self, req: BenchRequest) -> RequestResult:
        from pagoda import SamplingParams

        params = SamplingParams(max_tokens=req.output_len, ignore_eos=True,
                                temperature=1.0 if self.temperature is None else self.temperature)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            prompt = self.engine.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        elif isinstance(prompt, list):
            prompt = {"prompt_token_ids": prompt}
        self.count += 1
        result = RequestResult(start=time.perf_counter())
        last, seen = result.start, 0
        try:
            async for out in self.engine.generate(prompt, params, f"bench-{self.count}"):
                now = time.perf_counter()
                n = len(out.outputs[0].token_ids)
                if n > seen:
                    if result.ttft == 0.0:
                        result.ttft = now - result.start
                    else:
                        result.itl.append(now - last)
                    last, seen = now, n
                result.prompt_tokens, result.output_tokens = len(out.prompt_token_ids), n
            result.latency = time.perf_counter() - result.start
            result.ok = True
        except Exception as e:  # noqa: BLE001
            result.error = repr(e)
        return result


# --- the run ---------------------------------------------------------------------------------------

async def run(sender, requests: list[BenchRequest], concurrency: int | None, rate: float, seed: int):
    rng = random.Random(seed)
    limit = asyncio.Semaphore(concurrency) if concurrency else None

    async def one(req: BenchRequest) -> RequestResult:
        if limit is None:
            return await sender.send(req)
        async with limit:
            return await sender.send(req)

    tasks = []
    start = time.perf_counter()
    for req in requests:
        tasks.append(asyncio.create_task(one(req)))
        if rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))  # Poisson arrivals
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


def report(summary: dict, title: str) -> str:
    lines = [f"{'=' * 18} {title} {'=' * 18}",
             f"{'Successful requests:':<40}{summary['completed']}",
             f"{'Failed requests:':<40}{summary['failed']}",
             f"{'Benchmark duration (s):':<40}{summary['duration_s']:.2f}",
             f"{'Total input tokens:':<40}{summary['total_input_tokens']}",
             f"{'Total generated tokens:':<40}{summary['total_output_tokens']}",
             f"{'Request throughput (req/s):':<40}{summary['request_throughput']:.2f}",
             f"{'Output token throughput (tok/s):':<40}{summary['output_token_throughput']:.2f}",
             f"{'Total token throughput (tok/s):':<40}{summary['total_token_throughput']:.2f}"]
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E latency")):
        s = summary[key]
        lines.append(f"{name + ' (ms) mean / median / p90 / p99:':<40}"
                     f"{s['mean']:.1f} / {s['median']:.1f} / {s['p90']:.1f} / {s['p99']:.1f}")
    if "preemptions" in summary:
        lines.append(f"{'Preemptions (server counter):':<40}{summary['preemptions']}")
    for error in summary["errors"]:
        lines.append(f"error: {error}")
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="pagoda bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (without /v1)")
    p.add_argument("--model", default=None, help="the `model` field (default: the server's first model)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--dataset", choices=("random", "jsonl"), default="random")
    p.add_argument("--dataset-path", default=None, help="the JSONL file for --dataset jsonl")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=256, help="synthetic prompt tokens (center)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request (center)")
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform within +-this fraction")
    p.add_argument("--tokenizer", default=None,
                   help="local tokenizer for exact-length token-id prompts (default: the server's model "
                        "directory when it is local; else word prompts of about --input-len tokens)")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrivals per second (default inf: all at once, bounded by --max-concurrency)")
    p.add_argument("--temperature", type=float,
                   help="each request's temperature (default: none sent, the server's default, as vllm bench serve; "
                        "--offline: 1.0). Random sampling costs the server more than greedy (0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=2, help="requests sent (and not measured) first")
    p.add_argument("--offline", default=None, metavar="MODEL",
                   help="run in-process on an AsyncLLMEngine for MODEL ('default' for the default model)")
    p.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="after the server, start `vllm serve` from this installation's Python (or venv directory) "
                        "on the same model directory, send it the same requests, and print both with their ratios")
    p.add_argument("--vllm-dtype", default="best",
                   help="vLLM's dtype (default best: its fastest on this CPU, bfloat16 with AVX512-BF16 or ARM's BF16, "
                        "else float32)")
    p.add_argument("--vllm-kv-cache-dtype", default=None, help="vLLM's --kv-cache-dtype (default: its own, auto)")
    p.add_argument("--vllm-kv-cache-gib", type=int, default=2,
                   help="vLLM's KV cache (VLLM_CPU_KVCACHE_SPACE, whole GiB; default 2: Pagoda's CPU default)")
    p.add_argument("--vllm-model", default=None, metavar="DIR",
                   help="the model directory vLLM serves (default: the Pagoda server's, from /v1/models)")
    p.add_argument("--result-json", default=None, help="also write the summary to this file")
    p.add_argument("--matrix", action="store_true",
                   help="run the load matrix (" + ", ".join(load.name for load in matrix.MATRIX) + ") instead of "
                        "one load: --input-len, --output-len, --range-ratio, --max-concurrency, --request-rate "
                        "and --num-prompts come from each load; with --vllm-python, vLLM's server runs beside in "
                        "alternating pairs (Pagoda, vLLM, then vLLM, Pagoda); prints one table")
    p.add_argument("--matrix-loads", default=None, metavar="NAMES",
                   help="with --matrix: only these loads (comma-separated names): the matrix's, or beside it "
                        + ", ".join(load.name for load in matrix.OTHER_LOADS))
    p.add_argument("--table", default=None, metavar="FILE", help="with --matrix: also write the table (Markdown)")
    p.add_argument("--client", choices=("pagoda", "vllm"), default="pagoda",
                   help="with --matrix and --vllm-python: who sends the requests and measures, this client or "
                        "vLLM's own `vllm bench serve` from that installation (its random dataset: prompts of "
                        "each load's lengths, drawn by vLLM)")
    p.add_argument("--isa", default=None, choices=ALL_LEVELS, metavar="LEVEL",
                   help="with --offline: run the engine's kernels (and torch's ATen, MKL, oneDNN) at this CPU ISA "
                        f"level ({', '.join(ALL_LEVELS)}); with --vllm-python: run vLLM's peer at it (start "
                        "Pagoda's server with PAGODA_CPU_ISA=LEVEL to match)")
    args = p.parse_args(argv)
    if args.isa and not (args.offline or args.vllm_python):
        p.error("--isa applies to the in-process engine (--offline) or the vLLM peer (--vllm-python); "
                "start a Pagoda server with PAGODA_CPU_ISA=LEVEL")
    if args.vllm_python and args.offline:
        p.error("--vllm-python compares servers: it cannot be combined with --offline")
    if args.matrix and args.dataset != "random":
        p.error("--matrix runs synthetic loads: it cannot be combined with --dataset jsonl")
    if (args.matrix_loads or args.table) and not args.matrix:
        p.error("--matrix-loads and --table apply to --matrix")
    if args.client == "vllm" and not (args.matrix and args.vllm_python):
        p.error("--client vllm runs vLLM's `vllm bench serve` over the load matrix: it needs --matrix and "
                "--vllm-python")
    if args.client == "vllm" and args.endpoint != "completions":
        p.error("--client vllm sends to /v1/completions: it cannot be combined with --endpoint chat")
    if args.matrix_loads:
        try:
            matrix.loads(args.matrix_loads)
        except ValueError as e:
            p.error(str(e))
    if args.dataset == "jsonl" and not args.dataset_path:
        p.error("--dataset jsonl needs --dataset-path")
    if args.dataset == "jsonl" and not Path(args.dataset_path).is_file():
        p.error(f"--dataset-path: no file at {args.dataset_path}")
    if args.tokenizer and load_tokenizer(args.tokenizer) is None:  # (the server's own falls back to words)
        p.error(f"--tokenizer: no Hugging Face tokenizer in {args.tokenizer}")
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--max-concurrency must be >= 1")
    if not args.request_rate > 0:
        p.error("--request-rate must be > 0")
    if args.vllm_python:  # before any load runs, not after Pagoda's half of it
        from pagoda.bench.vllm_peer import check_vllm_python

        try:
            check_vllm_python(args.vllm_python)
        except SystemExit as e:
            p.error(str(e))
    return args


def discover_model(base_url: str, api_key: str | None) -> tuple[str, str | None]:
    """The served model's id and its directory (the server's `root`) from GET /v1/models; a CLI error naming
    --base-url when nothing answers there or the answer is no model list."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/v1/models"
    try:
        response = httpx.get(url, headers=headers, timeout=30)
        response.raise_for_status()
        data = response.json()["data"][0]
        return data["id"], data.get("root")
    except httpx.HTTPError as e:
        raise SystemExit(f"pagoda bench serve: error: --base-url: no model list at {url}: {e}") from None
    except (ValueError, LookupError, TypeError):
        raise SystemExit(f"pagoda bench serve: error: --base-url: {url} did not answer a model list "
                         "(an OpenAI-compatible server's /v1/models)") from None


def cpu_line(forced_here: bool) -> str:
    """The CPU beside the figures: this host's, at the level the engine runs (a server's own when it runs here)."""
    from pagoda import platform

    isa = platform.cpu_isa()
    where = "in-process engine" if forced_here else "this host (the server's, if it runs here)"
    return f"CPU: {isa.model}; ISA level {isa.level} ({'forced' if isa.forced else 'native'}; {where})"


async def main_async(args) -> dict:
    if args.isa:
        from pagoda import platform

        try:
            platform.force_level(args.isa)
        except platform.UnsupportedIsa as e:
            raise SystemExit(f"--isa: {e}") from None
    if args.vllm_dtype == "best":
        from pagoda import platform
        from pagoda.bench.vllm_peer import best_dtype

        args.vllm_dtype = best_dtype(platform.cpu_isa().level)
    if args.offline:
        from pagoda import AsyncEngineArgs, AsyncLLMEngine

        model = None if args.offline == "default" else args.offline
        engine = await asyncio.to_thread(AsyncLLMEngine.from_engine_args, AsyncEngineArgs(model=model))
        sender, tokenizer = EngineSender(engine, args.temperature), engine.tokenizer
        title = "Offline (in-process engine) Benchmark Result"
    else:
        model, root = (args.model, None) if args.model else discover_model(args.base_url, args.api_key)
        sender = HTTPSender(args.base_url, model, args.api_key, args.endpoint, args.temperature)
        tokenizer = await asyncio.to_thread(load_tokenizer, args.tokenizer or root)
        title = "Serving Benchmark Result"
    if args.matrix:
        return await main_matrix(args, sender, tokenizer, model, None if args.offline else root,
                                 engine if args.offline else None)
    if args.dataset == "jsonl":
        try:
            requests = jsonl_requests(args.dataset_path, args.num_prompts, args.output_len)
        except ValueError as e:
            raise SystemExit(f"pagoda bench serve: error: --dataset-path: {e}") from None
    else:
        requests = synthetic_requests(args.num_prompts + args.warmup, args.input_len, args.output_len,
                                      args.range_ratio, args.seed, tokenizer)
    warmup, requests = requests[: args.warmup], requests[args.warmup:] or requests
    try:
        summary = await measure(sender, warmup, requests, args)
    finally:
        if args.offline:
            engine.shutdown()
    del summary["results"]
    print(cpu_line(bool(args.offline)))
    print(report(summary, title))
    if args.vllm_python:
        peer = await measure_vllm(args, model, args.vllm_model or root, warmup, requests)
        del peer["results"]
        print(report(peer, f"vLLM ({args.vllm_dtype}; same client, same requests) Benchmark Result"))
        print(compare(summary, peer))
        summary["vllm"] = peer
    from pagoda import platform

    isa = platform.cpu_isa()
    summary.update(cpu=isa.model, isa_level=isa.level, isa_forced=isa.forced, amx=isa.amx)
    return summary


async def main_matrix(args, sender, tokenizer, model: str, model_dir: str | None, engine=None) -> dict:
    """--matrix: every load, printed as one table; the summary holds each load's figures."""
    try:
        results = await matrix.run_matrix(
            args, sender, tokenizer, model, args.vllm_model or model_dir, measure=measure,
            synthetic_requests=synthetic_requests,
            http_sender=lambda url, name: HTTPSender(url, name, None, args.endpoint, args.temperature))
    finally:
        if engine is not None:
            engine.shutdown()
    print(cpu_line(bool(args.offline)))
    text = matrix.table(results)
    print(text)
    if args.table:
        Path(args.table).write_text(text + "\n")
    from pagoda import platform

    isa = platform.cpu_isa()
    return {"matrix": [{"load": load.name, "pagoda": mine, "vllm": theirs} for load, mine, theirs in results],
            "table": text, "failed": sum(m["failed"] + (t["failed"] if t else 0) for _, m, t in results),
            "cpu": isa.model, "isa_level": isa.level, "isa_forced": isa.forced, "amx": isa.amx}


async def measure(sender, warmup, requests, args) -> dict:
    async with sender:
        if warmup:
            await run(sender, warmup, args.max_concurrency, float("inf"), args.seed)
        before = await sender.preemptions()
        results, duration = await run(sender, requests, args.max_concurrency, args.request_rate, args.seed)
        after = await sender.preemptions()
    summary = summarize(results, duration)
    summary["results"] = results  # the matrix pools a load's rounds from them (bench.figures.pooled)
    if before is not None and after is not None:
        summary["preemptions"] = int(after - before)
    summary.update(max_concurrency=args.max_concurrency, request_rate=str(args.request_rate),
                   num_prompts=len(requests), input_len=args.input_len, output_len=args.output_len)
    return summary


def peer_max_model_len(requests: list[BenchRequest], model_dir: str, floor: int = PEER_MAX_MODEL_LEN) -> int:
    """vLLM's --max-model-len for these requests: `floor` (the matrix's, whose loads all fit it), or the longest
    request's prompt and answer where that is more (a prompt known only as text at two tokens a word, more than
    the word prompts take), within the model's max_position_embeddings. vLLM refuses a request past it where
    Pagoda, at the model's own length, serves it, and the comparison would be of nothing."""
    def tokens(req: BenchRequest) -> int:
        if req.prompt_len is not None:
            return req.prompt_len + req.output_len
        text = req.prompt if isinstance(req.prompt, str) else json.dumps(req.prompt)
        return 2 * len(text.split()) + req.output_len

    longest = max((tokens(r) for r in requests), default=0)
    if longest <= floor:
        return floor
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return min(longest, config.get("max_position_embeddings") or longest)


async def measure_vllm(args, model: str, model_dir: str | None, warmup, requests) -> dict:
    from pagoda.bench.vllm_peer import check_vllm_python, vllm_server

    if not model_dir or not Path(model_dir).is_dir():
        raise SystemExit(f"--vllm-python needs the model directory: the server reports {model_dir!r}; "
                         "give --vllm-model DIR")
    python = check_vllm_python(args.vllm_python)
    with vllm_server(python, model_dir, model, dtype=args.vllm_dtype, kv_cache_dtype=args.vllm_kv_cache_dtype,
                     kv_cache_gib=args.vllm_kv_cache_gib,
                     max_model_len=peer_max_model_len([*warmup, *requests], model_dir)) as base_url:
        return await measure(HTTPSender(base_url, model, None, args.endpoint, args.temperature), warmup, requests,
                             args)


def compare(pagoda: dict, vllm: dict) -> str:
    """Pagoda / vLLM for throughput (higher is better) and latencies (lower is better)."""
    def ratio(a, b):
        return f"{a / b:.2f}x" if b else "n/a"

    return "\n".join([
        f"{'Pagoda / vLLM output tok/s:':<40}{ratio(pagoda['output_token_throughput'], vllm['output_token_throughput'])}",
        f"{'Pagoda / vLLM median TTFT:':<40}{ratio(pagoda['ttft_ms']['median'], vllm['ttft_ms']['median'])}",
        f"{'Pagoda / vLLM p90 TTFT:':<40}{ratio(pagoda['ttft_ms']['p90'], vllm['ttft_ms']['p90'])}",
        f"{'Pagoda / vLLM p99 ITL:':<40}{ratio(pagoda['itl_ms']['p99'], vllm['itl_ms']['p99'])}",
        f"{'Pagoda / vLLM median TPOT:':<40}{ratio(pagoda['tpot_ms']['median'], vllm['tpot_ms']['median'])}"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    summary = asyncio.run(main_async(args))
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(summary, indent=2))
    return 0 if summary["failed"] == 0 else 1

