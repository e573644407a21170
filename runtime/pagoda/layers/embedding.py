"""Vocabulary-parallel embedding and LM head: each rank owns a contiguous slice of the vocabulary."""

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.distributed.parallel_state import get_parallel_state, tp_all_gather_last_dim, tp_all_reduce
from pagoda.layers.linear import copy_checked
from pagoda.layers.module import Module
from pagoda.layers.packed_weights import PackedWeight, linear


class VocabParallelEmbedding(Module):
    scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size), in the weight's dtype

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        state = get_parallel_state()
        self.tp_rank, self.tp_size = state.tp_rank, state.tp_size
        self.num_embeddings = num_embeddings
        # pad so every rank owns the same number of rows
        self.rows_per_rank = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, num_embeddings)
        self.weight = nn.Parameter(torch.zeros(self.rows_per_rank, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard_id=None):
        rows = self.vocab_end - self.vocab_start
        shape = loaded.get_shape() if hasattr(loaded, "get_shape") else list(loaded.shape)
        if list(shape) != [self.num_embeddings, param.shape[1]]:
            raise ValueError(f"embedding checkpoint has shape {tuple(shape)}, the model config expects "
                             f"({self.num_embeddings}, {param.shape[1]})")
        copy_checked(param.data[:rows], loaded[self.vocab_start : self.vocab_end])

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        if self.tp_size == 1:
            out = F.embedding(token_ids, self.weight)
        else:
            in_shard = (token_ids >= self.vocab_start) & (token_ids < self.vocab_end)
            local = torch.where(in_shard, token_ids - self.vocab_start, 0)
            out = tp_all_reduce(F.embedding(local, self.weight) * in_shard.unsqueeze(-1).to(self.weight.dtype))
        if self.scale is not None:  # as transformers: the scale rounded to the weight's dtype first
            out = out * torch.tensor(self.scale, dtype=self.weight.dtype)
        return out


class ParallelLMHead(VocabParallelEmbedding):
    packed_weight: PackedWeight | None = None  # set by packed_weights.pack_weights
    shares_weight = False  # True when tied to the embedding, which keeps using the plain weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] float32 on every rank
        # float32 sums, not rounded to bfloat16: logits ~10 apart by 1/16 would tie and greedy pick the lower id
        logits = linear(hidden, self, float32_out=True)
        if self.tp_size > 1:
            logits = tp_all_gather_last_dim(logits)
        return logits[:, : self.num_embeddings]
