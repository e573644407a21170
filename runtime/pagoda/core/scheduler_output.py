"""What the scheduler hands the model runner each step (torch-free: it crosses processes pickled)."""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from pagoda.core.request_kind import RequestParams
from pagoda.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagoda.lora.request import LoRARequest


@dataclass
class ScheduledSeq:
    seq_id: int
    num_new_tokens: int  # tokens to compute this step
    num_computed_tokens: int  # tokens whose KV is already cached, before this step
    new_token_ids: list[int]  # tokens the runner has not seen yet (all of them on reset)
    block_ids_start: int  # the runner's block table from this index on is replaced by block_ids
    block_ids: list[int]
    num_samples: int  # 0 mid-prompt; 1 normally; n where a request forks into n at the end of its prompt
    reset: bool = False  # new to the runner (or resumed after preemption): forget what it had
    # async scheduling: scheduled while its previous step ran; its input is the token that step samples, which
    # the runner appends itself (not in new_token_ids)
    placeholder: bool = False
    num_prompt_tokens: int = 0
    params: SamplingParams | None = None  # what it samples with (sent on reset only)
    # the request's own parameters, which name its kind (core.request_kind; sent on reset only): for a
    # generation, params itself (pickled once)
    request_params: RequestParams | None = None
    lora_request: "LoRARequest | None" = None  # its adapter (sent on reset only); None: the base model
    # speculative decoding: the last num_draft_tokens of the num_new_tokens are drafts to verify (not in
    # new_token_ids); their ids here: the scheduler's (n-gram), or None until the driver's draft model fills
    # them in, before the batch goes on to the other ranks
    num_draft_tokens: int = 0
    draft_token_ids: list[int] | None = None
    # [num_draft_tokens, V] float32: the distributions the draft model drew them from, for a request that
    # samples; None where each draft is a point mass (n-gram drafts, greedy requests)
    draft_probs: np.ndarray | None = None
    # KV cache groups (core.kv_cache_groups): each further group's table from block_ids_start on, as block_ids
    # is the first group's; None: one table serves every layer
    group_block_ids: list[list[int]] | None = None


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    # swap space; the runner does them in this order, before the forward pass: out, in, copy
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    finished_seq_ids: list[int] = field(default_factory=list)  # the runner may drop their state
    kv_connector_metadata: object = None  # P/D: the KV connector's loads for this step (kv_transfer)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_decodes(self) -> int:
        """Sequences computing one token (a decode; rarely a prompt's last token)."""
        return sum(1 for s in self.scheduled if s.num_new_tokens == 1)

    @property
    def decode_context_tokens(self) -> int:
        """The KV positions the decodes read in all (their contexts): what a decode step's attention reads."""
        return sum(s.num_computed_tokens for s in self.scheduled if s.num_new_tokens == 1)

    @property
    def is_empty(self) -> bool:
        """Nothing to compute (swap copies may still be due: see has_work)."""
        return not self.scheduled

    @property
    def has_work(self) -> bool:
        return bool(self.scheduled or self.finished_seq_ids or self.blocks_to_swap_out or self.blocks_to_swap_in)
