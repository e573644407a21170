"""What a step costs, learnt from the steps the engine ran (no torch): seconds ≈ fixed + per_token × the
tokens it computed, a least-squares line through the recent steps. The scheduler asks it how many tokens
fit in a latency budget (`--target-itl-ms`): a step's prefill share is what is left once the running
decodes are counted, so a long prompt is cut into as many chunks as the budget needs."""

from collections import deque

# steps seen before the model answers: one is enough for the pessimistic line (all its time is the tokens'),
# and the first steps matter most: a burst of requests would otherwise run whole-budget steps over decodes
MIN_STEPS = 1


class StepCostModel:
    def __init__(self, window: int = 64):
        self.steps: deque[tuple[int, float]] = deque(maxlen=window)  # (tokens computed, seconds)

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds > 0:
            self.steps.append((num_tokens, seconds))

    def line(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None before MIN_STEPS steps."""
        if len(self.steps) < MIN_STEPS:
            return None
        n = len(self.steps)
        mean_x = sum(x for x, _ in self.steps) / n
        mean_y = sum(y for _, y in self.steps) / n
        var_x = sum((x - mean_x) ** 2 for x, _ in self.steps)
        if var_x > 0:
            per_token = sum((x - mean_x) * (y - mean_y) for x, y in self.steps) / var_x
            fixed = mean_y - per_token * mean_x
            if per_token > 0 and fixed >= 0:
                return fixed, per_token
        # one batch size only (or a line that makes no sense): every second is the tokens' (pessimistic)
        return 0.0, mean_y / mean_x

    def tokens_within(self, seconds: float) -> int | None:
        """The most tokens one step may compute to take at most `seconds`; None while unknown."""
        line = self.line()
        if line is None:
            return None
        fixed, per_token = line
        return max(int((seconds - fixed) / per_token + 1e-6), 0)  # 1e-6: a float's rounding, not a token
