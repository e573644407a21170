"""Speculative decoding counters (torch-free), as vLLM's spec_decode metrics."""

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_speculative_tokens: int = 0  # k: the longest draft
    num_drafts: int = 0  # verification steps (one per sequence that had drafts)
    num_draft_tokens: int = 0  # tokens proposed
    num_accepted_tokens: int = 0  # drafts the target accepted
    accepted_per_pos: list[int] = field(default_factory=list)  # [k]: drafts accepted at position i

    def __post_init__(self) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.num_speculative_tokens

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    def merged(self, other: "SpecDecodeStats") -> "SpecDecodeStats":
        k = max(self.num_speculative_tokens, other.num_speculative_tokens)
        per_pos = [0] * k
        for counts in (self.accepted_per_pos, other.accepted_per_pos):
            for pos, n in enumerate(counts):
                per_pos[pos] += n
        return SpecDecodeStats(k, self.num_drafts + other.num_drafts,
                               self.num_draft_tokens + other.num_draft_tokens,
                               self.num_accepted_tokens + other.num_accepted_tokens, per_pos)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification step: 1 (the target's own) + accepted drafts."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
