"""The runner's view of its sequences, kept from the scheduler's deltas (tokens and block tables), and the
batch one step runs: input ids, positions, slots, attention metadata and the rows to sample."""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagoda.attention import AttentionMetadata
from pagoda.core.request_kind import GENERATE, RequestKind, kind_of
from pagoda.core.scheduler_output import SchedulerOutput
from pagoda.sampling_params import SamplingParams
from pagoda.structured_output import GrammarMatcher

if TYPE_CHECKING:
    from pagoda.lora.request import LoRARequest


@dataclass
class RunnerSeq:
    token_ids: list[int]
    block_table: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    kind: RequestKind = GENERATE  # a kind that does not sample is read, not sampled, at its prompt's end
    matcher: GrammarMatcher | None = None  # structured outputs: made on first sample, follows token_ids
    lora_request: "LoRARequest | None" = None  # its adapter; None: the base model
    last_sampled: int | None = None  # the token its last step sampled: the input of a placeholder step
    group_tables: list[list[int]] | None = None  # KV cache groups: the further groups' tables (core.kv_cache_groups)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata
    sample_rows: list[int]  # rows of the hidden states to sample from, ascending
    sample_seq_ids: list[int]  # the sequence of each of those rows


class InputBatch:
    def __init__(self, block_size: int, device: torch.device):
        self.block_size = block_size
        self.device = device
        self.seqs: dict[int, RunnerSeq] = {}

    def apply_deltas(self, out: SchedulerOutput) -> list[int]:
        """Bring the sequences up to out; returns those (re)learnt whole: new to the runner, resumed after a
        preemption, forked, or whose blocks changed."""
        for seq_id in out.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        relearnt = []
        for s in out.scheduled:
            if s.reset:
                self.seqs[s.seq_id] = RunnerSeq(list(s.new_token_ids), list(s.block_ids), s.num_prompt_tokens,
                                                s.params, kind_of(s.request_params or s.params),
                                                lora_request=s.lora_request)
                if s.group_block_ids is not None:
                    self.seqs[s.seq_id].group_tables = [list(ids) for ids in s.group_block_ids]
                relearnt.append(s.seq_id)
                continue
            seq = self.seqs[s.seq_id]
            seq.token_ids.extend(s.new_token_ids)
            if s.placeholder:  # async scheduling: the token its previous step sampled (where that step failed,
                seq.token_ids.append(seq.last_sampled or 0)  # the engine ends it and drops this step's token)
            del seq.block_table[s.block_ids_start :]
            seq.block_table.extend(s.block_ids)
            if s.group_block_ids is not None:
                for table, ids in zip(seq.group_tables, s.group_block_ids):
                    del table[s.block_ids_start :]
                    table.extend(ids)
        return relearnt

    def prepare(self, out: SchedulerOutput, drafts: dict[int, list[int]]) -> StepInputs:
        """drafts: seq id -> its draft tokens this step, fed after its own; their rows are all sampled."""
        bs = self.block_size
        token_chunks, position_chunks, slot_chunks = [], [], []
        query_lens, seq_lens, tables = [], [], []
        sample_rows: list[int] = []
        sample_seq_ids: list[int] = []
        row = 0
        for s in out.scheduled:
            seq = self.seqs[s.seq_id]
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            positions = np.arange(start, end, dtype=np.int64)
            table = np.asarray(seq.block_table, dtype=np.int64)
            num_drafts = s.num_draft_tokens if s.seq_id in drafts else 0
            token_chunks.append(seq.token_ids[start : end - num_drafts] + (drafts[s.seq_id] if num_drafts else []))
            position_chunks.append(positions)
            slot_chunks.append(table[positions // bs] * bs + positions % bs)
            query_lens.append(s.num_new_tokens)
            seq_lens.append(end)
            tables.append(seq.block_table)
            row += s.num_new_tokens
            if num_drafts:  # the target's distribution after the last token and after each draft
                sample_rows += range(row - num_drafts - 1, row)
                sample_seq_ids += [s.seq_id] * (num_drafts + 1)
                continue
            for _ in range(s.num_samples):
                sample_rows.append(row - 1)
                sample_seq_ids.append(s.seq_id)
        input_ids = torch.tensor(np.concatenate([np.asarray(c, dtype=np.int64) for c in token_chunks]),
                                 device=self.device)
        positions = torch.from_numpy(np.concatenate(position_chunks)).to(self.device)
        slots = torch.from_numpy(np.concatenate(slot_chunks)).to(self.device)
        metadata = AttentionMetadata.build(query_lens, seq_lens, tables, slots, self.device)
        first = self.seqs[out.scheduled[0].seq_id]
        if first.group_tables is not None:  # every sequence has them: the model's layers are in groups
            metadata.groups = [metadata] + self._group_metadata(out, position_chunks, query_lens, seq_lens,
                                                                len(first.group_tables))
        return StepInputs(input_ids, positions, metadata, sample_rows, sample_seq_ids)

    def _group_metadata(self, out: SchedulerOutput, position_chunks: list, query_lens: list[int],
                        seq_lens: list[int], num_groups: int) -> list[AttentionMetadata]:
        """The further KV cache groups' metadata: their own block tables and the slots they write."""
        bs, built = self.block_size, []
        for g in range(num_groups):
            tables = [self.seqs[s.seq_id].group_tables[g] for s in out.scheduled]
            slots = np.concatenate([np.asarray(t, dtype=np.int64)[p // bs] * bs + p % bs
                                    for t, p in zip(tables, position_chunks)])
            built.append(AttentionMetadata.build(query_lens, seq_lens, tables, torch.from_numpy(slots), self.device))
        return built
