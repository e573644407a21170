"""The synchronous engine: requests in, one scheduler step + one model step per `step()`, outputs out.

With pipeline parallelism the engine keeps one scheduler per batch in flight ("virtual engines",
sharing one block manager): each owns its requests, so while one batch moves through the later
stages the next is scheduled and started.
"""

import dataclasses
import logging
import time
from collections import deque

from pagoda.block_manager import BlockManager
from pagoda.config import EngineArgs, EngineConfig
from pagoda.detokenizer import detokenize_incrementally, flush
from pagoda.engine.input_processor import InputProcessor
from pagoda.engine.request_state import RequestState
from pagoda.errors import InvalidParam
from pagoda.outputs import EngineStats, Logprob, RequestMetrics, RequestOutput
from pagoda.runner_output import ModelRunnerOutput, SampledToken
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler import Scheduler
from pagoda.sequence import Sequence

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        from transformers import AutoTokenizer

        from pagoda.distributed.executor import create_executor

        self.config = config
        started = time.time()
        self.tokenizer = AutoTokenizer.from_pretrained(config.model.tokenizer_path)
        self.eos_token_ids = eos_token_ids_for(config, self.tokenizer)
        self.input_processor = InputProcessor(self.tokenizer, config.model.hf_config.vocab_size,
                                              config.model.max_model_len, config.scheduler.max_num_seqs)
        self.executor = create_executor(config, self.eos_token_ids)
        num_blocks = self.executor.determine_num_blocks()
        block_size = config.cache.block_size
        needed = -(-config.model.max_model_len // block_size)
        if num_blocks < needed:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks ({num_blocks * block_size} tokens), fewer than one "
                f"sequence of max_model_len={config.model.max_model_len} needs: raise kv_cache_memory / "
                "gpu_memory_utilization or lower max_model_len")
        self.executor.allocate_kv_cache(num_blocks)
        config.cache.num_blocks = num_blocks
        self.block_manager = BlockManager(num_blocks, block_size, config.cache.enable_prefix_caching)
        depth = self.executor.pipeline_depth
        per_batch = dataclasses.replace(config.scheduler, max_num_seqs=-(-config.scheduler.max_num_seqs // depth))
        self.schedulers = [Scheduler(per_batch, self.block_manager) for _ in range(depth)]
        self.scheduler_of: dict[int, Scheduler] = {}  # seq id -> the scheduler that owns it
        self.in_flight: deque = deque()  # (scheduler, its output, executor handle), oldest first
        self.schedule_seconds = 0.0  # time spent scheduling (for the benchmarks' overhead figures)
        self.requests: dict[str, RequestState] = {}
        self.seq_to_request: dict[int, RequestState] = {}
        self.stats = EngineStats(num_blocks_total=num_blocks)
        hf = config.model.hf_config
        logger.info("loaded %s (%s, %d layers) dtype=%s tp=%d pp=%d device=%s attention=%s in %.1fs",
                    config.model.served_model_name, hf.architectures[0], hf.num_hidden_layers, config.model.dtype,
                    config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size, config.device,
                    config.attention_backend, time.time() - started)
        logger.info("KV cache: %d blocks of %d tokens = %d tokens; max_model_len=%d, max_num_seqs=%d, "
                    "max_num_batched_tokens=%d", num_blocks, block_size, num_blocks * block_size,
                    config.model.max_model_len, config.scheduler.max_num_seqs,
                    config.scheduler.max_num_batched_tokens)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args.create_config())

    # --- requests ---------------------------------------------------------------------------------

    def process_prompt(self, prompt, params: SamplingParams) -> tuple[str | None, list[int]]:
        """Tokenize and validate a prompt (str, token ids, or {"prompt_token_ids": [...]}); raises
        InvalidParam (a ValueError) naming the field."""
        processed = self.input_processor.process(prompt, params)
        return processed.text, processed.token_ids

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, prompt_token_ids: list[int] | None = None) -> None:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise InvalidParam("request_id", f"request_id {request_id!r} is already running")
        if prompt_token_ids is None:
            prompt, prompt_token_ids = self.process_prompt(prompt, params)
        else:
            self.input_processor.check_token_ids(prompt_token_ids)
            self.input_processor.check_params(params)
            self.input_processor.check_length(len(prompt_token_ids), params)
        arrival = arrival_time or time.time()
        state = RequestState(request_id, prompt, prompt_token_ids, params, RequestMetrics(arrival))
        seq = Sequence(request_id, prompt_token_ids, params, 0, arrival)
        state.add_seq(seq)
        self.requests[request_id] = state
        self.stats.prompt_tokens += len(prompt_token_ids)
        self.seq_to_request[seq.seq_id] = state
        scheduler = min(self.schedulers, key=lambda sc: sc.num_unfinished)
        self.scheduler_of[seq.seq_id] = scheduler
        scheduler.add(seq)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        state.aborted = True
        for seq in state.seqs:
            if not seq.is_finished:
                self.scheduler_of[seq.seq_id].finish(seq, "abort")
                self._count_finish("abort")
            self.seq_to_request.pop(seq.seq_id, None)
            self.scheduler_of.pop(seq.seq_id, None)
        return state.to_output()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self.in_flight)

    # --- the loop ---------------------------------------------------------------------------------

    @property
    def scheduler(self) -> Scheduler:
        return self.schedulers[0]

    def step(self) -> list[RequestOutput]:
        """Start batches until the pipeline is full, then finish the oldest one."""
        busy = {id(entry[0]) for entry in self.in_flight}
        for scheduler in self.schedulers:
            if id(scheduler) in busy:
                continue
            started = time.perf_counter()
            sched_out = scheduler.schedule()
            self.schedule_seconds += time.perf_counter() - started
            if sched_out.is_empty and not sched_out.finished_seq_ids:
                continue
            now = time.time()
            for s in sched_out.scheduled:
                state = self.seq_to_request.get(s.seq_id)
                if state is not None and state.metrics.first_scheduled_time is None:
                    state.metrics.first_scheduled_time = now
            self.in_flight.append((scheduler, sched_out, self.executor.submit(sched_out)))
        if not self.in_flight:
            return []
        scheduler, sched_out, handle = self.in_flight.popleft()
        result = self.executor.wait(handle)
        scheduler.step_done(sched_out)
        return self._process_result(result)

    def _process_result(self, result: ModelRunnerOutput) -> list[RequestOutput]:
        now = time.time()
        changed: dict[str, RequestState] = {}
        for seq_id, message in result.failed.items():
            state = self.seq_to_request.get(seq_id)
            if state is not None:
                self._fail_request(state, message)
                changed[state.request_id] = state
        for seq_id, tokens in result.sampled.items():
            state = self.seq_to_request.get(seq_id)
            if state is None or state.finished:  # aborted (or failed) while its step ran
                continue
            try:
                self._process_tokens(state, seq_id, tokens, now)
            except Exception as e:  # noqa: BLE001 - one request's failure must not take the engine down
                self._fail_request(state, f"processing its output failed: {e!r}")
            changed[state.request_id] = state
        outputs = []
        for state in changed.values():
            outputs.append(state.to_output())
            if state.finished:
                self.requests.pop(state.request_id, None)
                for seq in state.seqs:
                    self.seq_to_request.pop(seq.seq_id, None)
        return outputs

    def _fail_request(self, state: RequestState, message: str) -> None:
        """Finish one request with an error; its sequences free their blocks, the engine goes on."""
        logger.error("request %s failed: %s", state.request_id, message)
        state.error = message
        for seq in state.seqs:
            scheduler = self.scheduler_of.pop(seq.seq_id, None)
            if not seq.is_finished and scheduler is not None:
                scheduler.finish(seq, "error")
        self._count_finish("error")

    def _process_tokens(self, state: RequestState, seq_id: int, tokens: list[SampledToken], now: float) -> None:
        seq = next(s for s in state.seqs if s.seq_id == seq_id)
        targets = [seq]
        if len(tokens) > 1:  # end of prompt for n > 1: fork the other outputs
            seq.pending_forks = 0
            for i in range(1, len(tokens)):
                child = seq.fork(i)
                self.block_manager.fork(seq, child)
                state.add_seq(child, copy_from=seq)
                self.seq_to_request[child.seq_id] = state
                self.scheduler_of[child.seq_id] = self.scheduler_of[seq.seq_id]
                self.scheduler_of[seq.seq_id].add_running(child)
                targets.append(child)
        for target, token in zip(targets, tokens):
            self._append_token(state, target, token)
        if state.metrics.first_token_time is None:
            state.metrics.first_token_time = now
        state.metrics.last_token_time = now

    def _append_token(self, state: RequestState, seq: Sequence, token: SampledToken) -> None:
        seq.append_token(token.token_id)
        self.stats.generation_tokens += 1
        out = state.outputs[seq.seq_id]
        params = seq.params
        if out.logprobs is not None:
            entry = {token.token_id: Logprob(token.logprob, token.rank, self.tokenizer.decode([token.token_id]))}
            for rank, (tid, lp) in enumerate(zip(token.top_token_ids or [], token.top_logprobs or []), start=1):
                if tid not in entry:
                    entry[tid] = Logprob(lp, rank, self.tokenizer.decode([tid]))
            out.logprobs.append(entry)
            out.cumulative_logprob += token.logprob
        new_text = detokenize_incrementally(self.tokenizer, seq.token_ids, out.detok, params.skip_special_tokens)
        reason, stop_reason = self._check_stop(seq, out, new_text)
        if reason is not None:
            if not isinstance(stop_reason, str):  # a stop string already cut the text
                flush(self.tokenizer, seq.token_ids, out.detok, params.skip_special_tokens)
            self.scheduler_of.pop(seq.seq_id).finish(seq, reason, stop_reason)
            self._count_finish(reason)

    def _check_stop(self, seq: Sequence, out, new_text: str):
        params, token = seq.params, seq.token_ids[-1]
        num_output = seq.num_output_tokens
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return "stop", None
            if token in params.stop_token_ids:
                return "stop", token
            if new_text and params.stop_strings:
                text = out.detok.text
                for stop in params.stop_strings:
                    start = max(len(text) - len(new_text) - len(stop) + 1, 0)
                    at = text.find(stop, start)
                    if at != -1:
                        out.detok.text = text[: at + len(stop)] if params.include_stop_str_in_output else text[:at]
                        return "stop", stop
        max_tokens = params.max_tokens or self.config.model.max_model_len
        if num_output >= max_tokens or seq.num_tokens >= self.config.model.max_model_len:
            return "length", None
        return None, None

    def _count_finish(self, reason: str) -> None:
        self.stats.finished_reasons[reason] = self.stats.finished_reasons.get(reason, 0) + 1

    def get_stats(self) -> EngineStats:
        s = self.stats
        s.num_requests_running = sum(1 for r in self.requests.values() if any(
            q.status.name == "RUNNING" for q in r.seqs))
        s.num_requests_waiting = len(self.requests) - s.num_requests_running
        s.num_blocks_used = self.block_manager.num_used_blocks
        s.kv_cache_usage = self.block_manager.usage()
        s.prefix_cache_queries = sum(sc.prefix_cache_queries for sc in self.schedulers)
        s.prefix_cache_hits = sum(sc.prefix_cache_hits for sc in self.schedulers)
        s.num_preemptions = sum(sc.num_preemptions for sc in self.schedulers)
        return EngineStats(**{**vars(s), "finished_reasons": dict(s.finished_reasons)})

    def shutdown(self) -> None:
        """Release the executor's workers and process group. Idempotent."""
        executor, self.executor = getattr(self, "executor", None), None
        if executor is not None:
            executor.shutdown()


def eos_token_ids_for(config: EngineConfig, tokenizer=None) -> set[int]:
    """Token ids that end a sequence: generation_config.json's eos ids plus the tokenizer's."""
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(config.model.tokenizer_path)
    path, hf_config = config.model.path, config.model.hf_config
    ids: set[int] = set()
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except (OSError, ValueError):
        eos = getattr(hf_config, "eos_token_id", None)
    for value in eos if isinstance(eos, list) else [eos]:
        if value is not None:
            ids.add(int(value))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
