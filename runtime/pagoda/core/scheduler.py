"""Iteration-level scheduling. No torch.

Every step gets a token budget. Running sequences go first (first come, first served), each asking
for the tokens it still has to compute (1 for a decode, a chunk of its prompt otherwise); then waiting
sequences join while budget, sequence slots and KV blocks last. Prefill, chunked prefill and decode
are the same thing: {sequence: number of tokens}. When blocks run out, the most recently admitted
running sequence is preempted: with preemption_mode "swap" its blocks are copied to the host swap space
and back when it resumes (swapped sequences resume before waiting ones are admitted); with "recompute",
or when the swap space is full, its KV is dropped and its tokens recomputed later.

The prefill budget, as vLLM's chunked prefill and Sarathi-Serve's stall-free batching: prompts are served first
come, first served under one token budget, the oldest first and to its end (a running prompt's next chunk goes
before any newer prompt is admitted; only the last prompt admitted in a step is cut). While no decode is running
nobody waits for a token: prompts take the whole `max_num_batched_tokens`. While decodes run, the step's prompt
share is what a latency target (`target_itl_ms`) leaves beyond the measured step of those decodes alone, at the
engine's own measured price per prompt token (core.step_cost), at least a block so that prompts always move. A
target in milliseconds is the user's SLO: a bound; so is a multiple of the decodes' own step ("3x": every step
within 3 times a step of the sequences that will decode, on whatever machine). The target "auto" computes the oldest
prompt whole, as vLLM's chunked prefill would; newer prompts get AUTO_TARGET_FACTOR times what a step of decodes
alone costs at the number of sequences running or waiting (those that will decode), or the waiting prompts' tokens
spread over the steps the decodes have left if that is more (so prompts waiting beside answers about to end take
most of the step, and newer prompts beside long answers take what the target leaves), or, if that is more, the share
of the engine's time the waiting prompts' tokens are of max_num_batched_tokens (so a queue drains at the pace its
size calls for, as a prefill-first engine's would, while the decodes keep a part of every step), or, while the
requests outgrow the engine (an open loop past its rate), the share the prompts' arrival pace needs (so they are
admitted as they come, not once a queue stands: core.arrival_rate); when more prompt tokens wait than that, the step
takes all of max_num_batched_tokens if the token gaps such steps would delay, until the whole queue is in, stay
within the ITL tail's share (core.itl_tail). Without chunked prefill there is no prefill budget: a prompt waits for
a step that holds it whole, as vLLM's.

With `scheduling_policy` "priority" the waiting queue is ordered by (priority, arrival) and the preempted
sequence is the least urgent running one, as vLLM's.

Speculative decoding: a decoding sequence that takes drafts is scheduled like a chunk of 1 + k tokens
(its last token and k drafts, proposed here by prompt lookup or later by the runner's draft model), with
KV slots for all of them; when the step is done the slots of rejected drafts are released.

The model runner keeps its own copy of each sequence's tokens and block table; the scheduler sends
only what changed since the runner last saw the sequence.
"""

from collections import deque

from pagoda.config import AUTO_TARGET, SchedulerConfig, SpeculativeConfig, relative_itl_target
from pagoda.core.arrival_rate import DEFAULT_WINDOW, ArrivalRate
from pagoda.core.block_manager import BlockManager
from pagoda.core.itl_tail import ItlTail
from pagoda.core.runner_output import ModelRunnerOutput
from pagoda.core.scheduler_output import ScheduledSeq, SchedulerOutput
from pagoda.core.sequence import Sequence, SequenceStatus
from pagoda.core.step_cost import StepCostModel
from pagoda.core.step_limits import StepLimits
from pagoda.spec_decode.ngram_proposer import NgramProposer, can_speculate
from pagoda.spec_decode.stats import SpecDecodeStats

