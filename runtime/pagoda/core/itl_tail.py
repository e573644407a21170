"""The share of token gaps a burst of prompts may delay. Pure Python, no torch.

Under ``--target-itl-ms auto`` a step beside running decodes takes what the latency target leaves. When more
prompt tokens wait than that, a step may instead take all of ``max_num_batched_tokens`` (prefill-first's step,
the fastest way to first tokens) if the token gaps it delays, one per running decode, with those delayed
before, stay within ``share`` of the gaps the engine has given since it was last idle and the present sequences
will still give. ITL p99 pools every gap of a load and leaves 1 % of them to the slowest steps; the default share
gives a fifth of that to bursts (the rest to the steps the target already lets run long), so a burst's prompts go
in whole while the tail of the inter-token latency stays where the target puts it. The account starts afresh
whenever the engine goes idle, so a quiet hour earns no credit for a later burst.
"""

from dataclasses import dataclass

# a fifth of the 1 % of gaps ITL p99 leaves to the slowest steps
DEFAULT_SHARE = 0.002


@dataclass
class ItlTail:
    share: float = DEFAULT_SHARE
    gaps_given: int = 0  # decode tokens given since the engine was last idle
    gaps_delayed: int = 0  # of them, those delayed by a step taken whole

    def grant(self, num_decodes: int, gaps_to_come: int) -> bool:
        """May a step delay `num_decodes` running decodes' next tokens? Yes while the delayed gaps stay within
        the share of those given and `gaps_to_come` (what the present sequences may still sample); spends them."""
        if self.gaps_delayed + num_decodes > self.share * (self.gaps_given + gaps_to_come):
            return False
        self.gaps_delayed += num_decodes
        return True

    def step_done(self, num_decodes: int) -> None:
        self.gaps_given += num_decodes

    def idle(self) -> None:
        """No sequence is left: the next load's account starts afresh."""
        self.gaps_given = self.gaps_delayed = 0
