"""Runs the model over the paged KV cache: keeps each sequence's tokens and block table (updated from
the scheduler's deltas), builds the batch's input tensors and attention metadata, runs the forward
pass and samples."""

import logging
from dataclasses import dataclass

import numpy as np
import torch

from pagoda import cpp_extensions
from pagoda.attention import AttentionMetadata, cpu_kernels, get_backend
from pagoda.config import DEFAULT_CPU_KV_CACHE_GIB, EngineConfig
from pagoda.cpu_allocator import keep_freed_memory
from pagoda.distributed.parallel_state import get_parallel_state, single_process_state
from pagoda.layers import bf16_matmul_cpu, fused_cpu_ops
from pagoda.layers.attention import forward_context
from pagoda.layers.moe import take_expert_tokens
from pagoda.layers.packed_weights import pack_weights, packing_supported
from pagoda.logits_processors import apply_logits_processors
from pagoda.model_loader import load_weights
from pagoda.models import get_model_class, llama_layers_cpu
from pagoda.pooler import Pooler
from pagoda.prompt_logprobs import score_prompt_tokens
from pagoda.runner_output import ModelRunnerOutput, SampledToken
from pagoda.sampler import Sampler, SamplingTensors
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler_output import SchedulerOutput
from pagoda.spec_decode.draft_model import DraftModelProposer
from pagoda.spec_decode.rejection_sampler import RejectionSampler, target_probs
from pagoda.structured_output import GrammarMatcher, apply_bitmask, get_grammar_backend

logger = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class IntermediateTensors:
    """What one pipeline stage hands the next: [num_tokens, hidden] each."""

    hidden: torch.Tensor
    residual: torch.Tensor


@dataclass
class RunnerSeq:
    token_ids: list[int]
    block_table: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    matcher: GrammarMatcher | None = None  # structured outputs: made on first sample, follows token_ids


