"""Drafts from a smaller model that shares the target's tokenizer.

The draft model runs unsharded in the driver's process (global rank 0), whatever the target's tensor and
pipeline parallelism: it proposes before the batch leaves the driver, so the drafts travel with the
schedule to every rank and stage. It has its own paged KV cache with as many blocks as the target's,
addressed by the same block tables (the scheduler's slots for a sequence hold both models' K/V). It
catches up lazily: when a sequence is to speculate, the draft model first runs over the tokens it has not
seen (the whole prompt the first time, or after a preemption), then proposes k tokens autoregressively,
sampling each from its own distribution under the request's sampling parameters; those distributions go
with the drafts to the rejection sampler. The draft K/V of fed drafts the target accepted stays valid:
the next proposal keeps those the sequence's tokens still match.
"""

import numpy as np
import torch

from pagoda.layers.attention import forward_context
from pagoda.spec_decode.rejection_sampler import sample_rows, target_probs


class DraftModelProposer:
    def __init__(self, runner, model, seed: int):
        self.runner = runner  # the driver's model runner: its sequences, metadata and sampling tensors
        self.model = model
        self.attention_layers = model.attention_layers()
        self.kv_caches: list[torch.Tensor] = []
        # seq id -> (leading tokens of its own whose draft K/V is cached, the drafts fed to the model after them)
        self.cached: dict[int, tuple[int, list[int]]] = {}
        self.generator = torch.Generator(device=runner.device).manual_seed(seed + 1)
        self.seq_generators: dict[int, torch.Generator] = {}

    def kv_cache_bytes_per_block(self) -> int:
        layer = self.attention_layers[0]
        itemsize = self.runner.kv_dtype.itemsize  # the target's kv_cache_dtype applies to the draft's cache too
        return 2 * self.runner.block_size * layer.num_kv_heads * layer.head_size * itemsize * len(self.attention_layers)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = []
        for layer in self.attention_layers:
            # the target's layout: [2, num_blocks, block_size, num_kv_heads, head_size], head-major in memory
            cache = torch.zeros(2, num_blocks, layer.num_kv_heads, self.runner.block_size, layer.head_size,
                                dtype=self.runner.kv_dtype, device=self.runner.device).transpose(2, 3)
            layer.kv_cache = cache
            layer.calculate_kv_scales = self.runner.config.cache.calculate_kv_scales
            self.kv_caches.append(cache)

    def forget(self, seq_id: int) -> None:
        self.cached.pop(seq_id, None)
        self.seq_generators.pop(seq_id, None)

    def _num_valid(self, seq_id: int, token_ids: list[int]) -> int:
        """Leading tokens of the sequence whose draft K/V is in the cache: its own tokens the model saw,
        then the fed drafts that verification accepted (the ones its tokens still match)."""
        num_tokens, fed = self.cached.get(seq_id, (0, []))
        matched = 0
        for draft, token in zip(fed, token_ids[num_tokens:]):
            if draft != token:
                break
            matched += 1
        return num_tokens + matched

    @torch.inference_mode()
    def propose(self, out, seqs) -> None:
        """Fill in the drafts of the scheduled sequences that take the draft model's (draft_token_ids None):
        their ids and, for a request that samples, the [k, V] distributions they were drawn from."""
        jobs = [s for s in out.scheduled if s.num_draft_tokens and s.draft_token_ids is None]
        if not jobs:
            return
        chunks = []  # (seq id, token ids, first position)
        for s in jobs:
            tokens = seqs[s.seq_id].token_ids
            end = s.num_computed_tokens + s.num_new_tokens - s.num_draft_tokens  # the real tokens' end
            start = min(self._num_valid(s.seq_id, tokens), end - 1)
            chunks.append((s.seq_id, tokens[start:end], start))
            self.cached[s.seq_id] = (end, [])
        drafts: dict[int, list[int]] = {s.seq_id: [] for s in jobs}
        probs: dict[int, list[torch.Tensor]] = {s.seq_id: [] for s in jobs}
        greedy: dict[int, bool] = {}
        wanted = {s.seq_id: s.num_draft_tokens for s in jobs}
        while chunks:
            seq_ids = [c[0] for c in chunks]
            logits = self._forward(chunks, seqs)  # [len(chunks), V]: after each chunk's last token
            # the request's logits processors, as the target's verification applies them: drafts that
            # break them would only be rejected
            logits = self.runner.apply_processors_after_drafts(logits, seq_ids, [drafts[i] for i in seq_ids])
            t = self.runner._sampling_tensors(seq_ids, [None] * len(seq_ids))
            dist, is_greedy = target_probs(self.runner.sampler, logits, t)
            tokens = sample_rows(dist, is_greedy, [self._generator(i, seqs) for i in seq_ids])
            next_chunks = []
            for row, (seq_id, token) in enumerate(zip(seq_ids, tokens)):
                drafts[seq_id].append(token)
                probs[seq_id].append(dist[row])
                greedy[seq_id] = is_greedy[row]
                if len(drafts[seq_id]) < wanted[seq_id]:
                    end, fed = self.cached[seq_id]
                    next_chunks.append((seq_id, [token], end + len(fed)))
                    fed.append(token)
            chunks = next_chunks
        for s in jobs:
            s.draft_token_ids = drafts[s.seq_id]
            # a greedy request's drafts are point masses (one-hot at the draft's argmax): nothing to send
            s.draft_probs = None if greedy[s.seq_id] else torch.stack(probs[s.seq_id]).cpu().numpy()

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
        # one row per chunk read: the model skips its last layer's MLP for the others (none when all are read)
        keep_rows = None if row == len(last_rows) else torch.tensor(last_rows, dtype=torch.long, device=device)
        with forward_context(metadata, self.runner.attn_backend, self.runner.triton_ops):
            hidden = self.model(input_ids, position_ids, keep_rows=keep_rows)  # [len(last_rows), hidden]
        return self.model.compute_logits(hidden)
