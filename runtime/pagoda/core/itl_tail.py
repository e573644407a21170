"""The share of token gaps a burst of prompts may delay. Pure Python, no torch.

Under ``--target-itl-ms auto`` a step beside running decodes takes what the latency target leaves. When more
prompt tokens wait than that, a step may instead take all of ``max_num_batched_tokens`` (prefill-first's step,
the fastest way to first tokens). It is granted only if the whole queue, taken whole, would fit: the gaps the
burst foresees (one per running decode in each full step the queue needs; ``Scheduler._burst_gaps``), with the
gaps delayed before, must stay within ``share`` of the gaps the engine has given since it was last idle and the
present sequences will still give. A grant spends only the gaps its own step delays. Foreseeing the whole queue
matters where answers end together (a closed loop of fixed lengths): a burst granted its first step and refused its
second splits one wave of prompts into many, and every later prompt then delays every running answer.

ITL p99 pools every gap of a load and leaves 1 % of them to the slowest steps. The default share gives four
fifths of that to bursts, foreseen whole, and leaves a fifth to the steps the target already lets run long. The
account starts afresh whenever the engine goes idle, so a quiet hour earns no credit for a later burst.
"""

from dataclasses import dataclass

# four fifths of the 1 % of gaps ITL p99 leaves to the slowest steps (the last fifth: the steps the target lets run)
DEFAULT_SHARE = 0.008


@dataclass
class ItlTail:
    share: float = DEFAULT_SHARE
    gaps_given: int = 0  # decode tokens given since the engine was last idle
    gaps_delayed: int = 0  # of them, those delayed by a step taken whole

    def grant(self, num_decodes: int, gaps_to_come: int, foreseen: int | None = None) -> bool:
        """May a step delay `num_decodes` running decodes' next tokens? Yes while the delayed gaps, with the
        `foreseen` ones of the burst it begins (default: this step's alone), stay within the share of those given
        and `gaps_to_come` (what the present sequences may still sample); spends this step's `num_decodes`."""
        foreseen = num_decodes if foreseen is None else max(foreseen, num_decodes)
        if self.gaps_delayed + foreseen > self.share * (self.gaps_given + gaps_to_come):
            return False
        self.gaps_delayed += num_decodes
        return True

    def step_done(self, num_decodes: int) -> None:
        self.gaps_given += num_decodes

    def idle(self) -> None:
        """No sequence is left: the next load's account starts afresh."""
        self.gaps_given = self.gaps_delayed = 0
