"""`AsyncMPEngine`: `AsyncLLMEngine`'s interface with the engine core in a process of its own, as vLLM
V1's AsyncLLM over its EngineCoreProc (engine/core_proc.py).

This process keeps what serves the client: tokenization and validation (the input processor),
detokenization, logprobs' strings and stop strings (the output processor, on a shadow of each request's
sequences), and the per-request asyncio queues the HTTP handlers read. The core keeps scheduling, the
executor and the model. Requests go in and token deltas come out over two ZMQ sockets (engine/wire.py);
a thread here reads the deltas, turns them into cumulative RequestOutputs and hands them to the event loop.

The core's death (a crash, a kill) fails every waiting request with EngineDeadError at once (the server
answers 500) and `is_running` turns False (its /health 503): nothing waits on a process that is gone.

PAGODA_ENABLE_ENGINE_CORE_PROCESS=1|0 turns it on or off, as vLLM's VLLM_ENABLE_V1_MULTIPROCESSING; unset,
it is on with a GPU and off on a CPU (engine_core_process_enabled says why)."""

import asyncio
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass

import zmq

from pagoda.config import EngineArgs, EngineConfig, create_engine_config
from pagoda.core.sequence import Sequence, SequenceStatus
from pagoda.engine import EngineDeadError, wire
from pagoda.engine.async_base import AsyncEngineBase, publish
from pagoda.engine.core_proc import run_engine_core
from pagoda.engine.input_processor import InputProcessor
from pagoda.engine.output_processor import OutputProcessor
from pagoda.engine.outputs import EngineStats, RequestMetrics
from pagoda.engine.request_state import RequestState
from pagoda.errors import InvalidParam, RequestFailed
from pagoda.lora.registry import LoRARegistry

logger = logging.getLogger(__name__)

ENV = "PAGODA_ENABLE_ENGINE_CORE_PROCESS"
POLL_MS = 200  # the output thread looks at the core's liveness at least this often
SEND_TIMEOUT_MS = 2000  # a request the core does not take within this is refused: the core is gone


def engine_core_process_enabled(device: str) -> bool:
    """PAGODA_ENABLE_ENGINE_CORE_PROCESS: 1 or 0 (anything else is an error naming it). Unset: on with a GPU
    (vLLM's default: the forward pass runs on the device, the host's cores are free for the server), off on
    a CPU, where the forward pass's threads take every core and the server's work beside them slowed each
    step more than taking it out of the step saved (docs/benchmarks.md: 2 shared cores, 9-17 %)."""
    value = os.environ.get(ENV, "").strip().lower()
    if value == "":
        return device != "cpu"
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{ENV} must be 0 or 1; got {os.environ[ENV]!r}")


@dataclass
class _Tracked:
    """A request in flight, as this process sees it."""

    state: RequestState  # a shadow of the core's: the same sequences' tokens, and their text
    loop: asyncio.AbstractEventLoop
    stream: asyncio.Queue
    failing: bool = False  # its output processing failed here: the core's final delta is awaited


