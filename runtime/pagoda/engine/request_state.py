"""Per-request bookkeeping on the engine side: its sequences, their text and logprobs, and outputs."""

import time
from dataclasses import dataclass, field
from typing import Any

from pagoda.core.request_kind import GENERATE, RequestKind
from pagoda.core.sequence import Sequence
from pagoda.engine.detokenizer import DetokenizerState, new_state
from pagoda.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagoda.engine.stop_checker import hold_back_chars, visible_text
from pagoda.sampling_params import SamplingParams


@dataclass
class SeqOutputState:
    detok: DetokenizerState
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    hold_back: int  # characters withheld while they might start a stop string


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    kind: RequestKind = GENERATE
    seqs: list[Sequence] = field(default_factory=list)
    outputs: dict[int, SeqOutputState] = field(default_factory=dict)  # by seq id
    aborted: bool = False
    error: str | None = None  # why this request failed inside the engine (it alone)
    # prompt_logprobs: None for the first token (nothing predicts it), then one entry per scored token
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    result: Any = None  # a kind that does not sample: its result (an embedding), once its prompt has run

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    def add_seq(self, seq: Sequence, copy_from: Sequence | None = None) -> None:
        self.seqs.append(seq)
        if copy_from is not None:
            src = self.outputs[copy_from.seq_id]
            self.outputs[seq.seq_id] = SeqOutputState(
                DetokenizerState(src.detok.prefix_offset, src.detok.read_offset, src.detok.text),
                None if src.logprobs is None else list(src.logprobs), src.cumulative_logprob, src.hold_back)
            return
        self.outputs[seq.seq_id] = SeqOutputState(
            new_state(seq.num_prompt_tokens), [] if self.params.logprobs is not None else None,
            0.0 if self.params.logprobs is not None else None, hold_back_chars(self.params))

    @property
    def finished(self) -> bool:
        return self.aborted or self.error is not None or (len(self.seqs) == self.params.n and all(s.is_finished for s in self.seqs))

    def to_output(self) -> RequestOutput:
        completions = []
        by_index = {s.index: s for s in self.seqs}
        for index in range(self.params.n):
            seq = by_index.get(index)
            if seq is None:  # aborted (or failed) before the prompt finished and forked
                completions.append(CompletionOutput(index, "", [], finish_reason="error" if self.error else "abort"))
                continue
            state = self.outputs[seq.seq_id]
            text = visible_text(state.detok.text, state.hold_back, seq.is_finished)
            completions.append(CompletionOutput(
                index=index, text=text, token_ids=seq.output_token_ids,
                cumulative_logprob=state.cumulative_logprob,
                logprobs=None if state.logprobs is None else list(state.logprobs),
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
        finished = self.finished
        if finished and self.metrics.finished_time is None:
            self.metrics.finished_time = time.time()
        prompt_logprobs = None
        if self.prompt_logprobs is not None and len(self.prompt_logprobs) == len(self.prompt_token_ids):
            prompt_logprobs = list(self.prompt_logprobs)  # once the whole prompt is scored, as vLLM's
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, completions, finished,
                             self.metrics, self.seqs[0].num_cached_tokens if self.seqs else 0, self.error,
                             prompt_logprobs=prompt_logprobs, **self._result_field(),
                             kv_transfer_params=self.seqs[0].kv_transfer_params if self.seqs else None)

    def _result_field(self) -> dict[str, Any]:
        """The RequestOutput field the kind's result fills (`embedding`), once it is made."""
        field_name = self.kind.output_field
        return {field_name: self.result} if field_name is not None and self.result is not None else {}


class RequestTable:
    """Every unfinished request, by id and by each of its sequences' ids: the one place that knows which
    request a sequence belongs to."""

    def __init__(self):
        self._by_id: dict[str, RequestState] = {}
        self._by_seq: dict[int, RequestState] = {}

    def add(self, state: RequestState) -> None:
        self._by_id[state.request_id] = state
        for seq in state.seqs:
            self._by_seq[seq.seq_id] = state

    def add_seq(self, state: RequestState, seq: Sequence, copy_from: Sequence) -> None:
        state.add_seq(seq, copy_from)
        self._by_seq[seq.seq_id] = state

    def get(self, request_id: str) -> RequestState | None:
        return self._by_id.get(request_id)

    def of_seq(self, seq_id: int) -> RequestState | None:
        return self._by_seq.get(seq_id)

    def remove(self, request_id: str) -> RequestState | None:
        state = self._by_id.pop(request_id, None)
        if state is not None:
            for seq in state.seqs:
                self._by_seq.pop(seq.seq_id, None)
        return state

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self):
        return iter(self._by_id)

    def values(self):
        return self._by_id.values()
