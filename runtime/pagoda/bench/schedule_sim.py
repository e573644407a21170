"""`pagoda bench schedule`: the scheduler over the load matrix in seconds, without a model.

A served matrix takes over an hour on 2 CPU cores and moves 10-30 % between runs, so it cannot say which of two
scheduling rules is better on every load. This runs the real `core.scheduler.Scheduler` and its learnt step costs
(`core.step_cost`) through each load of `bench.matrix` (the same arrivals: closed loops of `concurrency` clients,
Poisson arrivals, random lengths) on a simulated clock, each step priced by `StepPrices`, and reports the figures
`pagoda bench serve --matrix` reports: output tok/s, TTFT median and p90, ITL median and p99.

Two rules side by side: prefill-first (no prompt budget: waiting prompts take the whole `max_num_batched_tokens`
beside the decodes, as vLLM's chunked prefill) at vLLM's prices, and Pagoda's `--target-itl-ms auto` at each
factor asked (`--factors`) and each queue cap (`--queue-steps`) at Pagoda's prices. Prices are per engine and per
machine (below): `--prices zen3` (the default; both engines measured) or `--prices zen4` (Pagoda's only: both rules
run at them); `--same-prices` gives both rules Pagoda's, so that only the rules differ. Each load runs on a fresh engine, which has measured nothing
when its burst comes; `--one-server` carries each rule's learnt step costs from load to load in the matrix's order,
as one served matrix does (a burst is then sized from the steps the loads before it measured).

What it leaves out: HTTP and detokenization, the machine's jitter and async scheduling. By default a burst arrives at
one instant, so loads of equal short answers run in lockstep waves (tiny-c32's ITL p99: 0.12 s); `--send-delay S`
makes each request reach the scheduler uniform(0, S) seconds after its client sends it, as HTTP and the server's
event loop spread them (at 0.1 s tiny-c32 gives TTFT 0.68 / 1.67 s and ITL p99 0.25 s; served 0.73 / 1.52 s and
0.27 s; at the rule before, 1.28 / 1.83 s and 0.94 s, served 1.36 / 1.92 s and 0.95 s). Its figures are for
comparing rules, not for quoting as served ones (docs/benchmarks.md has those).
"""

import argparse
import heapq
import random
import statistics
import sys
from dataclasses import dataclass

from pagoda.bench.figures import percentile
from pagoda.bench.matrix import Load, loads
from pagoda.bench.serve import synthetic_requests
from pagoda.config import AUTO_TARGET, SchedulerConfig
from pagoda.core.arrival_rate import DEFAULT_WINDOW
from pagoda.core.block_manager import BlockManager
from pagoda.core.itl_tail import DEFAULT_SHARE, ItlTail
from pagoda.core.scheduler import AUTO_TARGET_FACTOR, MAX_QUEUE_STEPS, Scheduler
from pagoda.core.sequence import Sequence
from pagoda.core.step_cost import StepCostModel
from pagoda.sampling_params import SamplingParams


@dataclass(frozen=True)
class StepPrices:
    """What a step costs one engine, in seconds: per_step + each prompt token's per_prompt_token and its causal
    attention (a chunk of positions [s, s + k) adds attention x ((s + k)^2 - s^2)) + each decode's per_decode and
    per_context_token x its context."""
    per_step: float
    per_prompt_token: float
    attention: float
    per_decode: float
    per_context_token: float


# The default model on 2 cores of a Zen 3 AMD EPYC (AVX2, no AVX-512), each engine offline (its LLM class, Pagoda at
# its default bfloat16 weights, widened in its AVX2 matmul, vLLM 0.32 at float32 in its peer environment; prefix
# caching off; the median of 3; 2026-12-07): a prompt alone of 32, 256, 750 and 1,500 tokens takes 66, 444, 1,384 and
# 3,157 ms (Pagoda) and 93, 535, 1,667 and 3,763 ms (vLLM), the n^2 term being attention; 16 prompts of 128 tokens in
# one step 3,553 and 3,629 ms; a step of one decode 17.8 and 42.5 ms (per_step: that step less its decode), of 32 at
# ~48 tokens of context 87 and 137 ms, of 64 at ~316 tokens 188 and 365 ms. Served the same day, c128 came within 5 %
# of these (231 tok/s and a TTFT p90 of 23.5-24.6 s; simulated 240 tok/s and 24.7 s at seed 61). The prices before
# (2026-11-29: Pagoda's prompt token 2.06 ms against vLLM's 1.89, vLLM's one-decode step 63.9 ms) came from a slower
# phase of the machine
PAGODA_PRICES = StepPrices(per_step=0.0156, per_prompt_token=1.56e-3, attention=3.5e-7, per_decode=2.08e-3,
                           per_context_token=1.85e-6)
