"""What one model step hands back to the engine core (torch-free: it crosses processes pickled)."""

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None  # raw model logprob of the sampled token
    rank: int | None = None
    top_token_ids: list[int] | None = None
    top_logprobs: list[float] | None = None


@dataclass
class ModelRunnerOutput:
    # seq id -> its new tokens: one, or n at the end of an n > 1 prompt (the forks' first tokens)
    sampled: dict[int, list[SampledToken]] = field(default_factory=dict)
    # seq id -> what verifying its drafts gave: the accepted draft tokens, then one the target sampled
    verified: dict[int, list[SampledToken]] = field(default_factory=dict)
    # seq id -> why this step failed for it alone: its request is finished with an error, the rest go on
    failed: dict[int, str] = field(default_factory=dict)
    # seq id -> (position of the first prompt token scored, each token's logprobs from there): the prompt
    # tokens this step's chunk predicted, for requests with prompt_logprobs (token 0 is never scored)
    prompt_logprobs: dict[int, tuple[int, list[SampledToken]]] = field(default_factory=dict)
    # seq id -> the result of a request of a kind that does not sample (an embedding: list[float]), whose
    # prompt ended this step; the request is finished with it (core.request_kind)
    results: dict[int, Any] = field(default_factory=dict)
    # MoE layer index -> rows routed to each of its experts this step (the sampling rank's layers)
    expert_tokens: dict[int, list[int]] = field(default_factory=dict)
    kv_connector_output: Any = None  # P/D: the KV connector's finished and failed loads (kv_transfer.base)