class ModelRunner:
    def __init__(self, config: EngineConfig, eos_token_ids: set[int], device: str | None = None):
        self.config = config
        self.device = torch.device(device or config.device)
        state = get_parallel_state()
        self.is_last_stage = state.is_last_stage
        self.samples = state.is_last_stage and state.tp_rank == 0  # the one rank that samples
        self.dtype = TORCH_DTYPES[config.model.dtype]
        self.block_size = config.cache.block_size
        self.eos_token_ids = eos_token_ids
        hf = config.model.hf_config
        self.vocab_size = hf.vocab_size
        self.attn_backend = get_backend(config.attention_backend)
        self.triton_ops = config.attention_backend == "triton"
        if self.device.type == "cpu":
            keep_freed_memory()
            if config.attention_backend == "torch":  # build the C++ kernels now, not inside the first request
                # bfloat16 matmuls, and the Llama layer loop that calls them
                matmul = [bf16_matmul_cpu.available, llama_layers_cpu.build] \
                    if packing_supported(self.device, self.dtype) else []
                cpp_extensions.build_concurrently(cpu_kernels.available, fused_cpu_ops.available, *matmul)
        torch.manual_seed(config.seed)
        self.model = self._load_model(hf, config.model.path, config.model.quantization,
                                      config.parallel.pp_layer_partition, config.parallel.enable_expert_parallel)
        self.attention_layers = self.model.attention_layers()
        self.kv_caches: list[torch.Tensor] = []
        self.swap_caches: list[torch.Tensor] = []  # host copies of swapped-out blocks, one per layer
        self.seqs: dict[int, RunnerSeq] = {}
        self.seq_generators: dict[int, torch.Generator] = {}
        self.shared_generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.sampler = Sampler(self.shared_generator)
        self.pooler = Pooler()
        self.rejection_sampler = RejectionSampler(self.shared_generator)
        # speculative decoding with a draft model: it proposes each step's drafts on the driver (global
        # rank 0) alone, unsharded, and they travel with the schedule to the other ranks
        self.drafter = None
        if config.draft_model is not None and state.is_first_stage and state.tp_rank == 0:
            draft = config.draft_model
            with single_process_state():
                model = self._load_model(draft.hf_config, draft.path, None, None)
            self.drafter = DraftModelProposer(self, model, config.seed)

    def _load_model(self, hf_config, path: str, quantization, pp_layer_partition, expert_parallel=False):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model_class = get_model_class(hf_config.architectures[0])
                model = model_class(hf_config, pp_layer_partition, expert_parallel=expert_parallel)
        finally:
            torch.set_default_dtype(previous)
        load_weights(model, path, quantization)
        model.eval()
        if packing_supported(self.device, self.dtype):
            pack_weights(model)
        return model

    # --- KV cache -------------------------------------------------------------------------------

    def kv_cache_bytes_per_block(self) -> int:
        layer = self.attention_layers[0]
        per_layer = 2 * self.block_size * layer.num_kv_heads * layer.head_size * self.dtype.itemsize
        # a draft model's cache has as many blocks, under the same block tables: the budget holds both
        draft = self.drafter.kv_cache_bytes_per_block() if self.drafter is not None else 0
        return per_layer * len(self.attention_layers) + draft

    def determine_num_blocks(self) -> int:
        cache = self.config.cache
        if self.device.type == "cuda" and cache.kv_cache_memory_gib is None:
            budget = self._profile_free_gpu_memory()
        else:
            budget = int((cache.kv_cache_memory_gib or DEFAULT_CPU_KV_CACHE_GIB) * 2**30)
        return max(budget // self.kv_cache_bytes_per_block(), 0)

    def _profile_free_gpu_memory(self) -> int:
        """gpu_memory_utilization of the device minus the peak of a forward pass at the full budget."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        sched = self.config.scheduler
        num_tokens = min(sched.max_num_batched_tokens, sched.max_model_len * sched.max_num_seqs)
        seq_len = min(num_tokens, sched.max_model_len)
        lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
        metadata = self._metadata(lens, lens, [[]] * len(lens), torch.full((num_tokens,), -1))
        hidden_in = residual_in = None
        if not self.model.model.is_first:  # a later pipeline stage starts from hidden states
            hidden_in = torch.zeros(num_tokens, self.model.config.hidden_size, dtype=self.dtype, device=self.device)
            residual_in = torch.zeros_like(hidden_in)
        with torch.inference_mode(), forward_context(metadata, self.attn_backend, self.triton_ops):
            hidden = self.model(input_ids, positions, hidden_in, residual_in)
            if self.is_last_stage:
                self.model.compute_logits(hidden[-sched.max_num_seqs :])
        take_expert_tokens(self.model)  # not a request's routing
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        total = torch.cuda.get_device_properties(self.device).total_memory
        budget = int(total * self.config.cache.gpu_memory_utilization) - peak
        logger.info("GPU memory: %.2f GiB total, %.2f GiB peak in the profiling pass, %.2f GiB for the KV cache",
                    total / 2**30, peak / 2**30, budget / 2**30)
        torch.cuda.empty_cache()
        return max(budget, 0)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = []
        for layer in self.attention_layers:
            # head-major in memory, [2, num_blocks, num_kv_heads, block_size, head_size], so one head's block
            # is contiguous (long copies when decode gathers it); the attention backends see it through
            # the [2, num_blocks, block_size, num_kv_heads, head_size] view and honour its strides
            cache = torch.zeros(2, num_blocks, layer.num_kv_heads, self.block_size, layer.head_size,
                                dtype=self.dtype, device=self.device).transpose(2, 3)
            layer.kv_cache = cache
            self.kv_caches.append(cache)
        if self.drafter is not None:
            self.drafter.allocate_kv_cache(num_blocks)
        self.allocate_swap_space(self.config.cache.num_swap_blocks)

    def allocate_swap_space(self, num_swap_blocks: int) -> None:
        """The host pool, laid out as the device cache. Pinned on a GPU (asynchronous copies); on a CPU a
        separate tensor pool. torch.empty: pages are committed only when a block is first swapped out."""
        self.swap_caches = []
        if num_swap_blocks == 0:
            return
        pin = self.device.type == "cuda"
        for layer in self.attention_layers:
            # [2, num_swap_blocks, block_size, num_kv_heads, head_size] (head-major in memory, as the cache)
            host = torch.empty(2, num_swap_blocks, layer.num_kv_heads, self.block_size, layer.head_size,
                               dtype=self.dtype, device="cpu", pin_memory=pin).transpose(2, 3)
            self.swap_caches.append(host)
        logger.info("swap space: %d blocks, %.2f GiB of host memory", num_swap_blocks,
                    num_swap_blocks * self.kv_cache_bytes_per_block() / 2**30)

    def _swap_out(self, pairs: list[tuple[int, int]]) -> None:
        device_ids = torch.tensor([p[0] for p in pairs], device=self.device)
        host_ids = torch.tensor([p[1] for p in pairs])
        for cache, host in zip(self.kv_caches, self.swap_caches):
            host[:, host_ids] = cache[:, device_ids].to("cpu")

    def _swap_in(self, pairs: list[tuple[int, int]]) -> None:
        host_ids = torch.tensor([p[0] for p in pairs])
        device_ids = torch.tensor([p[1] for p in pairs], device=self.device)
        for cache, host in zip(self.kv_caches, self.swap_caches):
            cache[:, device_ids] = host[:, host_ids].to(self.device, non_blocking=True)

    # --- one step ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, intermediate: IntermediateTensors | None = None
                ) -> ModelRunnerOutput | IntermediateTensors | None:
        """Run this stage's layers over the scheduled tokens. The last stage returns the sampled tokens of
        every sequence that sampled; earlier stages return what the next stage needs (None if empty)."""
        self.start_step(out)
        return self.run_step(out, intermediate)

    @torch.inference_mode()
    def start_step(self, out: SchedulerOutput) -> None:
        """The first half of execute: bring the sequences and caches up to out (deltas, swaps, copies).
        With the draft model (the driver), also fill in out's drafts: the driver calls this before it
        passes out to the other ranks, then run_step."""
        self._apply_deltas(out)
        self.pooler.update(out)
        if out.blocks_to_swap_out:
            self._swap_out(out.blocks_to_swap_out)
        if out.blocks_to_swap_in:
            self._swap_in(out.blocks_to_swap_in)
        if out.blocks_to_copy:
            self._copy_blocks(out.blocks_to_copy)
        if self.drafter is not None:
            self.drafter.propose(out, self.seqs)

    @torch.inference_mode()
    def run_step(self, out: SchedulerOutput, intermediate: IntermediateTensors | None = None
                 ) -> ModelRunnerOutput | IntermediateTensors | None:
        """The second half of execute: the forward pass, then sampling and verification."""
        result = self._run_step(out, intermediate)
        if self.samples and isinstance(result, ModelRunnerOutput):
            result.expert_tokens = take_expert_tokens(self.model)  # MoE load balance, for the stats
        return result

    def _run_step(self, out: SchedulerOutput, intermediate: IntermediateTensors | None = None
                  ) -> ModelRunnerOutput | IntermediateTensors | None:
        if out.is_empty:
            return ModelRunnerOutput() if self.is_last_stage else None
        drafts = {s.seq_id: s.draft_token_ids for s in out.scheduled if s.draft_token_ids}
        input_ids, positions, metadata, sample_rows, sample_seq_ids = self._prepare(out, drafts)
        hidden_in = residual_in = None
        if intermediate is not None:
            hidden_in, residual_in = intermediate.hidden, intermediate.residual
        keep_rows = self._rows_read(out, sample_rows, len(input_ids))
        if keep_rows is not None:  # hidden's rows become keep_rows'
            row_of = {row: i for i, row in enumerate(keep_rows)}
            sample_rows = [row_of[row] for row in sample_rows]
            keep_rows = torch.tensor(keep_rows, dtype=torch.long, device=self.device)
        with forward_context(metadata, self.attn_backend, self.triton_ops):
            hidden = self.model(input_ids, positions, hidden_in, residual_in, keep_rows=keep_rows)
        if not self.is_last_stage:
            return IntermediateTensors(*hidden)
        prompt_logprobs = self._prompt_logprobs(out, hidden)
        pooled = {}
        if self.pooler.states:  # embedding requests pool where they would sample (on every rank alike)
            pooled = self.pooler.pool(out, hidden) if self.samples else {}
            keep = [i for i, seq_id in enumerate(sample_seq_ids) if not self.pooler.is_pooling(seq_id)]
            sample_rows, sample_seq_ids = [sample_rows[i] for i in keep], [sample_seq_ids[i] for i in keep]
        if not sample_rows:
            return ModelRunnerOutput(prompt_logprobs=prompt_logprobs, pooled=pooled)
        logits = self.model.compute_logits(hidden[sample_rows])  # every TP rank: the gather is collective
        if not self.samples:
            return ModelRunnerOutput()
        result = ModelRunnerOutput(prompt_logprobs=prompt_logprobs, pooled=pooled)
        generators = self._generators(sample_seq_ids, result.failed)
        self._advance_matchers(sample_seq_ids, result.failed)
        if result.failed:  # sample the others only
            keep = [i for i, seq_id in enumerate(sample_seq_ids) if seq_id not in result.failed]
            logits, generators = logits[keep], [generators[i] for i in keep]
            sample_seq_ids = [sample_seq_ids[i] for i in keep]
            if not sample_seq_ids:
                return result
        if drafts:  # the rows of sequences with drafts are verified; the others sampled as usual
            verify = [i for i, seq_id in enumerate(sample_seq_ids) if seq_id in drafts]
            self._verify(logits[verify], [sample_seq_ids[i] for i in verify], [generators[i] for i in verify],
                         out, result)
            keep = [i for i, seq_id in enumerate(sample_seq_ids) if seq_id not in drafts]
            logits, generators = logits[keep], [generators[i] for i in keep]
            sample_seq_ids = [sample_seq_ids[i] for i in keep]
            if not sample_seq_ids:
                return result
        masked = self._mask_grammars(logits, sample_seq_ids)
        seqs = [self.seqs[i] for i in sample_seq_ids]
        # the model's logits stay untouched only while some row still needs them for its logprobs
        writable = masked is not logits or all(q.params.logprobs is None for q in seqs)
        masked = apply_logits_processors(masked, [q.params for q in seqs],
                                         [q.token_ids[q.num_prompt_tokens:] for q in seqs], in_place=writable)
        # logprobs stay the model's own (raw): a masked-out token's is finite, never -inf
        tokens = self.sampler(masked, self._sampling_tensors(sample_seq_ids, generators),
                              raw_logits=logits if masked is not logits else None)
        for seq_id, token in zip(sample_seq_ids, tokens):
            result.sampled.setdefault(seq_id, []).append(token)
        return result

    def _rows_read(self, out: SchedulerOutput, sample_rows: list[int], num_rows: int) -> list[int] | None:
        """The rows of the last stage's hidden this step reads, ascending, when they are fewer than all: the
        model then skips the last layer's output projection and MLP for the others (a prompt's rows but its
        last: ~3 % of a prefill). None when every row is read, or may be: prompt logprobs, pooling."""
        if not self.is_last_stage or self.pooler.states:
            return None
        rows = list(dict.fromkeys(sample_rows))  # sample_rows ascend; a row sampled n times appears n times
        if len(rows) == num_rows:  # every decode step: decided before looking at each sequence
            return None
        if any(self.seqs[s.seq_id].params.prompt_logprobs is not None for s in out.scheduled):
            return None
        return rows

    def _prompt_logprobs(self, out: SchedulerOutput, hidden: torch.Tensor) -> dict[int, tuple[int, list]]:
        """The logprobs of the prompt tokens this step's chunks predict, for sequences that asked. Hidden row
        of position p predicts the token at p + 1; a chunk ending mid-prompt leaves its last token's score
        to the next chunk, which starts with it. Every TP rank computes the logits (a collective gather)."""
        result: dict[int, tuple[int, list]] = {}
        row = 0
        for s in out.scheduled:
            seq = self.seqs[s.seq_id]
            k = seq.params.prompt_logprobs
            start = s.num_computed_tokens
            stop = min(start + s.num_new_tokens, seq.num_prompt_tokens - 1)  # the last prompt row predicts output
            if k is not None and stop > start:
                targets = seq.token_ids[start + 1 : stop + 1]
                scored = score_prompt_tokens(self.model.compute_logits, hidden[row : row + stop - start], targets, k,
                                             self.samples)
                if self.samples:
                    result[s.seq_id] = (start + 1, scored)
            row += s.num_new_tokens
        return result

    def _verify(self, logits: torch.Tensor, seq_ids: list[int], generators: list, out: SchedulerOutput,
                result: ModelRunnerOutput) -> None:
        """logits [R, V]: k + 1 consecutive rows per sequence with k drafts -> result.verified."""
        if not seq_ids:
            return
        firsts = [i for i, seq_id in enumerate(seq_ids) if i == 0 or seq_ids[i - 1] != seq_id]
        order = [seq_ids[i] for i in firsts]
        scheduled = {s.seq_id: s for s in out.scheduled}
        if any(self.seqs[seq_id].params.uses_logits_processors for seq_id in order):
            # row j of a sequence comes after its drafts 0..j-1: they count for bad_words as generated tokens
            first_row = {seq_ids[i]: i for i in firsts}
            before = [scheduled[seq_id].draft_token_ids[: i - first_row[seq_id]] for i, seq_id in enumerate(seq_ids)]
            logits = self.apply_processors_after_drafts(logits, seq_ids, before)  # a copy (logits[verify])
        probs, row_greedy = target_probs(self.sampler, logits, self._sampling_tensors(seq_ids, generators))
        draft_probs = [None if scheduled[seq_id].draft_probs is None
                       else torch.from_numpy(scheduled[seq_id].draft_probs).to(self.device) for seq_id in order]
        runs = self.rejection_sampler(probs, [scheduled[seq_id].draft_token_ids for seq_id in order], draft_probs,
                                      [row_greedy[i] for i in firsts], [generators[i] for i in firsts])
        for seq_id, run in zip(order, runs):
            result.verified[seq_id] = [SampledToken(token) for token in run]

    def apply_processors_after_drafts(self, logits: torch.Tensor, seq_ids: list[int],
                                      drafts_before: list[list[int]]) -> torch.Tensor:
        """Speculative rows: logits [N, V], row i predicting what follows seq_ids[i]'s tokens and then
        drafts_before[i] -> with each row's logits processors applied, in place (the same tensor when
        no row uses any)."""
        seqs = [self.seqs[seq_id] for seq_id in seq_ids]
        if not any(q.params.uses_logits_processors for q in seqs):
            return logits
        outputs = [q.token_ids[q.num_prompt_tokens :] + drafts for q, drafts in zip(seqs, drafts_before)]
        return apply_logits_processors(logits, [q.params for q in seqs], outputs, in_place=True)

    def _generators(self, seq_ids: list[int], failed: dict[int, str]) -> list[torch.Generator | None]:
        """Each seeded sequence's own generator (made on its first sample). A failure here concerns one
        sequence: it is reported in `failed` and the batch goes on without it."""
        generators = []
        for seq_id in seq_ids:
            seed = self.seqs[seq_id].params.seed
            gen = None
            if seed is not None:
                gen = self.seq_generators.get(seq_id)
                if gen is None:
                    try:
                        gen = self.new_generator(seed)
                    except Exception as e:  # noqa: BLE001 - handed to the engine as this sequence's failure
                        failed[seq_id] = f"seeding its generator failed: {e!r}"
                    else:
                        self.seq_generators[seq_id] = gen
            generators.append(gen)
        return generators

    def _advance_matchers(self, seq_ids: list[int], failed: dict[int, str]) -> None:
        """Bring each constrained sequence's matcher up to its tokens. A matcher is made fresh when the runner
        (re)learns a sequence (new, resumed after preemption, or a fork) and replays its output tokens, so
        it always follows the sequence's own tokens."""
        for seq_id in dict.fromkeys(seq_ids):
            seq = self.seqs[seq_id]
            spec = seq.params.structured_outputs
            if spec is None or seq_id in failed:
                continue
            try:
                if seq.matcher is None:
                    seq.matcher = self._grammar_backend().matcher(spec)
                for token in seq.token_ids[seq.num_prompt_tokens + seq.matcher.num_accepted:]:
                    if not seq.matcher.accept(token):
                        failed[seq_id] = f"token {token} does not follow its grammar"
                        break
            except Exception as e:  # noqa: BLE001 - handed to the engine as this sequence's failure
                failed[seq_id] = f"following its grammar failed: {e!r}"

    def _mask_grammars(self, logits: torch.Tensor, seq_ids: list[int]) -> torch.Tensor:
        """logits [N, V] -> float32 [N, V] with the constrained rows masked by their grammars in one operation
        (a copy: the raw logits still give logprobs); the same tensor when no row is constrained."""
        rows = [i for i, seq_id in enumerate(seq_ids) if self.seqs[seq_id].matcher is not None]
        if not rows:
            return logits
        bitmask = self._grammar_backend().allocate_bitmask(len(seq_ids))  # [N, ceil(V / 32)] int32
        for row in rows:
            self.seqs[seq_ids[row]].matcher.fill_bitmask(bitmask, row)
        masked = logits.float().clone()
        apply_bitmask(masked, bitmask, rows)
        return masked

    def _grammar_backend(self):
        eos = tuple(sorted(self.eos_token_ids))
        return get_grammar_backend(self.config.model.tokenizer_path, self.vocab_size, eos)

    def new_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def _apply_deltas(self, out: SchedulerOutput) -> None:
        for seq_id in out.finished_seq_ids:
            self.seqs.pop(seq_id, None)
            self.seq_generators.pop(seq_id, None)
            if self.drafter is not None:
                self.drafter.forget(seq_id)
        for s in out.scheduled:
            if s.reset:
                if self.drafter is not None:  # new to the runner, or its blocks changed: no draft KV kept
                    self.drafter.forget(s.seq_id)
                self.seqs[s.seq_id] = RunnerSeq(list(s.new_token_ids), list(s.block_ids), s.num_prompt_tokens,
                                                s.params)
                continue
            seq = self.seqs[s.seq_id]
            seq.token_ids.extend(s.new_token_ids)
            del seq.block_table[s.block_ids_start :]
            seq.block_table.extend(s.block_ids)

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        for cache in self.kv_caches + (self.drafter.kv_caches if self.drafter is not None else []):
            cache[:, dst] = cache[:, src]

    def _prepare(self, out: SchedulerOutput, drafts: dict[int, list[int]] | None = None):
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
            num_drafts = s.num_draft_tokens if drafts and s.seq_id in drafts else 0
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
        metadata = self._metadata(query_lens, seq_lens, tables, slots)
        return input_ids, positions, metadata, sample_rows, sample_seq_ids

    def _metadata(self, query_lens, seq_lens, tables, slot_mapping) -> AttentionMetadata:
        max_blocks = max(1, max(len(t) for t in tables))
        block_tables = np.zeros((len(tables), max_blocks), dtype=np.int32)
        for i, t in enumerate(tables):
            block_tables[i, : len(t)] = t
        query_start_loc = np.zeros(len(query_lens) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start_loc[1:])
        to = lambda a: torch.from_numpy(np.asarray(a)).to(self.device)  # noqa: E731
        return AttentionMetadata(
            query_start_loc=to(query_start_loc),
            seq_lens=to(np.asarray(seq_lens, dtype=np.int32)),
            block_tables=to(block_tables),
            slot_mapping=slot_mapping.to(self.device),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
        )

    def _sampling_tensors(self, seq_ids: list[int], generators: list) -> SamplingTensors:
        seqs = [self.seqs[i] for i in seq_ids]
        params = [s.params for s in seqs]
        vocab = self.vocab_size
        f32 = lambda xs: torch.tensor(xs, dtype=torch.float32, device=self.device)  # noqa: E731
        any_penalty = any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in params)
        prompt_ids = output_ids = None
        if any_penalty:
            prompt_ids = _padded([s.token_ids[: s.num_prompt_tokens] for s in seqs], vocab, self.device)
            output_ids = _padded([s.token_ids[s.num_prompt_tokens :] for s in seqs], vocab, self.device)
        banned = []
        for row, (s, p) in enumerate(zip(seqs, params)):
            # a grammar decides when a constrained output ends: min_tokens yields to it
            if len(s.token_ids) - s.num_prompt_tokens < p.min_tokens and s.matcher is None:
                stops = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
                banned += [(row, t) for t in stops if t < vocab]
        return SamplingTensors(
            temperature=f32([p.temperature for p in params]),
            top_p=f32([p.top_p for p in params]),
            top_k=torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=self.device),
            min_p=f32([p.min_p for p in params]),
            presence_penalty=f32([p.presence_penalty for p in params]),
            frequency_penalty=f32([p.frequency_penalty for p in params]),
            repetition_penalty=f32([p.repetition_penalty for p in params]),
            prompt_token_ids=prompt_ids,
            output_token_ids=output_ids,
            banned_tokens=banned,
            generators=generators,
            num_logprobs=[p.logprobs for p in params],
            all_greedy=all(p.greedy for p in params),
            any_top_k=any(p.top_k > 0 for p in params),
            any_top_p=any(p.top_p < 1.0 for p in params),
            any_min_p=any(p.min_p > 0 for p in params),
            any_penalty=any_penalty,
        )


def _padded(rows: list[list[int]], pad: int, device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    out = np.full((len(rows), width), pad, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return torch.from_numpy(out).to(device)