VLLM_PRICES = StepPrices(per_step=0.039, per_prompt_token=1.85e-3, attention=4.2e-7, per_decode=2.94e-3,
                         per_context_token=7.2e-6)
# Pagoda served on 2 cores of a Zen 4 AMD EPYC (AVX512-BF16, bfloat16; 2026-12-01): a step of 1,024 prompt
# tokens alone 643 ms, of 32 decodes alone at ~320 tokens of context 39-47 ms (median ~43), of one 256-token prompt
# beside 30 such decodes ~205 ms; offline, a prompt alone of 256, 750 and 1,500 tokens 144, 457 and 1,040 ms (the
# n^2 term), one decode 9.7 ms (the fixed part: reading the weights), decode attention 0.29 ms a layer at 32 x 320
# (`python -m pagoda.bench.cpu_attention`). At these prices the simulated matrix comes within 10-20 % of the served
# one's throughput and TTFT median on every load, chat-c32's TTFT p90 and ITL inside the served runs' spread
# (docs/benchmarks.md); its ITL p99 runs under the served one where the client's own delivery adds a tail
# (short-long-c64: 120 against 190-216 ms)
ZEN4_PRICES = StepPrices(per_step=0.009, per_prompt_token=0.59e-3, attention=1.17e-7, per_decode=0.79e-3,
                         per_context_token=0.85e-6)
# Both engines offline on 2 cores of an Intel Xeon with AMX (family 6 model 167, bfloat16; 2026-12-05, Pagoda at
# 12dc746, vLLM 0.32 with its oneDNN AMX matmuls): a prompt alone of 32, 256, 750 and 1,500 tokens takes 18.5, 52.4, 141
# and 301 ms (Pagoda) and 23.2, 58.5, 180 and 314 ms (vLLM); a step of one decode 14.2 and 18.2 ms, of 32 at 48 tokens
# of context 23.2 and 35.3 ms, of 64 at ~332 tokens 57.4 and 70.4 ms
XEON_PAGODA_PRICES = StepPrices(per_step=0.012, per_prompt_token=1.52e-4, attention=2.74e-8, per_decode=2.9e-4,
                                per_context_token=1.27e-6)
XEON_VLLM_PRICES = StepPrices(per_step=0.016, per_prompt_token=1.59e-4, attention=2.64e-8, per_decode=5.6e-4,
                              per_context_token=0.87e-6)
PRICES = {"zen3": (PAGODA_PRICES, VLLM_PRICES), "zen4": (ZEN4_PRICES, ZEN4_PRICES),  # Pagoda's, prefill-first's
          "xeon": (XEON_PAGODA_PRICES, XEON_VLLM_PRICES)}
JITTER = 0.03  # each step's price times uniform(1 - JITTER, 1 + JITTER): the step-cost model never sees equal steps


@dataclass(frozen=True)
class SimResult:
    output_tok_s: float
    ttft_median: float  # seconds
    ttft_p90: float
    itl_median: float
    itl_p99: float
    seconds: float  # the load's simulated length
    ttft_by_request: tuple[float, ...]  # in the order the requests were sent


def step_seconds(prices: StepPrices, scheduled, prompt_lens: dict[int, int], rng: random.Random,
                 jitter: float = JITTER) -> float:
    """One step's simulated seconds: its decodes and prompt chunks at `prices`."""
    seconds = prices.per_step
    for s in scheduled:
        start, n = s.num_computed_tokens, s.num_new_tokens
        if n == 1 and start >= prompt_lens[s.seq_id]:
            seconds += prices.per_decode + prices.per_context_token * start
        else:
            seconds += prices.per_prompt_token * n + prices.attention * ((start + n) ** 2 - start ** 2)
    return seconds * rng.uniform(1 - jitter, 1 + jitter)


def _lengths(load: Load, seed: int) -> list[tuple[int, int]]:
    """Each request's (prompt, answer) tokens, drawn as `pagoda bench serve` draws them (its word prompts: about a
    token a word)."""
    requests = synthetic_requests(load.num_prompts, load.input_len, load.output_len, load.range_ratio, seed)
    return [(len(r.prompt.split()), r.output_len) for r in requests]


def _arrivals(load: Load, rng: random.Random) -> list[float]:
    """When each request may be sent: all at once, or Poisson at request_rate (then bounded by concurrency)."""
    times, t = [], 0.0
    for _ in range(load.num_prompts):
        times.append(t)
        if load.request_rate != float("inf"):
            t += rng.expovariate(load.request_rate)
    return times


