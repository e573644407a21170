"""The engine core process (vLLM V1's EngineCoreProc): scheduling, the executor and the model, in a
process of its own, so that the server's HTTP, tokenization, detokenization and streaming never take the
GIL from a step. It reads requests from the server over ZMQ and sends back, after each step, every
request's new token ids and logprobs (engine/wire.py); the text is the server's (engine/core_client.py).

Stops that need no text (EOS, stop token ids, max_tokens, the context length) are decided here, as the
in-process engine decides them; a stop string is found by the server, which then finishes the sequence
here (FinishSeq). The server's requests finished here (a stop string, a failure) are answered with a
final delta once their blocks are free, so a client that has its last output finds it in /metrics."""

import logging
import multiprocessing
import os
import signal
import threading

import zmq

from pagoda.config import EngineConfig
from pagoda.core.runner_output import SampledToken
from pagoda.core.sequence import Sequence
from pagoda.engine import wire
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.outputs import RequestMetrics
from pagoda.engine.request_state import RequestState
from pagoda.engine.stop_checker import Stop, check_stop
from pagoda.process.startup_heap import frozen_when_loaded

logger = logging.getLogger(__name__)
IDLE_POLL_MS = 1000  # an idle core wakes this often to see whether the server is still there
SEND_TIMEOUT_MS = 1000  # a blocked send looks this often whether the server is still there


class TokenOutputProcessor:
    """The core's output processor: keeps each sequence's new tokens (and prompt logprobs) for the next
    delta, and decides the stops that need no text."""

    def __init__(self, eos_token_ids: set[int], max_model_len: int):
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.tokens: dict[int, list[SampledToken]] = {}  # seq id -> tokens not yet sent
        self.prompt_logprobs: dict[str, list[tuple[int, list[SampledToken]]]] = {}  # request id -> chunks

    def process_token(self, state: RequestState, seq: Sequence, token: SampledToken) -> Stop | None:
        self.tokens.setdefault(seq.seq_id, []).append(token)
        return check_stop(seq, "", 0, self.eos_token_ids, self.max_model_len)

    def process_prompt_logprobs(self, state: RequestState, start: int, scored: list[SampledToken]) -> None:
        self.prompt_logprobs.setdefault(state.request_id, []).append((start, scored))

    def take(self, state: RequestState) -> tuple[list[wire.SeqDelta], list]:
        seqs = [wire.SeqDelta(s.index, self.tokens.pop(s.seq_id, []), s.finish_reason, s.stop_reason)
                for s in state.seqs]
        return seqs, self.prompt_logprobs.pop(state.request_id, [])

    def drop(self, state: RequestState) -> None:
        for seq in state.seqs:
            self.tokens.pop(seq.seq_id, None)
        self.prompt_logprobs.pop(state.request_id, None)


class CoreEngine(LLMEngine):
    """LLMEngine whose steps hand back token deltas (wire.RequestDelta) instead of RequestOutputs, driven
    by the server's messages."""

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.output_processor = TokenOutputProcessor(self.eos_token_ids, config.model.max_model_len)

    def _make_output(self, state: RequestState) -> wire.RequestDelta:
        seqs, prompt_logprobs = self.output_processor.take(state)
        first = state.seqs[0] if state.seqs else None
        return wire.RequestDelta(state.request_id, seqs, state.metrics,
                                 first.num_cached_tokens if first else 0, prompt_logprobs,
                                 state.result, state.error, None, state.finished,
                                 first.kv_transfer_params if first else None)

    def handle(self, message) -> wire.RequestDelta | None:
        """One message from the server; the delta to answer with, if any."""
        if isinstance(message, wire.AddRequest):
            return self._add(message)
        state = self.requests.get(message.request_id)
        if state is None:  # finished here meanwhile: the server has (or will have) its final delta
            return None
        if isinstance(message, wire.AbortRequest):
            if message.error is None:  # the client is gone or asked: nobody waits for a delta
                self.output_processor.drop(state)
                self.abort_request(message.request_id)
                return None
            self._fail_request(state, message.error)
        elif isinstance(message, wire.FinishSeq):
            seq = next((s for s in state.seqs if s.index == message.index), None)
            if seq is not None and not seq.is_finished:
                self.core.finish(seq, message.reason, message.stop_reason)
                self._count_finish(message.reason, state)
        if not state.finished:
            return None
        self.requests.remove(state.request_id)
        return self._make_output(state)

    def _add(self, message: wire.AddRequest) -> wire.RequestDelta | None:
        try:
            self.add_request(message.request_id, message.prompt, wire.loads(message.params), message.arrival_time,
                             message.prompt_token_ids, wire.loads(message.lora_request), message.priority)
            return None
        except ValueError as e:  # the server checked it already: only what the core alone knows
            return wire.RequestDelta(message.request_id, [], RequestMetrics(message.arrival_time), error=str(e),
                                     invalid=getattr(e, "param", None) or "", finished=True)
        except Exception as e:  # noqa: BLE001 - this request failed, not the engine
            logger.exception("adding request %s failed", message.request_id)
            return wire.RequestDelta(message.request_id, [], RequestMetrics(message.arrival_time),
                                     error=f"adding the request failed: {e!r}", finished=True)


