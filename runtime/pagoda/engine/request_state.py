"""Per-request bookkeeping on the engine side: its sequences, their text and logprobs, and outputs."""

import time
from dataclasses import dataclass, field

from pagoda.detokenizer import DetokenizerState, new_state
from pagoda.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.sequence import Sequence


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
    seqs: list[Sequence] = field(default_factory=list)
    outputs: dict[int, SeqOutputState] = field(default_factory=dict)  # by seq id
    aborted: bool = False
    error: str | None = None  # why this request failed inside the engine (it alone)

    def add_seq(self, seq: Sequence, copy_from: Sequence | None = None) -> None:
        self.seqs.append(seq)
        if copy_from is not None:
            src = self.outputs[copy_from.seq_id]
            self.outputs[seq.seq_id] = SeqOutputState(
                DetokenizerState(src.detok.prefix_offset, src.detok.read_offset, src.detok.text),
                None if src.logprobs is None else list(src.logprobs), src.cumulative_logprob, src.hold_back)
            return
        hold = max((len(s) for s in self.params.stop_strings), default=0)
        self.outputs[seq.seq_id] = SeqOutputState(
            new_state(seq.num_prompt_tokens), [] if self.params.logprobs is not None else None,
            0.0 if self.params.logprobs is not None else None, max(hold - 1, 0))

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
            text = state.detok.text
            if not seq.is_finished and state.hold_back:
                text = text[: max(len(text) - state.hold_back, 0)]
            completions.append(CompletionOutput(
                index=index, text=text, token_ids=seq.output_token_ids,
                cumulative_logprob=state.cumulative_logprob,
                logprobs=None if state.logprobs is None else list(state.logprobs),
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
        finished = self.finished
        if finished and self.metrics.finished_time is None:
            self.metrics.finished_time = time.time()
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, completions, finished,
                             self.metrics, self.seqs[0].num_cached_tokens if self.seqs else 0, self.error)
