"""What a step costs, learnt from the steps the engine ran (no torch): seconds ≈ fixed + per_token × the
tokens it computed, a least-squares line through the recent steps and the last wide ones. The scheduler
asks it how many tokens fit in a latency budget (`--target-itl-ms`): a step's prefill share is what is left
once the running decodes are counted, so a long prompt is cut into as many chunks as the budget needs; and,
for the relative budget ("auto"), what a step of the running decodes alone costs."""

from collections import deque

# steps seen before the model answers: one is enough for the pessimistic line (all its time is the tokens'),
# and the first steps matter most: a burst of requests would otherwise run whole-budget steps over decodes
MIN_STEPS = 1


class StepCostModel:
    def __init__(self, window: int = 64, wide_window: int = 8):
        self.steps: deque[tuple[int, float]] = deque(maxlen=window)  # (tokens computed, seconds)
        # the last steps wider than twice the recent mean, by their number among all steps: a long run of
        # decode-only steps (all of one width) would otherwise leave no second width to draw the line through
        # when the next prompts come
        self.wide: deque[tuple[int, int, float]] = deque(maxlen=wide_window)
        self._observed = 0  # steps seen in all
        self._tokens_in_window = 0  # the sum of self.steps' tokens
        self._line: tuple[float, float] | None = None  # fitted once per new step, asked once or twice a step

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds > 0:
            if not self.steps or num_tokens * len(self.steps) > 2 * self._tokens_in_window:  # > 2x the mean
                self.wide.append((self._observed, num_tokens, seconds))
            if len(self.steps) == self.steps.maxlen:
                self._tokens_in_window -= self.steps[0][0]
            self.steps.append((num_tokens, seconds))
            self._tokens_in_window += num_tokens
            self._observed += 1
            self._line = None

    def line(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None before MIN_STEPS steps."""
        if len(self.steps) < MIN_STEPS:
            return None
        if self._line is None:
            first_in_window = self._observed - len(self.steps)
            points = [*self.steps, *((x, y) for i, x, y in self.wide if i < first_in_window)]
            self._line = _fit(points)
        return self._line

    def seconds_for(self, num_tokens: int) -> float | None:
        """What a step of `num_tokens` costs by the line; None while unknown."""
        line = self.line()
        if line is None:
            return None
        fixed, per_token = line
        return fixed + per_token * num_tokens

    def tokens_within(self, seconds: float) -> int | None:
        """The most tokens one step may compute to take at most `seconds`; None while unknown."""
        line = self.line()
        if line is None:
            return None
        fixed, per_token = line
        return max(int((seconds - fixed) / per_token + 1e-6), 0)  # 1e-6: a float's rounding, not a token


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """The least-squares line through (tokens, seconds) points: (fixed seconds, seconds per token)."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var_x = sum((x - mean_x) ** 2 for x, _ in points)
    if var_x > 0:
        per_token = sum((x - mean_x) * (y - mean_y) for x, y in points) / var_x
        fixed = mean_y - per_token * mean_x
        if per_token > 0 and fixed >= 0:
            return fixed, per_token
    # one batch size only (or a line that makes no sense): every second is the tokens' (pessimistic)
    return 0.0, mean_y / mean_x
