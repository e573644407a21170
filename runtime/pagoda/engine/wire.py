"""What the server process and the engine core process say to each other (engine/core_client.py,
engine/core_proc.py), as msgspec messages over ZMQ, vLLM V1's encoding.

Requests in: added (token ids, parameters), aborted, failed, or one sequence finished by a stop string the
server found. Token deltas out: per request, each sequence's new sampled tokens (with their logprobs), how
it finished, the request's timestamps, and the engine's stats snapshot of that step. Text never crosses:
detokenization, logprobs' decoded strings and stop strings are the server's.

A request's parameters (SamplingParams, PoolingParams, LoRARequest: rich objects, once per request) ride
pickled; everything on the per-step path is plain msgpack."""

import pickle
from typing import Any

import msgspec

from pagoda.core.runner_output import SampledToken
from pagoda.engine.outputs import EngineStats, RequestMetrics

# --- server -> core --------------------------------------------------------------------------------


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: bytes  # pickled SamplingParams | PoolingParams
    lora_request: bytes | None  # pickled LoRARequest
    arrival_time: float
    priority: int = 0


class AbortRequest(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    # set: the server failed the request (its output processing raised); the core finishes it with "error"
    error: str | None = None


class FinishSeq(msgspec.Struct, tag=True, array_like=True):
    """The server stopped one sequence (a stop string): the core finishes it and frees its blocks."""

    request_id: str
    index: int
    reason: str
    stop_reason: int | str | None = None


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


ToCore = AddRequest | AbortRequest | FinishSeq | Shutdown

# --- core -> server --------------------------------------------------------------------------------


class SeqDelta(msgspec.Struct, array_like=True):
    index: int  # which of the request's n outputs
    tokens: list[SampledToken]  # appended since the last delta, in order
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class RequestDelta(msgspec.Struct, array_like=True):
    request_id: str
    seqs: list[SeqDelta]
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    prompt_logprobs: list[tuple[int, list[SampledToken]]] = []  # (first position, scored tokens), in order
    result: Any = None  # a kind that does not sample: its result (an embedding)
    error: str | None = None  # the request failed inside the core
    invalid: str | None = None  # the core refused the request: the field it names ("" for none)
    finished: bool = False  # the core is done with the request (its blocks are free)
    kv_transfer_params: dict | None = None  # P/D: a finished prefill's, for the decode engine (kv_transfer)


class Ready(msgspec.Struct, tag=True, array_like=True):
    stats: EngineStats


class StepOutputs(msgspec.Struct, tag=True, array_like=True):
    outputs: list[RequestDelta]
    stats: EngineStats | None = None  # taken after the outputs: /metrics counts what a client has seen


class CoreFailed(msgspec.Struct, tag=True, array_like=True):
    """The core could not start (pickled exception: the caller sees the load error) or died."""

    message: str
    error: bytes | None = None


class GroupFailure(msgspec.Struct, tag=True, array_like=True):
    message: str


FromCore = Ready | StepOutputs | CoreFailed | GroupFailure


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def to_core_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(ToCore)


def from_core_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(FromCore)


def dumps(obj) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes | None):
    return None if data is None else pickle.loads(data)