def simulate(load: Load, prices: StepPrices, target_itl_ms: float | str | None = AUTO_TARGET,
             auto_target_factor: float = AUTO_TARGET_FACTOR, max_queue_steps: float = MAX_QUEUE_STEPS, seed: int = 0,
             max_num_batched_tokens: int = 2048,
             max_num_seqs: int = 256, jitter: float = JITTER, send_delay: float = 0.0,
             step_costs: StepCostModel | None = None, arrival_window: float = DEFAULT_WINDOW,
             itl_tail_share: float = DEFAULT_SHARE) -> SimResult:
    """One load through the real scheduler on a simulated clock. target_itl_ms None: prefill-first (vLLM's).
    send_delay: a client's request reaches the scheduler uniform(0, send_delay) seconds after it may be sent (its
    slot freed, its Poisson arrival): HTTP, tokenization and the server's event loop, which spread a burst.
    step_costs: what the engine has learnt before this load (one server through the matrix), else nothing.
    arrival_window: the seconds auto's arrival pace is counted over (core.arrival_rate; 0: no pace rule).
    itl_tail_share: the share of token gaps auto's bursts may delay (core.itl_tail; 0: no burst taken whole)."""
    rng = random.Random(seed)
    delays = random.Random(seed + 1)  # apart, so that send_delay 0 draws the same steps as before
    lengths, arrivals = _lengths(load, seed), _arrivals(load, rng)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             enable_chunked_prefill=True, max_model_len=8192, target_itl_ms=target_itl_ms)
    num_blocks = 1 + sum(p + o for p, o in lengths) // 16 + load.num_prompts  # room for all: no preemption
    scheduler = Scheduler(config, BlockManager(num_blocks, 16, enable_prefix_caching=False),
                          step_costs=step_costs if step_costs is not None else StepCostModel(),
                          auto_target_factor=auto_target_factor, max_queue_steps=max_queue_steps,
                          arrival_window=arrival_window)
    scheduler.itl_tail = ItlTail(share=itl_tail_share)
    concurrency = load.concurrency or load.num_prompts
    free_at = [0.0] * concurrency  # when each client slot may send (a min-heap)
    now, sent, finished = 0.0, 0, 0
    prompt_lens: dict[int, int] = {}
    last_token: dict[int, float] = {}  # seq id -> when its last token came (its arrival before the first)
    ttfts: dict[int, float] = {}  # request index -> its TTFT
    pending: list[tuple[float, int, Sequence]] = []  # sent, not at the scheduler yet: (when it is, index, seq), a heap
    itls: list[float] = []
    while finished < load.num_prompts:
        while sent < load.num_prompts and free_at and max(free_at[0], arrivals[sent]) <= now:
            sent_at = max(heapq.heappop(free_at), arrivals[sent])
            due = sent_at + delays.uniform(0, send_delay)
            prompt, answer = lengths[sent]
            seq = Sequence(str(sent), [1] * prompt, SamplingParams(max_tokens=answer, ignore_eos=True),
                           arrival_time=due)
            prompt_lens[seq.seq_id], last_token[seq.seq_id] = prompt, sent_at  # TTFT as the client sees it
            heapq.heappush(pending, (due, sent, seq))
            sent += 1
        while pending and pending[0][0] <= now:
            scheduler.add(heapq.heappop(pending)[2])
        out = scheduler.schedule()
        if not out.scheduled:  # idle until the next request reaches the scheduler
            upcoming = [pending[0][0]] if pending else []
            if sent < load.num_prompts and free_at:
                upcoming.append(max(free_at[0], arrivals[sent]))
            now = max(now, min(upcoming))
            continue
        seconds = step_seconds(prices, out.scheduled, prompt_lens, rng, jitter)
        now += seconds
        scheduler.step_costs.observe(out.num_batched_tokens, seconds, out.num_decodes, out.decode_context_tokens)
        scheduler.step_done(out)
        for s in out.scheduled:
            if not s.num_samples:
                continue
            seq = scheduler.get(s.seq_id)
            seq.append_token(0)
            if seq.num_output_tokens == 1:
                ttfts[int(seq.request_id)] = now - last_token[s.seq_id]
            else:
                itls.append(now - last_token[s.seq_id])
            last_token[s.seq_id] = now
            if seq.num_output_tokens >= seq.params.max_tokens:
                scheduler.finish(seq, "length")
                finished += 1
                heapq.heappush(free_at, now)
    by_request = tuple(ttfts[i] for i in range(load.num_prompts))
    itls.sort()
    return SimResult(sum(o for _, o in lengths) / now, statistics.median(by_request),
                     percentile(sorted(by_request), 0.9), statistics.median(itls) if itls else 0.0,
                     percentile(itls, 0.99) if itls else 0.0, now, by_request)


def _cell(result: SimResult) -> str:
    return (f"{result.output_tok_s:6.1f} tok/s  TTFT {result.ttft_median:6.2f} / {result.ttft_p90:6.2f} s  "
            f"ITL {result.itl_median * 1e3:5.0f} / {result.itl_p99 * 1e3:6.0f} ms")