class Outbox:
    """The socket to the server; the executor's failure callback sends from its watcher thread too. A send
    that cannot go out (the server is gone, or not reading) retries while the server process lives."""

    def __init__(self, socket: zmq.Socket, parent_pid: int):
        self.socket = socket
        self.parent_pid = parent_pid
        self.encoder = wire.encoder()
        self.lock = threading.Lock()
        socket.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)

    def send(self, message) -> None:
        data = self.encoder.encode(message)
        with self.lock:
            while True:
                try:
                    self.socket.send(data, copy=False)
                    return
                except zmq.Again:
                    if os.getppid() != self.parent_pid:
                        raise SystemExit("the server process is gone") from None


def run_engine_core(config: EngineConfig, input_address: str, output_address: str, parent_pid: int,
                    log_level: int) -> None:
    """The core process's main: build the engine, say Ready (or why not), then step until told to stop
    or the server process is gone."""
    # the server drains on Ctrl-C (the terminal signals the whole group): the core stops when it says so
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # started as a daemon (it dies with the server); its own worker ranks are daemons of its own
    multiprocessing.current_process()._config["daemon"] = False
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s core %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.connect(input_address)
    outbox_socket = context.socket(zmq.PUSH)
    outbox_socket.setsockopt(zmq.LINGER, 5000)
    outbox_socket.connect(output_address)
    outbox = Outbox(outbox_socket, parent_pid)
    engine = None
    try:
        try:
            with frozen_when_loaded():
                engine = CoreEngine(config)
        except BaseException as e:  # noqa: BLE001 - handed to the server, which raises it
            try:
                error = wire.dumps(e)
            except Exception:  # noqa: BLE001 - an exception that does not pickle: its text is enough
                error = None
            outbox.send(wire.CoreFailed(f"{type(e).__name__}: {e}", error))
            raise SystemExit(1) from None
        engine.executor.add_failure_callback(lambda message: outbox.send(wire.GroupFailure(message)))
        outbox.send(wire.Ready(engine.get_stats()))
        _serve(engine, inbox, outbox, parent_pid)
    except SystemExit:
        raise
    except BaseException as e:  # the core is dead: the server fails every request rather than hang
        logger.exception("engine core died")
        outbox.send(wire.CoreFailed(f"engine core died: {e!r}"))
        raise SystemExit(1) from None
    finally:
        if engine is not None:
            engine.shutdown()
        inbox.close(linger=0)
        outbox_socket.close()
        context.term()


def _serve(engine: CoreEngine, inbox: zmq.Socket, outbox: Outbox, parent_pid: int) -> None:
    decoder = wire.to_core_decoder()
    while os.getppid() == parent_pid:
        busy = engine.has_unfinished_requests()
        deltas: list[wire.RequestDelta] = []
        if inbox.poll(0 if busy else IDLE_POLL_MS):
            while True:
                try:
                    message = decoder.decode(inbox.recv(zmq.NOBLOCK, copy=False))
                except zmq.Again:
                    break
                if isinstance(message, wire.Shutdown):
                    return
                delta = engine.handle(message)
                if delta is not None:
                    deltas.append(delta)
        elif not busy:
            if engine.release_held_kv():  # P/D: pulled blocks go back now; /metrics sees them free
                outbox.send(wire.StepOutputs([], engine.get_stats()))
            engine.log_stats_if_due()  # the interval the last requests ended in
            continue
        if engine.has_unfinished_requests():
            deltas += engine.step()
        outbox.send(wire.StepOutputs(deltas, engine.get_stats()))
