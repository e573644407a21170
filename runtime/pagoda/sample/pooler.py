"""Embedding requests in the model runner: their prompt runs through the model like any prefill (chunked,
batched with generating sequences, over the paged KV cache), and where a sampling sequence would sample,
the final hidden states are pooled into one vector instead."""

from dataclasses import dataclass

import torch

from pagoda.core.request_kind import EMBED
from pagoda.core.scheduler_output import SchedulerOutput
from pagoda.pooling_params import PoolingParams


@dataclass
class PoolState:
    params: PoolingParams
    hidden_sum: torch.Tensor | None = None  # mean pooling: [hidden] float32, the rows summed so far
    num_summed: int = 0  # positions 0 .. num_summed - 1 are in hidden_sum


class Pooler:
    """The reader of embedding requests (worker/request_kinds.py)."""

    def __init__(self):
        self.states: dict[int, PoolState] = {}  # by seq id, from its first step until it finishes

    def update(self, out: SchedulerOutput) -> None:
        """Follow the scheduler: new pooling sequences (their params come on reset), finished ones."""
        for seq_id in out.finished_seq_ids:
            self.states.pop(seq_id, None)
        for s in out.scheduled:
            if s.reset and EMBED.owns(s.request_params) and s.seq_id not in self.states:
                # a sequence reset after preemption keeps its partial sum: recomputed positions are skipped
                self.states[s.seq_id] = PoolState(s.request_params)

    @property
    def active(self) -> bool:
        return bool(self.states)

    def is_pooling(self, seq_id: int) -> bool:
        return seq_id in self.states

    def read(self, out: SchedulerOutput, hidden: torch.Tensor) -> dict[int, list[float]]:
        return self.pool(out, hidden)

    def pool(self, out: SchedulerOutput, hidden: torch.Tensor) -> dict[int, list[float]]:
        """hidden [num_tokens, hidden_size], the last stage's final (normed) hidden states of the batch, rows in
        scheduled order. Returns the vectors of the pooling sequences whose prompt ended this step."""
        pooled: dict[int, list[float]] = {}
        end = 0
        for s in out.scheduled:
            start, end = end, end + s.num_new_tokens
            state = self.states.get(s.seq_id)
            if state is None:
                continue
            if state.params.pooling_type == "mean":
                # a resumed (recomputed) sequence runs positions again that are summed already: skip them
                skip = max(state.num_summed - s.num_computed_tokens, 0)
                rows = hidden[start + skip : end].float().sum(dim=0)  # [hidden]
                state.hidden_sum = rows if state.hidden_sum is None else state.hidden_sum + rows
                state.num_summed = max(state.num_summed, s.num_computed_tokens + s.num_new_tokens)
            if not s.num_samples:  # mid-prompt chunk
                continue
            if state.params.pooling_type == "last":
                vector = hidden[end - 1].float()
            else:
                vector = state.hidden_sum / state.num_summed
            if state.params.normalize:
                vector = torch.nn.functional.normalize(vector, dim=-1)
            pooled[s.seq_id] = vector.tolist()
        return pooled
