"""The synchronous engine: requests in, outputs out. Three owners, as vLLM V1's: the input processor
(prompt → validated token ids), the engine core (schedule → execute → update: blocks, sequences, forks)
and the output processor (text, logprobs, stops → RequestOutput). One step:

    core.step(observer)                 # one batch through the model; the core's one after-step update
                                        # appends every token and tells the observer of each change:
    observer.on_fork / on_failed / ...  # the request table follows the core's sequences
    observer.on_token                   # text, logprobs, stop decision (output processor); a stopped
                                        # sequence is finished at once (core.finish frees its blocks)
"""

import functools
import logging
import time
from functools import cached_property

from pagoda.config import EngineArgs, EngineConfig, create_engine_config
from pagoda.core.kv_cache_groups import kv_cache_groups_for, log_max_concurrency
from pagoda.core.kv_window import blocks_per_sequence
from pagoda.core.request_kind import RequestParams
from pagoda.core.sequence import Sequence, SequenceStatus
from pagoda.engine.data_parallel import create_core
from pagoda.engine.engine_core import StepObserver, droppable_kv_window
from pagoda.engine.input_processor import InputProcessor, check_priority
from pagoda.engine.output_processor import OutputProcessor
from pagoda.engine.outputs import EngineStats, RequestMetrics, RequestOutput
from pagoda.engine.request_state import RequestState, RequestTable
from pagoda.engine.stats_logger import StatsLogger
from pagoda.errors import InvalidParam
from pagoda.executor.factory import create_executor
from pagoda.lora.registry import LoRARegistry
from pagoda.lora.request import LoRARequest
from pagoda.models.family import layer_windows
from pagoda.sampling_params import SamplingParams
from pagoda.spec_decode.stats import SpecDecodeStats
from pagoda.worker.loader.generation_config import eos_token_ids_for

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        from transformers import AutoTokenizer

        self.config = config
        started = time.time()
        self.tokenizer = AutoTokenizer.from_pretrained(config.model.tokenizer_path,
                                                       trust_remote_code=config.model.trust_remote_code)
        self.eos_token_ids = eos_token_ids_for(config, self.tokenizer)
        model = config.model
        grammar_key = (model.tokenizer_path, model.hf_config.vocab_size, tuple(sorted(self.eos_token_ids)))
        self.input_processor = InputProcessor(self.tokenizer, model.hf_config.vocab_size, model.max_model_len,
                                              config.scheduler.max_num_seqs, grammar_key)
        self.loras = LoRARegistry(config.lora, model.hf_config)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids, model.max_model_len)
        self.executor = create_executor(config, self.eos_token_ids)
        num_blocks = self.executor.determine_num_blocks()
        block_size = config.cache.block_size
        needed = blocks_per_sequence(model.max_model_len, block_size, droppable_kv_window(config),
                                     config.scheduler.max_num_batched_tokens)
        groups = kv_cache_groups_for(config, layer_windows(model.hf_config), log=True)
        if groups is not None:  # each group's blocks count: its window's, or the whole context's
            needed = groups.blocks_per_sequence(model.max_model_len, block_size, config.scheduler.max_num_batched_tokens)
        if num_blocks < needed:
            self.executor.shutdown()
            raise InvalidParam(
                "kv_cache_memory",
                f"the KV cache holds {num_blocks} blocks ({num_blocks * block_size} tokens), fewer than the "
                f"{needed} one sequence of max_model_len={model.max_model_len} needs: raise kv_cache_memory / "
                "gpu_memory_utilization or lower max_model_len")
        self.executor.allocate_kv_cache(num_blocks)
        self.num_blocks = num_blocks
        self.core = create_core(config, self.executor, num_blocks)
        self.requests = RequestTable()
        dp = config.parallel.data_parallel_size  # every DP rank holds its own cache of num_blocks
        self.stats = EngineStats(num_blocks_total=num_blocks * dp,
                                 num_swap_blocks_total=config.cache.num_swap_blocks * dp,
                                 data_parallel_rank=config.parallel.data_parallel_rank)
        self.finished_by_rank: dict[int, dict[str, int]] = {}  # data parallelism: finished requests per rank
        self.stats_logger = StatsLogger(config.stats_log_interval) if config.log_stats else None
        hf = model.hf_config
        logger.info("loaded %s (%s, %d layers) dtype=%s dp=%d tp=%d pp=%d device=%s attention=%s in %.1fs",
                    model.served_model_name, hf.architectures[0], hf.num_hidden_layers, model.dtype, dp,
                    config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size, config.device,
                    config.attention_backend, time.time() - started)
        if model.dtype_reason:
            logger.info("%s", model.dtype_reason)
        logger.info("KV cache: %d blocks of %d tokens = %d tokens; max_model_len=%d, max_num_seqs=%d, "
                    "max_num_batched_tokens=%d", num_blocks, block_size, num_blocks * block_size,
                    model.max_model_len, config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens)
        self.max_concurrency = log_max_concurrency(model.max_model_len, num_blocks, needed)
        if self.core.block_manager.sliding_window is not None:
            logger.info("every layer slides (window %d): a sequence's blocks behind its window are freed as it "
                        "decodes; one sequence needs at most %d blocks", self.core.block_manager.sliding_window,
                        needed)
        logger.info("preemption mode %s; swap space %d blocks (%.2f GiB per worker)", config.cache.preemption_mode,
                    config.cache.num_swap_blocks, config.cache.swap_space_gib)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(create_engine_config(args))

    @property
    def block_manager(self):
        return self.core.block_manager

    @property
    def schedulers(self):
        return self.core.schedulers

    # --- requests ---------------------------------------------------------------------------------

    def process_prompt(self, prompt, params: RequestParams) -> tuple[str | None, list[int]]:
        """Tokenize and validate a prompt (str, token ids, or {"prompt_token_ids": [...]}); raises
        InvalidParam (a ValueError) naming the field."""
        processed = self.input_processor.process(prompt, params)
        return processed.text, processed.token_ids

    def add_request(self, request_id: str, prompt, params: RequestParams | None = None,
                    arrival_time: float | None = None, prompt_token_ids: list[int] | None = None,
                    lora_request: LoRARequest | None = None, priority: int = 0) -> None:
        """A request of any kind (core.request_kind), named by its params: a generation (SamplingParams), or
        an embedding (PoolingParams), whose prompt runs through the model like any prefill and whose output's
        `embedding` is the pooled final hidden state. lora_request: the adapter it runs with (enable_lora). priority:
        with scheduling_policy "priority", lower runs first (vLLM's)."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise InvalidParam("request_id", f"request_id {request_id!r} is already running")
        self.check_priority(priority)
        lora_request = self.loras.resolve(lora_request)
        if prompt_token_ids is None:
            prompt, prompt_token_ids = self.process_prompt(prompt, params)
        else:
            self.input_processor.check_request(prompt_token_ids, params)
        arrival = arrival_time or time.time()
        seq = Sequence(request_id, prompt_token_ids, params, 0, arrival)
        state = RequestState(request_id, prompt, prompt_token_ids, seq.params, RequestMetrics(arrival), seq.kind)
        seq.lora_request = lora_request
        seq.priority = priority
        if lora_request is not None:
            counts = self.stats.lora_requests
            counts[lora_request.lora_name] = counts.get(lora_request.lora_name, 0) + 1
        state.add_seq(seq)
        self.requests.add(state)
        state.metrics.data_parallel_rank = self.core.add(seq)

    def check_priority(self, priority: int) -> None:
        check_priority(priority, self.config.scheduler.scheduling_policy)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        state = self.requests.remove(request_id)
        if state is None:
            return None
        state.aborted = True
        for seq in state.seqs:
            if not seq.is_finished:
                self.core.finish(seq, "abort")
                self._count_finish("abort", state)
        return state.to_output()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or self.core.has_unfinished()

    # --- the loop ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        observer = _EngineStepObserver(self)
        core_step = self.core.step(self._mark_scheduled, observer)
        if core_step is not None:
            self.stats.prompt_tokens += core_step.prompt_tokens
            if core_step.expert_tokens:
                self.stats.add_expert_tokens(core_step.expert_tokens)
        self.log_stats_if_due()
        if core_step is None:
            return []
        outputs = []
        for state in observer.changed.values():
            outputs.append(self._make_output(state))
            if state.finished:
                self.requests.remove(state.request_id)
        return outputs

    def _make_output(self, state: RequestState):
        """What a step hands back for a request whose output moved (the core process: a token delta)."""
        return state.to_output()

    def release_held_kv(self) -> bool:
        """P/D: an idle engine frees the blocks decode engines have pulled (EngineCore.release_held_kv);
        whether any were freed."""
        release = getattr(self.core, "release_held_kv", None)  # (the data-parallel core has no connector)
        return release is not None and release() > 0

    def log_stats_if_due(self) -> None:
        """The periodic stats line: each step calls it, and an idle engine loop too, so that the last
        requests' interval is logged even when they finished between two lines."""
        if self.stats_logger is not None and self.stats_logger.due():
            stats = self.get_stats()
            if not self.stats_logger.nothing_new(stats):
                self.stats_logger.log(stats)

    def _mark_scheduled(self, sched_out) -> None:
        now = time.time()
        if sched_out.scheduled:
            self.stats.observe_iteration(sched_out.num_batched_tokens)
        for s in sched_out.scheduled:
            state = self.requests.of_seq(s.seq_id)
            if state is not None and state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = now

    def _fail_request(self, state: RequestState, message: str) -> None:
        """Finish one request with an error; its sequences free their blocks, the engine goes on."""
        logger.error("request %s failed: %s", state.request_id, message)
        state.error = message
        for seq in state.seqs:
            if not seq.is_finished:
                self.core.finish(seq, "error")
        self._count_finish("error", state)

    def _count_finish(self, reason: str, state: RequestState) -> None:
        self.stats.finished_reasons[reason] = self.stats.finished_reasons.get(reason, 0) + 1
        by_reason = self.finished_by_rank.setdefault(state.metrics.data_parallel_rank, {})
        by_reason[reason] = by_reason.get(reason, 0) + 1

    def get_stats(self) -> EngineStats:
        s = self.stats
        swapped_ids = {q.seq_id for sc in self.schedulers for q in sc.swapped}
        s.num_requests_running = sum(1 for r in self.requests.values()
                                     if any(q.status == SequenceStatus.RUNNING for q in r.seqs))
        s.num_requests_swapped = sum(1 for r in self.requests.values()
                                     if not any(q.status == SequenceStatus.RUNNING for q in r.seqs)
                                     and any(q.seq_id in swapped_ids for q in r.seqs))
        s.num_requests_waiting = len(self.requests) - s.num_requests_running - s.num_requests_swapped
        s.num_blocks_used = self.block_manager.num_used_blocks
        s.num_cached_blocks = len(self.block_manager.cached_blocks)
        s.kv_cache_usage = self.block_manager.usage()
        s.prefix_cache_queries = sum(sc.prefix_cache_queries for sc in self.schedulers)
        s.prefix_cache_hits = sum(sc.prefix_cache_hits for sc in self.schedulers)
        s.prefix_cache_evicted_blocks = self.block_manager.num_evicted_blocks
        s.num_preemptions = sum(sc.num_preemptions for sc in self.schedulers)
        s.num_swapped_out = sum(sc.num_swapped_out for sc in self.schedulers)
        s.num_swapped_in = sum(sc.num_swapped_in for sc in self.schedulers)
        s.num_recomputed = sum(sc.num_recomputed for sc in self.schedulers)
        s.num_swap_blocks_used = self.block_manager.num_used_swap_blocks
        s.swap_space_usage = self.block_manager.swap_usage()
        spec = functools.reduce(SpecDecodeStats.merged, (sc.spec_stats for sc in self.schedulers))
        s.spec_decode_num_drafts = spec.num_drafts
        s.spec_decode_num_draft_tokens = spec.num_draft_tokens
        s.spec_decode_num_accepted_tokens = spec.num_accepted_tokens
        s.spec_decode_accepted_per_pos = list(spec.accepted_per_pos)
        s.max_lora = self.config.lora.max_loras if self.config.lora is not None else 0
        running, waiting = set(), set()
        for state in self.requests.values():
            lora = next((q.lora_request for q in state.seqs if q.lora_request is not None), None)
            if lora is not None:
                is_running = any(q.status == SequenceStatus.RUNNING for q in state.seqs)
                (running if is_running else waiting).add(lora.lora_name)
        s.running_lora_adapters, s.waiting_lora_adapters = sorted(running), sorted(waiting)
        timer = self.core.timer
        s.num_steps, s.step_forward_seconds = timer.num_steps, timer.forward_seconds
        s.num_step_gaps, s.step_gap_seconds = timer.num_gaps, timer.gap_seconds
        connector = getattr(self.core, "kv_connector", None)
        s.kv_transfer = connector.get_stats() if connector is not None else None  # P/D transfers (a copy)
        if hasattr(self.core, "rank_stats"):  # data parallelism: each rank's share too
            s.data_parallel = self.core.rank_stats()
            for rank, share in enumerate(s.data_parallel):
                share.finished_reasons = dict(self.finished_by_rank.get(rank, {}))
        return EngineStats(**{**vars(s), "finished_reasons": dict(s.finished_reasons),
                              "iteration_tokens_counts": list(s.iteration_tokens_counts),
                              "expert_tokens": {layer: list(c) for layer, c in s.expert_tokens.items()},
                              "running_lora_adapters": list(s.running_lora_adapters),
                              "waiting_lora_adapters": list(s.waiting_lora_adapters),
                              "lora_requests": dict(s.lora_requests), "data_parallel": list(s.data_parallel)})

    def shutdown(self) -> None:
        """Release the executor's workers and process group. Idempotent."""
        core = getattr(self, "core", None)
        if core is not None:
            core.shutdown()
        executor, self.executor = getattr(self, "executor", None), None
        if executor is not None:
            executor.shutdown()


