"""Drafts from a smaller model that shares the target's tokenizer.

The draft model has its own paged KV cache with as many blocks as the target's, addressed by the same
block tables (the scheduler's slots for a sequence hold both models' K/V). It catches up lazily: when a
sequence is to speculate, the draft model first runs over the tokens it has not seen (the whole prompt the
first time, or after a preemption), then proposes k tokens autoregressively, sampling each from its own
distribution under the request's sampling parameters; those distributions are kept for the rejection
sampler. After verification the draft KV of accepted drafts stays valid, so only those are kept.
"""

import numpy as np
import torch

from pagoda.layers.attention import forward_context
from pagoda.spec_decode.rejection_sampler import sample_rows, target_probs


class DraftModelProposer:
    def __init__(self, runner, model, seed: int):
        self.runner = runner  # the target's model runner: its sequences, metadata and sampling tensors
        self.model = model
        self.attention_layers = model.attention_layers()
        self.kv_caches: list[torch.Tensor] = []
        self.num_computed: dict[int, int] = {}  # seq id -> tokens whose draft K/V is in the cache
        self.proposed_at: dict[int, tuple[int, int]] = {}  # seq id -> (position of the first draft, k)
        self.generator = torch.Generator(device=runner.device).manual_seed(seed + 1)
        self.seq_generators: dict[int, torch.Generator] = {}

    def kv_cache_bytes_per_block(self) -> int:
        layer = self.attention_layers[0]
        itemsize = self.runner.dtype.itemsize
        return 2 * self.runner.block_size * layer.num_kv_heads * layer.head_size * itemsize * len(self.attention_layers)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = []
        for layer in self.attention_layers:
            # the target's layout: [2, num_blocks, block_size, num_kv_heads, head_size], head-major in memory
            cache = torch.zeros(2, num_blocks, layer.num_kv_heads, self.runner.block_size, layer.head_size,
                                dtype=self.runner.dtype, device=self.runner.device).transpose(2, 3)
            layer.kv_cache = cache
            self.kv_caches.append(cache)

    def forget(self, seq_id: int) -> None:
        self.num_computed.pop(seq_id, None)
        self.proposed_at.pop(seq_id, None)
        self.seq_generators.pop(seq_id, None)

    def accepted(self, seq_id: int, num_accepted: int) -> None:
        """Verification accepted num_accepted drafts: their draft K/V (written while proposing) stays."""
        first, k = self.proposed_at.pop(seq_id)
        # the last draft was proposed but never fed to the draft model: no K/V for it
        self.num_computed[seq_id] = first + min(num_accepted, k - 1)

    @torch.inference_mode()
    def propose(self, out, seqs) -> tuple[dict[int, list[int]], dict[int, torch.Tensor]]:
        """Drafts for the scheduled sequences that asked the draft model for them: seq id -> draft ids, and
        seq id -> [k, V] the distributions they were drawn from."""
        jobs = [s for s in out.scheduled if s.num_draft_tokens and s.draft_token_ids is None]
        if not jobs:
            return {}, {}
        chunks = []  # (seq id, token ids, first position)
        for s in jobs:
            end = s.num_computed_tokens + s.num_new_tokens - s.num_draft_tokens  # the real tokens' end
            start = min(self.num_computed.get(s.seq_id, 0), end - 1)
            chunks.append((s.seq_id, seqs[s.seq_id].token_ids[start:end], start))
            self.num_computed[s.seq_id] = end
            self.proposed_at[s.seq_id] = (end, s.num_draft_tokens)
        drafts: dict[int, list[int]] = {s.seq_id: [] for s in jobs}
        probs: dict[int, list[torch.Tensor]] = {s.seq_id: [] for s in jobs}
        wanted = {s.seq_id: s.num_draft_tokens for s in jobs}
        while chunks:
            seq_ids = [c[0] for c in chunks]
            logits = self._forward(chunks, seqs)  # [len(chunks), V]: after each chunk's last token
            t = self.runner._sampling_tensors(seq_ids, [None] * len(seq_ids))
            dist, is_greedy = target_probs(self.runner.sampler, logits, t)
            tokens = sample_rows(dist, is_greedy, [self._generator(i, seqs) for i in seq_ids])
            next_chunks = []
            for row, ((seq_id, _, _), token) in enumerate(zip(chunks, tokens)):
                drafts[seq_id].append(token)
                probs[seq_id].append(dist[row])
                if len(drafts[seq_id]) < wanted[seq_id]:
                    position = self.proposed_at[seq_id][0] + len(drafts[seq_id]) - 1
                    next_chunks.append((seq_id, [token], position))
            chunks = next_chunks
        return drafts, {seq_id: torch.stack(rows) for seq_id, rows in probs.items()}

    def _generator(self, seq_id: int, seqs) -> torch.Generator:
        seed = seqs[seq_id].params.seed
        if seed is None:
            return self.generator
        if seq_id not in self.seq_generators:  # its own stream, apart from the target's
            self.seq_generators[seq_id] = torch.Generator(device=self.runner.device).manual_seed(seed + 2**31)
        return self.seq_generators[seq_id]

    def _forward(self, chunks, seqs) -> torch.Tensor:
        bs = self.runner.block_size
        device = self.runner.device
        tokens, positions, slots, query_lens, seq_lens, tables, last_rows = [], [], [], [], [], [], []
        row = 0
        for seq_id, ids, start in chunks:
            table = seqs[seq_id].block_table
            pos = np.arange(start, start + len(ids), dtype=np.int64)
            tokens += ids
            positions.append(pos)
            slots.append(np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs)
            query_lens.append(len(ids))
            seq_lens.append(start + len(ids))
            tables.append(table)
            row += len(ids)
            last_rows.append(row - 1)
        input_ids = torch.tensor(tokens, dtype=torch.long, device=device)
        position_ids = torch.from_numpy(np.concatenate(positions)).to(device)
        metadata = self.runner._metadata(query_lens, seq_lens, tables, torch.from_numpy(np.concatenate(slots)))
        with forward_context(metadata, self.runner.attn_backend, self.runner.triton_ops):
            hidden = self.model(input_ids, position_ids)
        return self.model.compute_logits(hidden[last_rows])