# "auto" latency target: the oldest prompt is computed whole (first come, first served, as vLLM's chunked prefill);
# the newer prompts join a step only while it takes at most this many times what a step of the running decodes
# alone would, and a waiting prompt is due this many times sooner than the answers beside it end
# (_backlog_seconds). Time to first token and the decodes' pace are one budget: in a closed loop of c users, mean
# TTFT + mean answer time = c / throughput (Little's law), so every second a decode is spared is a second a prompt
# waits. 1.5: a step with newer prompts takes at most half again a step of its decodes alone, so waves of short
# prompts beside answers about to end (tiny-c32) keep ITL p99 within about twice its median; a burst that needs more
# goes whole within the ITL tail's share (core.itl_tail). At 8 (the factor before the oldest-prompt rule) tiny-c32's
# ITL p99 was 8x its median, 953 ms served against vLLM's 264; at 2 without the tail's share the burst of short-long-c64
# went in over narrow steps and its TTFT p90 was over vLLM's in five whole served matrices of six; at 1.5 with it,
# every load's TTFT median and p90 under vLLM's or within 3 % in four (docs/benchmarks.md, "Load matrix";
# `pagoda bench schedule --factors` simulates others)
AUTO_TARGET_FACTOR = 1.5
# "auto": while prompts queue beside running decodes, a step may hold up to this many decode steps of prompts
# (_queue_seconds): the decodes keep at least a seventh of the engine's time. 6: the fewest with which the
# simulator drains mid-c48's returning wave (`pagoda bench schedule --prices zen4 --send-delay 0.05 --seed 61
# --queue-steps 4,5,6,12 --matrix-loads mid-c48,c128,chat-c32`: at 4 and 5 its TTFT median stays 1.46x and 1.22x
# prefill-first's, at 6 1.05x); at 12 chat-c32's ITL p99 is 1.8x 6's. Served, c128's ITL p99 is 5-6x its median,
# under vLLM's (docs/benchmarks.md)
MAX_QUEUE_STEPS = 6


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 speculative: SpeculativeConfig | None = None, step_costs: StepCostModel | None = None,
                 kv_connector=None, auto_target_factor: float = AUTO_TARGET_FACTOR,
                 max_queue_steps: float = MAX_QUEUE_STEPS, arrival_window: float = DEFAULT_WINDOW):
        self.config = config
        self.relative_target = relative_itl_target(config.target_itl_ms)  # "3x" -> 3.0, parsed once
        self.auto_target_factor = auto_target_factor  # --target-itl-ms auto's (bench.schedule_sim compares others)
        self.max_queue_steps = max_queue_steps  # auto's: the most decode steps of prompts a queue adds to a step
        self.kv_connector = kv_connector  # P/D (kv_transfer): supplies prompt KV, holds finished prompts' blocks
        self.step_costs = step_costs if step_costs is not None else StepCostModel()
        self.itl_tail = ItlTail()  # under "auto": the share of token gaps a burst taken whole may delay
        self.arrivals = ArrivalRate(arrival_window)  # under "auto": an open loop's pace, granted before a queue stands
        self.by_priority = config.scheduling_policy == "priority"
        self.block_manager = block_manager
        self.limits = StepLimits.of(config, block_manager.num_blocks)  # vLLM 0.32's admission knobs
        self.num_steps = 0  # schedule() calls: the cadence of prefill_schedule_interval
        self.speculative = speculative
        self.ngram = None
        if speculative is not None and speculative.method == "ngram":
            self.ngram = NgramProposer(speculative.num_speculative_tokens, speculative.prompt_lookup_min,
                                       speculative.prompt_lookup_max)
        self.spec_stats = SpecDecodeStats(speculative.num_speculative_tokens if speculative else 0)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()  # preempted, KV in the swap space; oldest preemption first
        self.in_flight: set[int] = set()  # scheduled, step not finished yet (pipeline parallelism)
        # seq id -> its steps in flight (2: async scheduling took it again, on the token its step samples)
        self.steps_in_flight: dict[int, int] = {}
        self.samples_in_flight: dict[int, int] = {}  # seq id -> tokens its latest in-flight step samples
        self.tokens_in_flight: dict[int, int] = {}  # seq id -> tokens its latest in-flight step computes
        self._finished_seq_ids: list[int] = []
        self._live: dict[int, Sequence] = {}  # every waiting or running sequence by id
        self.num_preemptions = 0
        self.num_swapped_out = 0
        self.num_swapped_in = 0
        self.num_recomputed = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def add(self, seq: Sequence) -> None:
        self._enqueue(seq)
        self._live[seq.seq_id] = seq
        self.arrivals.note(seq.arrival_time, seq.num_tokens - seq.num_computed_tokens, len(self._live))

    def _enqueue(self, seq: Sequence, front: bool = False) -> None:
        """Into the waiting queue: at its end (a preempted one at its front), or in priority order."""
        if self.by_priority:
            key = _priority_key(seq)
            index = next((i for i, q in enumerate(self.waiting) if _priority_key(q) > key), len(self.waiting))
            self.waiting.insert(index, seq)
        elif front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def prefill_budget(self) -> int | None:
        """The prompt tokens this step may compute beside the running decodes (None: no cap beyond
        max_num_batched_tokens): what the latency target leaves beyond the decodes' step; under "auto", or the
        prompts' backlog spread over the steps the decodes have left (backlog_seconds) if that is more, and never
        less than what the oldest prompt has left."""
        target = self.config.target_itl_ms
        if not target or not self.config.enable_chunked_prefill:
            return None
        decodes = [q for q in self.running if self._decodes_now(q)]
        if not decodes:  # no token is waited for: prompts take the whole budget
            return None
        context = sum(q.num_computed_tokens for q in decodes) / len(decodes)  # the KV each decode reads
        decode_step = self.step_costs.decode_step_seconds(len(decodes), context)
        if decode_step is None:  # no step measured yet
            return None
        waiting = 0  # prompt tokens still to compute: under "auto" only (its backlog rule and its bursts)
        if self.relative_target is not None:  # the user's SLO as a multiple of this machine's decode step: a bound
            seconds, oldest = self.relative_target * self._soon_step_seconds(decodes, context), 0
        elif target == AUTO_TARGET:
            waiting = self._prompt_tokens_waiting(decodes)
            seconds = max(self.auto_target_factor * self._soon_step_seconds(decodes, context),
                          decode_step + self._backlog_seconds(decodes, waiting),
                          decode_step + self._queue_seconds(decode_step, waiting),
                          (decode_step + self._arrival_seconds(decode_step)) if waiting else 0.0)
            # first come, first served: the oldest prompt is computed whole (within max_num_batched_tokens and
            # long_prefill_token_threshold), as vLLM's chunked prefill would; the target bounds the newer ones
            oldest = self._oldest_prompt_tokens(decodes)
        else:  # the user's SLO: a bound, whatever waits
            seconds, oldest = target / 1000, 0
        tokens = self.step_costs.prompt_tokens_within(seconds, num_decodes=len(decodes), context=context)
        if tokens is None:
            return None
        budget = max(tokens, oldest, self.block_manager.block_size)
        if waiting > budget and self.itl_tail.grant(len(decodes), self._tokens_to_come(),
                                                    self._burst_gaps(decodes, waiting)):
            return None  # a burst: taken whole while the gaps its whole queue delays stay within the ITL tail's share
        return budget

    def _burst_gaps(self, decodes: list[Sequence], waiting: int) -> int:
        """The token gaps a burst delays if the `waiting` prompt tokens all go in whole: each running decode's, once
        in every full step they need beside the decodes' own tokens."""
        return len(decodes) * -(-(waiting + len(decodes)) // self.limits.step_tokens)

    def _soon_step_seconds(self, decodes: list[Sequence], context: float) -> float:
        """A step of decodes alone at the number of sequences that will decode once their prompts are in (each
        reading `context` positions, as the decodes now): sized from the decodes running now, a burst's first steps
        (few decodes, many prompts) would take prompts a few tokens at a time."""
        soon = min(len(self.running) + len(self.waiting) + len(self.swapped), self.limits.active_seqs)
        return self.step_costs.decode_step_seconds(max(len(decodes), soon), context)

    def _oldest_prompt_tokens(self, decodes: list[Sequence]) -> int:
        """The prompt tokens the oldest prompt has left to compute (beyond any chunk in flight): the first running
        sequence that is not decoding, else the swapped or waiting one schedule() admits next; 0 when none."""
        decoding = {q.seq_id for q in decodes}
        for q in self.running:
            left = q.num_tokens - q.num_computed_tokens - self.tokens_in_flight.get(q.seq_id, 0)
            if q.seq_id not in decoding and left > 1:
                return left
        if self.swapped:
            nxt = self.swapped[0]
        else:  # as schedule() admits: the first whose adapter fits
            nxt = next((q for q in self.waiting if self._adapter_fits(q)), None)
        return nxt.num_tokens - nxt.num_computed_tokens if nxt is not None else 0

    def _backlog_seconds(self, decodes: list[Sequence], prompt_tokens: int) -> float:
        """The prompt seconds a step may take so that the prompts waiting now (their `prompt_tokens`) are in
        well before the running decodes end: their tokens at the measured price, spread over the decodes' mean
        steps left (each decode's max_tokens, else the model's length, less what it has) over
        AUTO_TARGET_FACTOR, the same stretch the ITL target grants a decode step: a decode accepts steps up to
        that many times its own, a prompt is due that many times sooner than the answers beside it end.
        Prompts waiting beside answers about to end take most of the step (as vLLM's chunked prefill, which
        gives prompts every token decodes leave); one prompt beside long answers takes little, and the latency
        target governs."""
        price = self.step_costs.prompt_token_seconds()
        if not price or prompt_tokens <= 0:
            return 0.0
        steps_left = sum(self._tokens_left(q) for q in decodes) / len(decodes) / self.auto_target_factor
        return prompt_tokens * price / max(steps_left, 1.0)

    def _queue_seconds(self, decode_step: float, prompt_tokens: int) -> float:
        """The prompt seconds a step may take so that a queue of prompts is computed at the pace its size calls for:
        the waiting prompts get the share f of the engine's time that their tokens are of max_num_batched_tokens (the
        whole steps a prefill-first engine such as vLLM's would give them before its decodes move again), so a step
        holds f / (1 - f) decode steps of prompts, at most max_queue_steps. A few prompts beside many decodes
        (tiny-c32's) change nothing; a closed loop's second wave, answers that ended together bringing their users'
        prompts back faster than the target admits them (c128, mid-c48), drains instead of standing."""
        return self._share_seconds(prompt_tokens / self.limits.step_tokens, decode_step)

    def _arrival_seconds(self, decode_step: float) -> float:
        """The prompt seconds a step may take so that prompts arriving faster than the engine serves them are
        admitted at their pace: the share f of the engine's time the prompt tokens that arrived over the last seconds
        need at the measured price, counted only while the requests outgrow the engine (core.arrival_rate), a step
        holding f / (1 - f) decode steps of prompts, at most max_queue_steps (as the queue's share). Without it an
        open loop's prompts get that share only once a queue deep enough to claim it stands (poisson-8rps on two
        Zen 4 cores: its TTFT p90 twice prefill-first's, docs/benchmarks.md)."""
        pace = self.arrivals.tokens_per_second()  # 0 unless the requests outgrow the engine
        price = self.step_costs.prompt_token_seconds() if pace else None
        return self._share_seconds(pace * price, decode_step) if price else 0.0

    def _share_seconds(self, share: float, decode_step: float) -> float:
        """The prompt seconds of a step that gives prompts the share `share` of the engine's time beside its decodes:
        f / (1 - f) decode steps, at most max_queue_steps (the decodes keep at least their own step in every
        1 + max_queue_steps)."""
        steps = share / (1 - share) if share < 1 else self.max_queue_steps
        return min(steps, self.max_queue_steps) * decode_step

    def _prompt_tokens_waiting(self, decodes: list[Sequence]) -> int:
        """The prompt tokens still to compute: running prompts' (beyond any chunk in flight), swapped sequences' and
        waiting ones' whose adapter may run (one waiting for a LoRA slot is no step's to compute yet)."""
        decoding = {q.seq_id for q in decodes}
        prompt_tokens = sum(q.num_tokens - q.num_computed_tokens - self.tokens_in_flight.get(q.seq_id, 0)
                            for q in self.running if q.num_tokens - q.num_computed_tokens > 1
                            and q.seq_id not in decoding)
        adapters = self._running_adapters() if self.config.max_loras is not None else None  # once, not per prompt
        waiting = (q for q in self.waiting if self._adapter_fits(q, adapters))
        return prompt_tokens + sum(q.num_tokens - q.num_computed_tokens for q in (*waiting, *self.swapped))

    def _tokens_to_come(self) -> int:
        """The tokens the present sequences may still sample (each to its max_tokens, else the model's length)."""
        return sum(self._tokens_left(q) for q in (*self.running, *self.waiting, *self.swapped))

    def _tokens_left(self, seq: Sequence) -> int:
        """The tokens seq may still sample: to its max_tokens, else to the model's length."""
        left = self.config.max_model_len - seq.num_tokens
        if seq.params.max_tokens is not None:
            left = min(left, seq.params.max_tokens - seq.num_output_tokens)
        return max(left, 1)

    def _prompt_cap(self, remaining: int) -> int:
        """The most tokens a sequence with `remaining` to compute may take this step (long_prefill_token_threshold,
        step_limits.py)."""
        return self.limits.prompt_cap(remaining, self.num_unfinished)

    def fork(self, parent: Sequence, index: int) -> Sequence:
        """Output `index` of an n > 1 request, forked from `parent` at the end of its prompt: it shares the
        parent's blocks (copy-on-write) and runs from now on."""
        child = parent.fork(index)
        self.block_manager.fork(parent, child)
        child.status = SequenceStatus.RUNNING
        self.running.append(child)
        self._live[child.seq_id] = child
        return child

    def owns(self, seq_id: int) -> bool:
        return seq_id in self._live

    def get(self, seq_id: int) -> Sequence | None:
        """A waiting or running sequence of this scheduler (None once finished)."""
        return self._live.get(seq_id)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_seq_ids=self._finished_seq_ids)
        self._finished_seq_ids = []
        if self.kv_connector is not None:  # blocks held for a decode engine: pulled, or timed out
            for held in self.kv_connector.take_freeable():
                self.block_manager.free(held)
        budget = self.limits.step_tokens
        prefill_left = self.prefill_budget()
        self.num_steps += 1
        if self.limits.off_cadence(self.num_steps - 1) and any(self._decodes_now(q) for q in self.running):
            prefill_left = 0  # prefill_schedule_interval: an off-cadence step, decodes only
        if self.by_priority:  # the most urgent first: they get the blocks, the least urgent are preempted
            self.running.sort(key=_priority_key)
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            remaining = seq.num_tokens - seq.num_computed_tokens
            if seq.seq_id in self.in_flight:
                if self.config.async_scheduling and self._can_go_ahead(seq):
                    ahead = self._schedule_ahead(seq, out)
                    budget -= ahead
                elif self.config.async_scheduling and prefill_left != 0 and self._prompt_can_go_ahead(seq):
                    # first come, first served: the oldest prompt's next chunk, not a newer prompt's first
                    ahead = self._schedule_prompt_ahead(seq, out, min(budget, prefill_left or budget))
                    budget -= ahead
                    if prefill_left is not None:
                        prefill_left -= ahead
                i += 1
                continue
            if remaining > 1 and prefill_left == 0:
                i += 1
                continue
            num_new = min(remaining, budget, self._prompt_cap(remaining))
            if remaining > 1 and prefill_left is not None:
                num_new = min(num_new, prefill_left)
                prefill_left -= num_new
            drafts, num_drafts = self._propose(seq, budget - num_new)
            copies = self.block_manager.allocate(seq, num_new + num_drafts)
            if copies is None and num_drafts:  # no room for the drafts: decode one token
                drafts, num_drafts = None, 0
                copies = self.block_manager.allocate(seq, num_new)
            while copies is None:
                victim = self._newest_preemptible()
                self._preempt(victim, out)
                preempted = True
                if victim is seq:
                    break
                copies = self.block_manager.allocate(seq, num_new)
            if copies is None:
                break
            out.blocks_to_copy += copies
            out.scheduled.append(self._schedule_seq(seq, num_new, bool(copies), drafts, num_drafts))
            budget -= num_new + num_drafts
            i += 1

        while self.swapped and budget > 0 and not preempted and len(self.running) < self.limits.active_seqs:
            seq = self.swapped[0]
            if not self._adapter_fits(seq):
                break
            remaining = seq.num_tokens - seq.num_computed_tokens
            if not self.config.enable_chunked_prefill and remaining > budget:
                break
            num_new = min(remaining, budget, self._prompt_cap(remaining))
            if remaining > 1 and prefill_left is not None:
                if prefill_left == 0:
                    break
                num_new = min(num_new, prefill_left)
            pairs = self.block_manager.swap_in(seq, num_new, keep_free=self.limits.blocks_kept_free(bool(self.running)))
            if pairs is None:
                break
            self.swapped.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.needs_reset = True  # the runner gets the new block table (and the tokens) whole
            self.running.append(seq)
            out.blocks_to_swap_in += pairs
            out.scheduled.append(self._schedule_seq(seq, num_new, False))
            self.num_swapped_in += 1
            budget -= num_new
            if remaining > 1 and prefill_left is not None:
                prefill_left -= num_new

        while (self.waiting and not self.swapped and budget > 0 and not preempted
               and len(self.running) < self.limits.active_seqs):
            index = next((j for j, q in enumerate(self.waiting) if self._adapter_fits(q)), None)
            if index is None:  # each waits for a running adapter's sequences to finish (max_loras)
                break
            seq = self.waiting[index]
            every_token = seq.kind.reads_every_prompt_token(seq.request_params)
            cached = [] if every_token else self.block_manager.find_cached_prefix(seq)
            num_computed = len(cached) * self.block_manager.block_size
            external = 0  # prompt tokens a KV connector supplies (P/D: pulled from a prefill engine)
            if self.kv_connector is not None and seq.status == SequenceStatus.WAITING:
                external, _ = self.kv_connector.get_num_new_matched_tokens(seq, num_computed)
            remaining = seq.num_tokens - num_computed - external
            if not self.config.enable_chunked_prefill and remaining > budget:
                break
            num_new = min(remaining, budget, self._prompt_cap(remaining))
            if remaining > 1 and prefill_left is not None:
                if prefill_left == 0:
                    break
                num_new = min(num_new, prefill_left)
            keep_free = self.limits.blocks_kept_free(bool(self.running), self.block_manager.block_size, seq.num_tokens,
                                                     num_computed + external + num_new)
            copies = self.block_manager.allocate(seq, external + num_new, cached, keep_free=keep_free)
            if copies is None:
                break
            if external:
                self.kv_connector.update_state_after_alloc(seq, self.block_manager.block_table(seq), external)
            num_computed += external
            del self.waiting[index]
            if seq.status == SequenceStatus.WAITING:  # first admission, not a resumed preemption
                seq.num_cached_tokens = num_computed - external
                self.prefix_cache_queries += seq.num_tokens
                self.prefix_cache_hits += num_computed - external
            seq.num_computed_tokens = num_computed
            seq.status = SequenceStatus.RUNNING
            seq.needs_reset = True
            self.running.append(seq)
            out.blocks_to_copy += copies
            out.scheduled.append(self._schedule_seq(seq, num_new, False))
            budget -= num_new
            if remaining > 1 and prefill_left is not None:
                prefill_left -= num_new
        for s in out.scheduled:
            self.in_flight.add(s.seq_id)
            self.steps_in_flight[s.seq_id] = self.steps_in_flight.get(s.seq_id, 0) + 1
            self.samples_in_flight[s.seq_id] = s.num_samples if not s.num_draft_tokens else 0
            self.tokens_in_flight[s.seq_id] = s.num_new_tokens
        if self.kv_connector is not None:
            out.kv_connector_metadata = self.kv_connector.build_connector_meta(out)
        return out

    def _decodes_now(self, seq: Sequence) -> bool:
        """Whether seq may decode in the step being scheduled: waiting for its token (not in flight, one token
        left), or, with async scheduling, in flight on a step that samples its one next token."""
        if seq.seq_id not in self.in_flight:
            return seq.num_tokens - seq.num_computed_tokens == 1
        return self.config.async_scheduling and self.steps_in_flight.get(seq.seq_id, 0) == 1 \
            and self.samples_in_flight.get(seq.seq_id) == 1

    def _can_go_ahead(self, seq: Sequence) -> bool:
        """Async scheduling: whether an in-flight sequence may be scheduled again now, on the token its step
        will sample: that step samples exactly one (a decode, or a prompt's end without forks), it is not
        already ahead, and the token after it can exist (max_tokens, max_model_len). A grammar's next mask
        depends on that token: structured outputs wait for it."""
        if (self.steps_in_flight.get(seq.seq_id, 0) != 1 or self.samples_in_flight.get(seq.seq_id) != 1
                or not seq.kind.samples):
            return False
        if seq.params.structured_outputs is not None:
            return False
        max_tokens = seq.params.max_tokens or self.config.max_model_len
        return seq.num_output_tokens + 1 < max_tokens and seq.num_tokens + 1 < self.config.max_model_len

    def _prompt_can_go_ahead(self, seq: Sequence) -> bool:
        """Async scheduling: whether an in-flight prompt may be scheduled its next chunk now: its one step in
        flight computes a chunk that does not end the prompt (no sample), and prompt tokens are left after it."""
        return (self.steps_in_flight.get(seq.seq_id, 0) == 1 and self.samples_in_flight.get(seq.seq_id) == 0
                and seq.num_computed_tokens + self.tokens_in_flight.get(seq.seq_id, 0) < seq.num_tokens)

    def _schedule_prompt_ahead(self, seq: Sequence, out: SchedulerOutput, limit: int) -> int:
        """Schedule an in-flight prompt's next chunk (at most `limit` tokens), from where its in-flight chunk
        ends: the runner has every prompt token and computes the steps in order, as vLLM's async scheduling.
        Never preempts: with no free block it waits for the step. Returns the tokens scheduled."""
        in_flight = self.tokens_in_flight[seq.seq_id]
        left = seq.num_tokens - seq.num_computed_tokens - in_flight
        num_new = min(left, limit, self._prompt_cap(left))
        if num_new <= 0:
            return 0
        copies = self.block_manager.allocate(seq, in_flight + num_new)
        if copies is None:
            return 0
        out.blocks_to_copy += copies
        seq.num_computed_tokens += in_flight  # the chunk's first position; step_done counts both chunks
        try:
            out.scheduled.append(self._schedule_seq(seq, num_new, bool(copies)))
        finally:
            seq.num_computed_tokens -= in_flight
        return num_new

    def _schedule_ahead(self, seq: Sequence, out: SchedulerOutput) -> int:
        """Schedule seq's next decode before its in-flight step ends: one token at position num_tokens, whose
        id the runner takes from its own last sample (a placeholder here). Never preempts: with no free block
        it waits for the step. Returns the tokens scheduled (0 or 1)."""
        copies = self.block_manager.allocate(seq, seq.num_tokens + 1 - seq.num_computed_tokens)
        if copies is None:
            return 0
        out.blocks_to_copy += copies
        table = self.block_manager.block_table(seq)
        block_start = seq.num_blocks_sent
        out.scheduled.append(ScheduledSeq(
            seq_id=seq.seq_id, num_new_tokens=1, num_computed_tokens=seq.num_tokens,
            new_token_ids=[], block_ids_start=block_start, block_ids=table[block_start:], num_samples=1,
            num_prompt_tokens=seq.num_prompt_tokens, placeholder=True,
            group_block_ids=self.block_manager.group_block_ids(seq, block_start)))
        seq.num_tokens_sent = seq.num_tokens + 1  # the runner appends the token itself
        seq.num_blocks_sent = len(table)
        return 1

    def _adapter_fits(self, seq: Sequence, running: set[int] | None = None) -> bool:
        """LoRA: running sequences use at most max_loras distinct adapters (the runner's device slots). `running`:
        their adapter ids (_running_adapters()), when a caller asks for many sequences at once."""
        if seq.lora_request is None or self.config.max_loras is None:
            return True
        if running is None:
            running = self._running_adapters()
        return seq.lora_request.lora_int_id in running or len(running) < self.config.max_loras

    def _running_adapters(self) -> set[int]:
        return {q.lora_request.lora_int_id for q in self.running if q.lora_request is not None}

    def _propose(self, seq: Sequence, budget: int) -> tuple[list[int] | None, int]:
        """A decoding sequence's drafts: (their ids or None when the runner's draft model proposes them, how
        many). Never past max_tokens, max_model_len or the step's token budget."""
        if (self.speculative is None or seq.num_tokens - seq.num_computed_tokens != 1 or seq.pending_forks
                or not can_speculate(seq.params, seq.num_output_tokens)):
            return None, 0
        max_tokens = seq.params.max_tokens or self.config.max_model_len
        # the step samples one token beyond the drafts: k drafts give up to k + 1 tokens
        room = min(max_tokens - seq.num_output_tokens, self.config.max_model_len - seq.num_tokens) - 1
        limit = min(self.speculative.num_speculative_tokens, room, budget)
        if limit < 1:
            return None, 0
        if self.ngram is None:
            return None, limit
        drafts = self.ngram.propose(seq.token_ids, limit)
        return (drafts, len(drafts)) if drafts else (None, 0)

    def _newest_preemptible(self) -> Sequence:
        """The last of the running (the newest admitted; with the priority policy, the least urgent)."""
        for seq in reversed(self.running):
            if seq.seq_id not in self.in_flight:
                return seq
        raise RuntimeError("no sequence can be preempted")  # unreachable: the caller is not in flight

    def _schedule_seq(self, seq: Sequence, num_new: int, copied: bool, draft_token_ids: list[int] | None = None,
                      num_drafts: int = 0) -> ScheduledSeq:
        table = self.block_manager.block_table(seq)
        reset = seq.needs_reset
        if reset:
            seq.num_tokens_sent = seq.num_blocks_sent = 0
        block_start = seq.num_blocks_sent
        if copied:  # the block being written was replaced by a private copy
            block_start = min(block_start, seq.num_computed_tokens // self.block_manager.block_size)
        ends_prompt = seq.num_computed_tokens + num_new == seq.num_tokens
        scheduled = ScheduledSeq(
            seq_id=seq.seq_id,
            num_new_tokens=num_new + num_drafts,
            num_computed_tokens=seq.num_computed_tokens,
            new_token_ids=seq.token_ids[seq.num_tokens_sent :],
            block_ids_start=block_start,
            block_ids=table[block_start:],
            group_block_ids=self.block_manager.group_block_ids(seq, block_start),
            num_samples=(1 + seq.pending_forks) if ends_prompt else 0,
            reset=reset,
            num_prompt_tokens=seq.num_prompt_tokens,
            params=seq.params if reset else None,
            request_params=seq.request_params if reset else None,
            lora_request=seq.lora_request if reset else None,
            num_draft_tokens=num_drafts,
            draft_token_ids=draft_token_ids,
        )
        seq.num_tokens_sent = seq.num_tokens
        seq.num_blocks_sent = len(table)
        seq.needs_reset = False
        return scheduled

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        seq.status = SequenceStatus.PREEMPTED
        seq.needs_reset = True
        self.num_preemptions += 1
        if self.config.preemption_mode == "swap" and self.block_manager.can_swap_out(seq):
            out.blocks_to_swap_out += self.block_manager.swap_out(seq)
            self.swapped.append(seq)
            self.num_swapped_out += 1
            return
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        self._enqueue(seq, front=True)
        self.num_recomputed += 1

    def step_done(self, out: SchedulerOutput, result: ModelRunnerOutput | None = None) -> None:
        """The runner finished out: the scheduled tokens' KV is now in the cache (of drafts, the accepted
        ones' only: the slots past them are released)."""
        if self.kv_connector is not None and result is not None:
            self.kv_connector.update_connector_output(result.kv_connector_output)
        self.itl_tail.step_done(out.num_decodes)
        for s in out.scheduled:
            left = self.steps_in_flight.pop(s.seq_id, 1) - 1
            if left:  # its next step, scheduled ahead, is still running
                self.steps_in_flight[s.seq_id] = left
            else:
                self.in_flight.discard(s.seq_id)
                self.samples_in_flight.pop(s.seq_id, None)
                self.tokens_in_flight.pop(s.seq_id, None)
        for s in out.scheduled:
            seq = self._live.get(s.seq_id)
            if seq is None or seq.status != SequenceStatus.RUNNING:
                continue
            if not s.num_draft_tokens:
                seq.num_computed_tokens += s.num_new_tokens
                continue
            verified = result.verified.get(s.seq_id) if result is not None else None
            num_accepted = len(verified) - 1 if verified else 0
            self.spec_stats.record(s.num_draft_tokens, num_accepted)
            seq.num_computed_tokens += s.num_new_tokens - s.num_draft_tokens + num_accepted
            # room for the tokens this step gives (accepted drafts and one more); the rest held rejected drafts
            self.block_manager.release_slots_after(seq, seq.num_computed_tokens + 1)
            # the runner learns blocks past those it was sent: from the cut, the next blocks are others
            seq.num_blocks_sent = min(seq.num_blocks_sent, len(self.block_manager.block_table(seq)))

    def finish(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        """Remove a sequence (finished or aborted) and free its blocks at once."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        held = False  # P/D: a prefill's blocks stay until a decode engine pulls them (kv_transfer)
        if self.kv_connector is not None:
            held, seq.kv_transfer_params = self.kv_connector.request_finished(seq, self.block_manager.block_table(seq))
        if not held:
            self.block_manager.free(seq)
        self._live.pop(seq.seq_id, None)
        if not self._live:
            self.itl_tail.idle()
            self.arrivals.idle()
        self._finished_seq_ids.append(seq.seq_id)
        self.in_flight.discard(seq.seq_id)
        self.steps_in_flight.pop(seq.seq_id, None)
        self.samples_in_flight.pop(seq.seq_id, None)
        self.tokens_in_flight.pop(seq.seq_id, None)


def _priority_key(seq: Sequence) -> tuple[int, float, int]:
    return seq.priority, seq.arrival_time, seq.seq_id