class _EngineStepObserver(StepObserver):
    """The engine's side of one after-step update: the request table, outputs and metrics follow the core's
    changes; `changed` collects the requests whose output moved."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.requests = engine.requests
        self.changed: dict[str, RequestState] = {}

    @cached_property
    def now(self) -> float:  # first asked once the batch has run
        return time.time()

    def _live(self, seq_id: int) -> RequestState | None:
        state = self.requests.of_seq(seq_id)
        return None if state is None or state.finished else state

    def on_fork(self, parent: Sequence, child: Sequence) -> None:
        self.requests.add_seq(self.requests.of_seq(parent.seq_id), child, copy_from=parent)

    def on_failed(self, seq_id: int, message: str) -> None:
        state = self._live(seq_id)
        if state is not None:
            self.engine._fail_request(state, message)
            self.changed[state.request_id] = state

    def on_prompt_logprobs(self, seq_id: int, start: int, scored: list) -> None:
        state = self._live(seq_id)
        if state is not None:
            self.engine.output_processor.process_prompt_logprobs(state, start, scored)

    def on_result(self, seq: Sequence, result) -> None:
        """A request of a kind that does not sample (an embedding): done once its prompt has run."""
        state = self._live(seq.seq_id)
        if state is None:
            return
        state.result = result
        self.engine.core.finish(seq, "stop")
        self.engine._count_finish("stop", state)
        state.metrics.first_token_time = state.metrics.last_token_time = self.now
        self.changed[state.request_id] = state

    def on_token(self, seq: Sequence, token) -> None:
        """`token` was appended to `seq`: its text and stop check; a stopped sequence is finished at once."""
        state = self._live(seq.seq_id)
        if state is None:
            return
        engine = self.engine
        engine.stats.generation_tokens += 1
        try:
            stop = engine.output_processor.process_token(state, seq, token)
        except Exception as e:  # noqa: BLE001 - one request's failure must not take the engine down
            engine._fail_request(state, f"processing its output failed: {e!r}")
        else:
            if stop is not None:
                engine.core.finish(seq, stop.reason, stop.stop_reason)
                engine._count_finish(stop.reason, state)
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = self.now
            state.metrics.last_token_time = self.now
        self.changed[state.request_id] = state
