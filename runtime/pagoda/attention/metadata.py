"""What one forward pass tells the attention op about the batch.

Tokens of a step are laid out sequence by sequence: sequence i owns the query rows
``query_start_loc[i]:query_start_loc[i+1]``. Its query chunk is the *last* ``query_len`` tokens of
its context of ``seq_len`` tokens, so a decode has query_len 1 and a fresh prefill has
query_len == seq_len; a chunked prefill or a prefix-cache hit is anything in between.
"""

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including this step's chunk
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with valid ids (0) or -1
    slot_mapping: torch.Tensor  # [num_tokens] int64, block * block_size + offset; -1 skips the write
    max_query_len: int
    max_seq_len: int
    # Host copies, so the torch path never syncs with the device to learn lengths.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # KV cache groups (core.kv_cache_groups): each group's metadata by group index, this one first; a layer
    # reads its group's (block tables and slots differ, lengths agree). None: one table for every layer
    groups: list["AttentionMetadata"] | None = None

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], tables: list[list[int]], slot_mapping: torch.Tensor,
              device: torch.device) -> "AttentionMetadata":
        """From host lists: each sequence's query length, context length and block table; slot_mapping
        [num_tokens] int64 (on any device)."""
        max_blocks = max(1, max(len(t) for t in tables))
        block_tables = np.zeros((len(tables), max_blocks), dtype=np.int32)
        for i, t in enumerate(tables):
            block_tables[i, : len(t)] = t
        # blocks freed behind a sliding window are -1 in the tables (core.kv_window.NULL_BLOCK) and never read;
        # 0 keeps every entry a valid block for a kernel that loads a whole tile before masking it
        np.maximum(block_tables, 0, out=block_tables)
        query_start_loc = np.zeros(len(query_lens) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start_loc[1:])
        to = lambda a: torch.from_numpy(np.asarray(a)).to(device)  # noqa: E731
        return cls(
            query_start_loc=to(query_start_loc),
            seq_lens=to(np.asarray(seq_lens, dtype=np.int32)),
            block_tables=to(block_tables),
            slot_mapping=slot_mapping.to(device),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
        )

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1

    @property
    def decode_seqs(self) -> list[int]:
        """The sequences with a single query row."""
        return [i for i, query_len in enumerate(self.query_lens_cpu) if query_len == 1]
