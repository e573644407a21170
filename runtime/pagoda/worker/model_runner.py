"""Runs the model over the paged KV cache: keeps each sequence's tokens and block table (updated from
the scheduler's deltas), builds the batch's input tensors and attention metadata, runs the forward
pass and samples."""

import logging
from dataclasses import dataclass

import torch

from pagoda import platform as pagoda_platform
from pagoda.attention import get_backend
from pagoda.config import DEFAULT_CPU_KV_CACHE_GIB, EngineConfig
from pagoda.config.kv_cache import storage_dtype_name
from pagoda.core.kv_cache_groups import kv_cache_groups_for
from pagoda.core.runner_output import ModelRunnerOutput, SampledToken
from pagoda.core.scheduler_output import SchedulerOutput
from pagoda.distributed.parallel_state import get_parallel_state, single_process_state
from pagoda.layers.attention import forward_context
from pagoda.layers.moe import take_expert_tokens
from pagoda.lora.manager import LoRAManager
from pagoda.models.family import layer_windows
from pagoda.ops import cpu_library
from pagoda.process.cpu_allocator import keep_freed_memory
from pagoda.sample.logits_processors import apply_logits_processors
from pagoda.sample.prompt_logprobs import score_scheduled_prompts
from pagoda.sample.rejection_sampler import RejectionSampler, target_probs
from pagoda.sample.sampler import Sampler, SamplingTensors
from pagoda.spec_decode.draft_model import DraftModelProposer
from pagoda.structured_output import get_grammar_backend
from pagoda.worker.cuda_graphs import DecodeGraphs, capture_decode_graphs
from pagoda.worker.gpu_memory import profile_free_gpu_memory
from pagoda.worker.grammars import advance_matchers, mask_grammars
from pagoda.worker.input_batch import InputBatch, RunnerSeq
from pagoda.worker.kv_cache import PagedKVCache
from pagoda.worker.loader.model_loader import build_model
from pagoda.worker.request_kinds import prompt_readers

logger = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class IntermediateTensors:
    """What one pipeline stage hands the next: [num_tokens, hidden] each."""

    hidden: torch.Tensor
    residual: torch.Tensor