class AsyncMPEngine(AsyncEngineBase):
    engine_name = "engine core"

    def __init__(self, config: EngineConfig):
        super().__init__()
        from transformers import AutoTokenizer

        from pagoda.worker.loader.generation_config import eos_token_ids_for

        self.config = config
        model = config.model
        self.tokenizer = AutoTokenizer.from_pretrained(model.tokenizer_path,
                                                       trust_remote_code=model.trust_remote_code)
        eos = eos_token_ids_for(config, self.tokenizer)
        grammar_key = (model.tokenizer_path, model.hf_config.vocab_size, tuple(sorted(eos)))
        self.input_processor = InputProcessor(self.tokenizer, model.hf_config.vocab_size, model.max_model_len,
                                              config.scheduler.max_num_seqs, grammar_key)
        self.output_processor = OutputProcessor(self.tokenizer, eos, model.max_model_len)
        self.loras = LoRARegistry(config.lora, model.hf_config)
        self._requests: dict[str, _Tracked] = {}
        self._lock = threading.Lock()  # the table above, between the event loop and the output thread
        self._send_lock = threading.Lock()  # the input socket, likewise
        self._encoder = wire.encoder()
        self._decoder = wire.from_core_decoder()
        self._ipc_dir = tempfile.mkdtemp(prefix="pagoda-core-")
        input_address, output_address = (f"ipc://{self._ipc_dir}/{name}" for name in ("in", "out"))
        self._context = zmq.Context()
        self._input = self._context.socket(zmq.PUSH)
        self._input.setsockopt(zmq.LINGER, 0)
        # a core that is gone leaves the socket without a peer, where a send would wait for ever
        self._input.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        self._input.bind(input_address)
        self._output = self._context.socket(zmq.PULL)
        self._output.bind(output_address)
        # spawn: this process runs an event loop and other threads, which a forked child would inherit
        # half-held; the core starts its own worker ranks (fork is safe there: it has no other threads)
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, name="pagoda-engine-core", daemon=True,
            args=(config, input_address, output_address, os.getpid(), logging.getLogger().level))
        self.process.start()
        try:
            self._stats = self._wait_ready()
        except BaseException:
            self._close()
            raise
        this = weakref.ref(self)
        self._thread = threading.Thread(target=AsyncMPEngine._read_outputs, args=(this,),
                                        name="pagoda-core-outputs", daemon=True)
        self._thread.start()
        logger.info("engine core process %d ready", self.process.pid)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "AsyncMPEngine":
        return cls(create_engine_config(args))

    def _wait_ready(self) -> EngineStats:
        poller = zmq.Poller()
        poller.register(self._output, zmq.POLLIN)
        while True:
            if dict(poller.poll(POLL_MS)).get(self._output):
                message = self._decoder.decode(self._output.recv())
                if isinstance(message, wire.Ready):
                    return message.stats
                if isinstance(message, wire.CoreFailed):
                    self.process.join(10)
                    try:
                        error = wire.loads(message.error)
                    except Exception:  # noqa: BLE001 - an exception that does not unpickle: its text
                        error = None
                    raise error if isinstance(error, BaseException) else RuntimeError(message.message)
            elif not self.process.is_alive():
                raise RuntimeError(f"the engine core process exited with code {self.process.exitcode} "
                                   "while loading the model")

    # --- AsyncLLMEngine's interface ----------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return not self.errored and not self._stopping.is_set() and self.process.is_alive()

    async def process_prompt(self, prompt, params) -> tuple[str | None, list[int]]:
        """Tokenize and validate a prompt off the event loop; raises ValueError naming the problem."""
        processed = await asyncio.to_thread(self.input_processor.process, prompt, params)
        return processed.text, processed.token_ids

    def _submit(self, request_id, text, token_ids, params, lora_request, priority, stream) -> None:
        arrival = time.time()
        seq = Sequence(request_id, token_ids, params, 0, arrival)
        state = RequestState(request_id, text, token_ids, seq.params, RequestMetrics(arrival), seq.kind)
        state.add_seq(seq)
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request_id {request_id!r} is already running")
            self._requests[request_id] = _Tracked(state, asyncio.get_running_loop(), stream)
        try:
            self._send(wire.AddRequest(request_id, text, token_ids, wire.dumps(params),
                                       None if lora_request is None else wire.dumps(lora_request), arrival,
                                       priority))
            if self._dead_error is not None:  # died between the health check and the add
                raise EngineDeadError(f"engine core died: {self._dead_error!r}")
        except BaseException:
            self._abort(request_id, notify=False)
            raise

    def _end(self, request_id: str, finished: bool) -> None:
        if not finished:
            self._abort(request_id, notify=False)

    async def abort(self, request_id: str) -> None:
        self._abort(request_id, notify=True)

    def _abort(self, request_id: str, notify: bool) -> None:
        """End a request here at once (a listener gets its final, aborted output) and tell the core."""
        with self._lock:
            tracked = self._requests.pop(request_id, None)
        if tracked is None:
            return
        if notify:
            state = tracked.state
            state.aborted = True
            for seq in state.seqs:
                _finish(seq, "abort")
            publish({tracked.loop: [(tracked.stream, state.to_output())]})
        if self._dead_error is None:
            try:
                self._send(wire.AbortRequest(request_id))
            except EngineDeadError:  # the output thread is about to find the core gone
                pass

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core (its workers with it) and the output thread; requests still waiting get
        EngineDeadError. Idempotent; also on `with` exit and garbage collection."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self.process.is_alive():
            try:
                self._send(wire.Shutdown())
            except (zmq.ZMQError, EngineDeadError):
                pass
            self.process.join(timeout)
        thread = getattr(self, "_thread", None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self._fail_all(EngineDeadError("the engine was shut down"))
        self._close()

    def _close(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(5)
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._context.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    def __del__(self) -> None:
        if hasattr(self, "_thread"):
            self.shutdown()

    # --- internals ---------------------------------------------------------------------------------

    def _send(self, message) -> None:
        data = self._encoder.encode(message)
        with self._send_lock:
            try:
                self._input.send(data, copy=False)
            except zmq.Again:
                raise EngineDeadError("the engine core does not take requests (its process is gone)") from None

    def _fail_all(self, error: BaseException) -> None:
        dead = self._death(error)
        with self._lock:
            tracked, self._requests = list(self._requests.values()), {}
        by_loop: dict = {}
        for t in tracked:
            by_loop.setdefault(t.loop, []).append((t.stream, dead))
        publish(by_loop)

    @staticmethod
    def _read_outputs(this: "weakref.ref[AsyncMPEngine]") -> None:
        """The output thread: holds the engine only weakly between polls, so dropping it shuts it down."""
        self = this()
        poller = zmq.Poller()
        poller.register(self._output, zmq.POLLIN)
        poller.register(self.process.sentinel, zmq.POLLIN)
        del self
        while (self := this()) is not None and not self._stopping.is_set():
            events = dict(poller.poll(POLL_MS))
            try:
                if events.get(self._output):
                    while True:
                        try:
                            data = self._output.recv(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._handle(self._decoder.decode(data))
                elif events.get(self.process.sentinel) and not self._stopping.is_set():
                    self.process.join(1)
                    message = f"the engine core process exited with code {self.process.exitcode}"
                    logger.error("%s: failing every request", message)
                    self._fail_all(RuntimeError(message))
                    return
            except Exception as e:  # noqa: BLE001 - this thread must not die silently: the server would hang
                logger.exception("reading the engine core's outputs failed")
                self._fail_all(e)
                return
            del self

    def _handle(self, message) -> None:
        if isinstance(message, wire.StepOutputs):
            if message.stats is not None:  # first: a client that has seen its output finds it counted
                self._stats = message.stats
            by_loop: dict = {}
            for delta in message.outputs:
                self._apply(delta, by_loop)
            closed = publish(by_loop)
            if closed:  # callers whose event loop is gone: nobody will end their streams
                with self._lock:
                    gone = [request_id for request_id, t in self._requests.items() if t.loop in closed]
                for request_id in gone:
                    self._abort(request_id, notify=False)
        elif isinstance(message, wire.GroupFailure):
            self._on_group_failure(message.message)
        elif isinstance(message, wire.CoreFailed):
            logger.error("%s", message.message)
            self._fail_all(RuntimeError(message.message))

    def _apply(self, delta: wire.RequestDelta, by_loop: dict) -> None:
        """One request's delta: its tokens' text and stops here, then its output for the listener."""
        with self._lock:
            tracked = self._requests.get(delta.request_id)
            if tracked is None:  # aborted here meanwhile
                return
            if delta.finished:
                del self._requests[delta.request_id]
        state = tracked.state
        if delta.invalid is not None:
            item = InvalidParam(delta.invalid or None, delta.error or "invalid request")
        else:
            self._apply_tokens(tracked, delta)
            if tracked.failing or delta.error is not None:
                if not delta.finished:  # the core's final delta (its blocks freed) comes next
                    return
                item = RequestFailed(state.error or delta.error)
            elif state.finished and not delta.finished:
                return  # stopped here (a stop string): published once the core has freed its blocks
            else:
                item = state.to_output()
        by_loop.setdefault(tracked.loop, []).append((tracked.stream, item))

    def _apply_tokens(self, tracked: _Tracked, delta: wire.RequestDelta) -> None:
        state, processor = tracked.state, self.output_processor
        by_index = {seq.index: seq for seq in state.seqs}
        first = state.seqs[0]
        for seq_delta in delta.seqs:  # the other outputs of an n > 1 prompt fork at its end, before a token
            if seq_delta.index not in by_index:
                child = first.fork(seq_delta.index)
                state.add_seq(child, copy_from=first)
                by_index[seq_delta.index] = child
        first.num_cached_tokens = delta.num_cached_tokens
        if delta.kv_transfer_params is not None:  # P/D: where a finished prefill's blocks wait for the decode
            first.kv_transfer_params = delta.kv_transfer_params
        metrics = state.metrics
        metrics.first_scheduled_time = delta.metrics.first_scheduled_time
        metrics.data_parallel_rank = delta.metrics.data_parallel_rank
        for start, scored in delta.prompt_logprobs:
            processor.process_prompt_logprobs(state, start, scored)
        produced = delta.result is not None
        if produced:
            state.result = delta.result
        for seq_delta in delta.seqs:
            seq = by_index[seq_delta.index]
            for token in seq_delta.tokens:
                if seq.is_finished or tracked.failing:
                    break
                seq.append_token(token.token_id)
                produced = True
                try:
                    stop = processor.process_token(state, seq, token)
                except Exception as e:  # noqa: BLE001 - one request's failure must not take the server down
                    message = f"processing its output failed: {e!r}"
                    logger.error("request %s failed: %s", state.request_id, message)
                    tracked.failing = True
                    state.error = message
                    self._send(wire.AbortRequest(state.request_id, message))
                    break
                if stop is not None:
                    _finish(seq, stop.reason, stop.stop_reason)
                    if seq_delta.finish_reason is None:  # a stop string: the core has not seen it
                        self._send(wire.FinishSeq(state.request_id, seq.index, stop.reason, stop.stop_reason))
            if seq_delta.finish_reason is not None and not seq.is_finished:
                _finish(seq, seq_delta.finish_reason, seq_delta.stop_reason)
        if produced:
            if metrics.first_token_time is None:
                metrics.first_token_time = delta.metrics.first_token_time
            metrics.last_token_time = delta.metrics.last_token_time
        if delta.error is not None and state.error is None:
            state.error = delta.error


def _finish(seq: Sequence, reason: str, stop_reason=None) -> None:
    if not seq.is_finished:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