def _name(rule: tuple[float, float], with_queue: bool) -> str:
    return f"auto x{rule[0]:g}" + (f" q{rule[1]:g}" if with_queue else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pagoda bench schedule", description=__doc__.split("\n\n")[0])
    p.add_argument("--factors", default=str(AUTO_TARGET_FACTOR), metavar="F[,F...]",
                   help=f"--target-itl-ms auto's factors to compare (default: the engine's, {AUTO_TARGET_FACTOR})")
    p.add_argument("--queue-steps", default=f"{MAX_QUEUE_STEPS:g}", metavar="N[,N...]",
                   help=f"auto's caps on the decode steps of prompts a queue adds to a step, to compare (default: the "
                        f"engine's, {MAX_QUEUE_STEPS:g}); each with each factor")
    p.add_argument("--arrival-window", type=float, default=DEFAULT_WINDOW, metavar="SECONDS",
                   help=f"the seconds auto's arrival pace is counted over (default: the engine's, {DEFAULT_WINDOW:g}; "
                        f"0: no pace rule)")
    p.add_argument("--matrix-loads", default=None, metavar="NAMES",
                   help="only these loads (comma-separated: the matrix's or those beside it), as `pagoda bench serve "
                        "--matrix-loads`")
    p.add_argument("--prices", choices=sorted(PRICES), default="zen3",
                   help="the machine the steps are priced for (default zen3: both engines measured; zen4: Pagoda's "
                        "prices for both rules; xeon: both engines measured on an Intel Xeon with AMX)")
    p.add_argument("--same-prices", action="store_true",
                   help="price both rules' steps at Pagoda's: compare the rules alone")
    p.add_argument("--send-delay", type=float, default=0.0, metavar="SECONDS",
                   help="each request reaches the scheduler uniform(0, SECONDS) after it is sent (default 0: a burst "
                        "at one instant)")
    p.add_argument("--one-server", action="store_true",
                   help="one server through the loads in their order: each rule's learnt step costs carried from "
                        "load to load, as a served matrix's (default: each load on a fresh engine)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not args.send_delay >= 0:
        p.error(f"--send-delay: seconds >= 0, got {args.send_delay}")
    if not args.arrival_window >= 0:
        p.error(f"--arrival-window: seconds >= 0, got {args.arrival_window}")
    try:
        factors = [float(f) for f in args.factors.split(",")]
    except ValueError:
        factors = []
    if not factors or any(not f >= 1 for f in factors):
        p.error(f"--factors: each factor must be a number >= 1 (a step with prompts at least a decode step); "
                f"got {args.factors!r}")
    try:
        queue_steps = [float(q) for q in args.queue_steps.split(",")]
    except ValueError:
        queue_steps = []
    if not queue_steps or any(not q >= 0 for q in queue_steps):
        p.error(f"--queue-steps: each cap must be a number of decode steps >= 0; got {args.queue_steps!r}")
    rules = [(f, q) for f in factors for q in queue_steps]
    try:
        chosen = loads(args.matrix_loads)
    except ValueError as e:
        p.error(str(e))
    prices, first_prices = PRICES[args.prices]
    if args.same_prices:
        first_prices = prices
    worst = {rule: [0.0, 0.0, 0.0] for rule in rules}  # TTFT median, p90, ITL p99: the largest ratio to prefill-first
    # each rule's engine memory: None, a fresh one for every load; else one server's, carried through the loads
    costs = {rule: StepCostModel() if args.one_server else None for rule in (None, *rules)}
    for load in chosen:
        base = simulate(load, first_prices, target_itl_ms=None, seed=args.seed, send_delay=args.send_delay,
                        step_costs=costs[None])
        print(f"{load.name:17s} prefill-first  {_cell(base)}")
        for rule in rules:
            r = simulate(load, prices, auto_target_factor=rule[0], max_queue_steps=rule[1], seed=args.seed,
                         send_delay=args.send_delay, step_costs=costs[rule], arrival_window=args.arrival_window)
            ratios = (r.ttft_median / base.ttft_median, r.ttft_p90 / base.ttft_p90,
                      r.itl_p99 / base.itl_p99 if base.itl_p99 else 1.0)
            worst[rule] = [max(w, x) for w, x in zip(worst[rule], ratios)]
            print(f"{'':17s} {_name(rule, len(queue_steps) > 1):14s} {_cell(r)}  (ITL p99 "
                  f"{r.itl_p99 / r.itl_median:.1f}x its median)")
    for rule in rules:
        print(f"{_name(rule, len(queue_steps) > 1)}: against prefill-first, the worst TTFT median ratio "
              f"{worst[rule][0]:.2f}, TTFT p90 {worst[rule][1]:.2f}, ITL p99 {worst[rule][2]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
