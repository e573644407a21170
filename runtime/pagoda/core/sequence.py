"""One stream of tokens being generated. A request with n > 1 becomes n sequences after its prefill."""

import dataclasses
import enum
import itertools
import time
from typing import TYPE_CHECKING

from pagoda.core.request_kind import RequestParams, kind_of

if TYPE_CHECKING:
    from pagoda.lora.request import LoRARequest

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED = enum.auto()


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: RequestParams, index: int = 0,
                 arrival_time: float | None = None):
        self.seq_id = next(_seq_ids)
        self.request_id = request_id
        self.index = index  # which of the request's n outputs
        self.kind = kind_of(params)  # generation, embedding (core.request_kind)
        self.request_params = params  # the request's own parameters, whichever kind
        self.params = self.kind.sampling_params(params)  # what it is scheduled and stop-checked with
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache on first schedule
        self.lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)
        self.status = SequenceStatus.WAITING
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.priority = 0  # --scheduling-policy priority: lower first (then earlier arrival), as vLLM's
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # forked from a parent that finished prefill: n samples are drawn at the end of the prompt
        self.pending_forks = self.params.n - 1 if index == 0 else 0
        # what the model runner already knows about this sequence (the scheduler sends deltas)
        self.num_tokens_sent = 0
        self.num_blocks_sent = 0
        self.needs_reset = True
        self.kv_transfer_params: dict | None = None  # P/D: what its output tells a decode engine (kv_transfer)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def fork(self, index: int) -> "Sequence":
        params = self.params  # only a kind that samples forks (n > 1)
        if params.seed is not None:  # each of the n outputs draws its own random stream
            params = dataclasses.replace(params, seed=params.seed + index)
        child = Sequence(self.request_id, self.token_ids[: self.num_prompt_tokens], params, index,
                         self.arrival_time)
        child.token_ids = list(self.token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.status = self.status
        child.pending_forks = 0
        child.lora_request = self.lora_request
        child.priority = self.priority
        return child

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request_id}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, {self.status.name})")