class ModelRunner:
    def __init__(self, config: EngineConfig, eos_token_ids: set[int], device: str | None = None):
        self.config = config
        self.device = torch.device(device or config.device)
        state = get_parallel_state()
        self.is_last_stage = state.is_last_stage
        self.samples = state.is_last_stage and state.tp_rank == 0  # the one rank that samples
        self.dtype = TORCH_DTYPES[config.model.dtype]
        # the KV cache's element type: the model's dtype, or fp8 with kv_cache_dtype="fp8" / "fp8_e5m2"
        self.kv_dtype = getattr(torch, storage_dtype_name(config.cache.cache_dtype, config.model.dtype))
        self.block_size = config.cache.block_size
        self.eos_token_ids = eos_token_ids
        hf = config.model.hf_config
        self.vocab_size = hf.vocab_size
        self.attn_backend = get_backend(config.attention_backend)
        self.triton_ops = config.attention_backend == "triton"
        if self.device.type == "cpu":
            keep_freed_memory()
            plan = pagoda_platform.log_cpu_plan(config.model.dtype)  # what runs on this CPU, and why
            if config.attention_backend == "torch" and plan.cpp_kernels:  # built now, not in the first request
                cpu_library.available()
        torch.manual_seed(config.seed)
        self.model = build_model(hf, config.model.path, config.model.quantization, self.dtype, self.device,
                                 config.parallel.pp_layer_partition, config.parallel.enable_expert_parallel)
        self.attention_layers = self.model.attention_layers()
        # LoRA: the adapters' device slots and host copies; each step tells it which rows use which adapter
        self.lora = LoRAManager(self.model, config.lora, self.dtype, self.device) if config.lora else None
        # full and windowed layers: a block table per group, as the engine core's block manager keeps them
        self.kv_cache_groups = kv_cache_groups_for(config, layer_windows(hf))
        self.kv_cache = PagedKVCache(self.attention_layers, self.block_size, self.kv_dtype, self.device,
                                     config.cache.calculate_kv_scales, self.kv_cache_groups)
        self.graphs: DecodeGraphs | None = None  # captured once the KV cache is allocated
        self.kv_connector = None  # P/D: the worker side of kv_transfer_config's connector (pagoda.kv_transfer)
        if config.kv_transfer is not None:
            from pagoda.kv_transfer.factory import create_worker_connector

            self.kv_connector = create_worker_connector(config.kv_transfer, self.block_size,
                                                        state.pp_rank * state.tp_size + state.tp_rank)
        self.batch = InputBatch(self.block_size, self.device)
        self.seqs: dict[int, RunnerSeq] = self.batch.seqs
        self.seq_generators: dict[int, torch.Generator] = {}
        self.shared_generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.sampler = Sampler(self.shared_generator)
        self.readers = prompt_readers()  # the kinds that do not sample: their results at the prompt's end
        self.rejection_sampler = RejectionSampler(self.shared_generator)
        # speculative decoding with a draft model: it proposes each step's drafts on the driver (global
        # rank 0) alone, unsharded, and they travel with the schedule to the other ranks
        self.drafter = None
        if config.draft_model is not None and state.is_first_stage and state.tp_rank == 0:
            draft = config.draft_model
            with single_process_state():
                model = build_model(draft.hf_config, draft.path, None, self.dtype, self.device)
            # the target's kv_cache_dtype applies to the draft's cache too
            draft_cache = PagedKVCache(model.attention_layers(), self.block_size, self.kv_dtype, self.device,
                                       config.cache.calculate_kv_scales)
            self.drafter = DraftModelProposer(self, model, draft_cache, config.seed)

    # --- KV cache -------------------------------------------------------------------------------

    def kv_cache_bytes_per_block(self) -> int:
        # a draft model's cache has as many blocks, under the same block tables: the budget holds both
        draft = self.drafter.kv_cache.bytes_per_block() if self.drafter is not None else 0
        return self.kv_cache.bytes_per_block() + draft

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        return self.kv_cache.caches

    def determine_num_blocks(self) -> int:
        cache = self.config.cache
        if self.device.type == "cuda" and cache.kv_cache_memory_gib is None:
            budget = profile_free_gpu_memory(self)
        else:
            budget = int((cache.kv_cache_memory_gib or DEFAULT_CPU_KV_CACHE_GIB) * 2**30)
        return max(budget // self.kv_cache_bytes_per_block(), 0)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_cache.allocate(num_blocks)
        if self.drafter is not None:
            self.drafter.kv_cache.allocate(num_blocks)
        self.kv_cache.allocate_swap_space(self.config.cache.num_swap_blocks)
        if self.kv_connector is not None:
            self.kv_connector.register_kv_caches(self.kv_cache.caches)
        # decode steps' CUDA graphs, captured over the cache just allocated (None: every step eager)
        if self.kv_cache_groups is not None:
            if self.device.type == "cuda":
                logger.info("KV cache groups: decode steps run eagerly (no CUDA graphs of per-group block tables yet)")
            return
        self.graphs = capture_decode_graphs(
            self.model, self.config, self.device, self.attn_backend, self.triton_ops, self.lora is not None,
            -(-self.config.model.max_model_len // self.block_size), self.attention_layers[0].num_kv_heads)

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
        relearnt = self.batch.apply_deltas(out)
        for seq_id in out.finished_seq_ids:
            self.seq_generators.pop(seq_id, None)
        if self.drafter is not None:  # finished, new to the runner, or its blocks changed: no draft KV kept
            for seq_id in [*out.finished_seq_ids, *relearnt]:
                self.drafter.forget(seq_id)
        for reader in self.readers.values():
            reader.update(out)
        if out.blocks_to_swap_out:
            self.kv_cache.swap_out(out.blocks_to_swap_out)
        if out.blocks_to_swap_in:
            self.kv_cache.swap_in(out.blocks_to_swap_in)
        if out.blocks_to_copy:
            self.kv_cache.copy(out.blocks_to_copy)
            if self.drafter is not None:
                self.drafter.kv_cache.copy(out.blocks_to_copy)
        if self.kv_connector is not None:  # P/D: READ a prefill engine's blocks into the ones just allocated
            self.kv_connector.start_load_kv(out.kv_connector_metadata)
        if self.drafter is not None:
            self.drafter.propose(out, self.seqs)

    @torch.inference_mode()
    def run_step(self, out: SchedulerOutput, intermediate: IntermediateTensors | None = None
                 ) -> ModelRunnerOutput | IntermediateTensors | None:
        """The second half of execute: the forward pass, then sampling and verification."""
        if self.kv_connector is not None:
            self.kv_connector.wait_for_layer_load(0)
        result = self._run_step(out, intermediate)
        if self.kv_connector is not None:
            connector_output = self.kv_connector.get_finished()
            state = get_parallel_state()
            if out.kv_connector_metadata is not None and state.tp_size * state.pp_size > 1:
                from pagoda.kv_transfer.ranks import merge_step_output

                # a load is done when every rank's READ is: the TP ranks', and the earlier stages'
                connector_output = merge_step_output(connector_output, out.kv_connector_metadata, state,
                                                     self.is_last_stage)
            if isinstance(result, ModelRunnerOutput) and connector_output is not None:
                result.kv_connector_output = connector_output  # its KV never came: the request fails, it alone
                result.failed.update(connector_output.failed_recving)
        if self.samples and isinstance(result, ModelRunnerOutput):
            result.expert_tokens = take_expert_tokens(self.model)  # MoE load balance, for the stats
        return result

    def _run_step(self, out: SchedulerOutput, intermediate: IntermediateTensors | None = None
                  ) -> ModelRunnerOutput | IntermediateTensors | None:
        if out.is_empty:
            return ModelRunnerOutput() if self.is_last_stage else None
        drafts = {s.seq_id: s.draft_token_ids for s in out.scheduled if s.draft_token_ids}
        step = self.batch.prepare(out, drafts)
        sample_rows = step.sample_rows
        hidden_in = residual_in = None
        if intermediate is not None:
            hidden_in, residual_in = intermediate.hidden, intermediate.residual
        keep_rows = self._rows_read(out, sample_rows, len(step.input_ids))
        if keep_rows is not None:  # hidden's rows become keep_rows'
            row_of = {row: i for i, row in enumerate(keep_rows)}
            sample_rows = [row_of[row] for row in sample_rows]
            keep_rows = torch.tensor(keep_rows, dtype=torch.long, device=self.device)
        lora_failed: dict[int, str] = {}
        if self.lora is not None:
            adapters = [self.seqs[s.seq_id].lora_request for s in out.scheduled]
            failures = self.lora.prepare(adapters, [s.num_new_tokens for s in out.scheduled], keep_rows)
            lora_failed = {s.seq_id: failures[a.lora_int_id] for s, a in zip(out.scheduled, adapters)
                           if a is not None and a.lora_int_id in failures}
        hidden = None
        if self.graphs is not None and intermediate is None and keep_rows is None:
            hidden = self.graphs.run(step.input_ids, step.positions, step.metadata)  # None: not a graph's step
        if hidden is None:
            with forward_context(step.metadata, self.attn_backend, self.triton_ops):
                hidden = self.model(step.input_ids, step.positions, hidden_in, residual_in, keep_rows=keep_rows)
        if not self.is_last_stage:
            return IntermediateTensors(*hidden)
        prompt_logprobs = score_scheduled_prompts(out, self.seqs, hidden, self.model.compute_logits,
                                                  self.samples)
        results = {}
        sample_seq_ids = step.sample_seq_ids
        if self._reading():  # kinds that do not sample are read where they would sample (every rank alike)
            if self.samples:
                for reader in self.readers.values():
                    results.update(reader.read(out, hidden))
            keep = [i for i, seq_id in enumerate(sample_seq_ids) if self.seqs[seq_id].kind.samples]
            sample_rows, sample_seq_ids = [sample_rows[i] for i in keep], [sample_seq_ids[i] for i in keep]
        if not sample_rows:
            return ModelRunnerOutput(prompt_logprobs=prompt_logprobs, results=results, failed=lora_failed)
        logits = self.model.compute_logits(hidden[sample_rows])  # every TP rank: the gather is collective
        if not self.samples:
            return ModelRunnerOutput()
        result = ModelRunnerOutput(prompt_logprobs=prompt_logprobs, results=results, failed=lora_failed)
        generators = self._generators(sample_seq_ids, result.failed)
        advance_matchers(self.seqs, sample_seq_ids, result.failed, self._grammar_backend)
        # one pass over the rows: a failed sequence's are dropped, a drafting one's verified, the rest sampled
        verify, plain = [], []
        for i, seq_id in enumerate(sample_seq_ids):
            if seq_id not in result.failed:
                (verify if seq_id in drafts else plain).append(i)
        if verify:
            self._verify(logits[verify], [sample_seq_ids[i] for i in verify], [generators[i] for i in verify],
                         out, result)
        if not plain:
            return result
        if len(plain) < len(sample_seq_ids):
            logits, generators = logits[plain], [generators[i] for i in plain]
            sample_seq_ids = [sample_seq_ids[i] for i in plain]
        masked = mask_grammars(logits, self.seqs, sample_seq_ids, self._grammar_backend)
        seqs = [self.seqs[i] for i in sample_seq_ids]
        # the model's logits stay untouched only while some row still needs them for its logprobs
        writable = masked is not logits or all(q.params.logprobs is None for q in seqs)
        masked = apply_logits_processors(masked, [q.params for q in seqs],
                                         [q.token_ids[q.num_prompt_tokens:] for q in seqs], in_place=writable)
        # logprobs stay the model's own (raw): a masked-out token's is finite, never -inf
        tokens = self.sampler(masked, self.sampling_tensors(sample_seq_ids, generators),
                              raw_logits=logits if masked is not logits else None)
        for seq_id, token in zip(sample_seq_ids, tokens):
            result.sampled.setdefault(seq_id, []).append(token)
            self.seqs[seq_id].last_sampled = token.token_id
        return result

    def _rows_read(self, out: SchedulerOutput, sample_rows: list[int], num_rows: int) -> list[int] | None:
        """The rows of the last stage's hidden this step reads, ascending, when they are fewer than all: the
        model then skips the last layer's output projection and MLP for the others (a prompt's rows but its
        last: ~3 % of a prefill). None when every row is read, or may be: prompt logprobs, a kind's reader."""
        if not self.is_last_stage or self._reading():
            return None
        rows = list(dict.fromkeys(sample_rows))  # sample_rows ascend; a row sampled n times appears n times
        if len(rows) == num_rows:  # every decode step: decided before looking at each sequence
            return None
        if any(self.seqs[s.seq_id].params.prompt_logprobs is not None for s in out.scheduled):
            return None
        return rows

    def _reading(self) -> bool:
        return any(reader.active for reader in self.readers.values())

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
        probs, row_greedy = target_probs(self.sampler, logits, self.sampling_tensors(seq_ids, generators))
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

    def _grammar_backend(self):
        eos = tuple(sorted(self.eos_token_ids))
        return get_grammar_backend(self.config.model.tokenizer_path, self.vocab_size, eos)

    def new_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def sampling_tensors(self, seq_ids: list[int], generators: list) -> SamplingTensors:
        return SamplingTensors.build([self.seqs[i] for i in seq_ids], generators, self.vocab_size,
                                     self.eos_token_ids, self.device)
