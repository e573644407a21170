"""What a step costs, learnt from the steps the engine ran (no torch): seconds ≈ fixed + per prompt token × the
prompt tokens it computed + per decode × its decodes, least squares through the recent steps and the last wide
ones. A decode costs more than a prompt token (its logits, its sample, its attention over the whole context: 0.71
against 0.56 ms for the default model on 2 Zen 4 cores): one price for both put a step of decodes alone, which the
relative budget ("auto") is a multiple of, a quarter under what it took. The scheduler asks how many prompt
tokens fit in a latency budget (`--target-itl-ms`) beside the running decodes, so a long prompt is cut into as
many chunks as the budget needs; and what a step of the running decodes alone costs, which it answers from the
steps of about that many decodes alone that it ran last, where it has them. At a burst's edge, after a run of
decode steps, a prompt step is priced from the measured decode step instead of the fit (FEW_PROMPT_STEPS)."""

from collections import deque
from dataclasses import dataclass

# steps seen before the model answers: one is enough for the pessimistic line (all its time is the tokens'),
# and the first steps matter most: a burst of requests would otherwise run whole-budget steps over decodes
MIN_STEPS = 1
# the two prices are told apart only where the steps' mixes differ enough: below this share of the variance
# that the prompt tokens and the decodes do not share, one price for every token (the line through the totals)
MIN_INDEPENDENT_VARIANCE = 0.05
# steps of decodes alone, kept apart by width (the last few of each), and how many of about the asked width make a
# measured figure: a budget that is a multiple of a step of decodes alone takes it from such steps, not from the
# fitted prices, whose fixed cost wanders while a run of decode steps all of one width leaves only the last wide
# steps to draw them through (served at concurrency 32: 47-86 ms for a step that took 45)
DECODE_STEPS_PER_WIDTH = 8
MIN_DECODE_STEPS = 3
# a decode's price against a prompt token's, until a step of about that many decodes alone is measured: a decode
# runs its row through the same layers, then reads its whole context's KV (a prompt chunk reads it once for all
# its rows), its logits and its sample. Measured for the default model on 2 Zen 4 cores: 0.78 against 0.55 ms
# offline (decode steps' slope at 256-300 tokens of context, 256-token prefill), 1.0-1.2 against 0.68 served;
# over 52 served step logs 1.5 put a step of 32 decodes alone at 0.91x what it then took (median; 0.85-1.01x for
# 80 % of them; on the low side, as a budget too long costs the inter-token latency's tail) where a decode at a
# prompt token's price put it at 0.73x (the budget a quarter short, the first burst's prompts paced slower)
DECODE_PRICE_RATIO = 1.5
# a burst's edge: after a run of decode steps, the window holds fewer than this many steps that computed prompt
# tokens, and the fit has little but those decode steps (all of one width) and the last wide steps to draw its
# line through: one price for every token, 0.42-0.45 ms where a prompt token beyond a measured step of 32 decodes
# took 0.60-0.66 (served on 2 Zen 4 cores; the edge's steps ran 173 and 181 ms against budgets of 129 and 132).
# There a step is the measured step of its decodes alone plus each prompt token at what the window's prompt steps
# took beyond their own decodes alone (the wide ones' while it has none), and with none in the window, half that:
# the wide steps are older than the machine's present pace, and the half step measures it
FEW_PROMPT_STEPS = 8


@dataclass(frozen=True)
class StepCosts:
    fixed: float  # seconds a step
    per_prompt_token: float
    per_decode: float


class StepCostModel:
    def __init__(self, window: int = 64, wide_window: int = 8):
        self.steps: deque[tuple[int, int, float]] = deque(maxlen=window)  # (tokens computed, decodes, seconds)
        # the last steps wider than twice the recent mean, by their number among all steps: a long run of
        # decode-only steps (all of one width) would otherwise leave no second width to draw the line through
        # when the next prompts come
        self.wide: deque[tuple[int, int, int, float]] = deque(maxlen=wide_window)
        self._observed = 0  # steps seen in all
        self._tokens_in_window = 0  # the sum of self.steps' tokens
        self._prompt_steps_in_window = 0  # self.steps' steps that computed prompt tokens
        self._costs: StepCosts | None = None  # fitted once per new step, asked once or twice a step
        self._price_beyond: float | None = None  # likewise (0.0: none to tell)
        self.decode_steps: dict[int, deque[float]] = {}  # decodes -> the seconds of the last steps of them alone

    def observe(self, num_tokens: int, seconds: float, num_decodes: int = 0) -> None:
        """A step ran: `num_tokens` computed, `num_decodes` of them one-token decodes, in `seconds`."""
        if num_tokens > 0 and seconds > 0:
            if not self.steps or num_tokens * len(self.steps) > 2 * self._tokens_in_window:  # > 2x the mean
                self.wide.append((self._observed, num_tokens, num_decodes, seconds))
            if len(self.steps) == self.steps.maxlen:
                oldest_tokens, oldest_decodes, _ = self.steps[0]
                self._tokens_in_window -= oldest_tokens
                self._prompt_steps_in_window -= oldest_tokens > oldest_decodes
            self.steps.append((num_tokens, num_decodes, seconds))
            self._tokens_in_window += num_tokens
            self._prompt_steps_in_window += num_tokens > num_decodes
            self._observed += 1
            self._costs = self._price_beyond = None
            if num_decodes == num_tokens:
                self.decode_steps.setdefault(num_decodes, deque(maxlen=DECODE_STEPS_PER_WIDTH)).append(seconds)

    def costs(self) -> StepCosts | None:
        """The fitted prices, or None before MIN_STEPS steps."""
        if len(self.steps) < MIN_STEPS:
            return None
        if self._costs is None:
            self._costs = _fit(self._points())
        return self._costs

    def _points(self) -> list[tuple[int, int, float]]:
        """The steps fitted: the window's, and the wide ones before it."""
        first_in_window = self._observed - len(self.steps)
        return [*self.steps, *((t, d, y) for i, t, d, y in self.wide if i < first_in_window)]

    def seconds_for(self, num_tokens: int, num_decodes: int = 0) -> float | None:
        """What a step of `num_tokens`, `num_decodes` of them decodes, costs; None while unknown."""
        costs = self.costs()
        if costs is None:
            return None
        return costs.fixed + costs.per_prompt_token * (num_tokens - num_decodes) + costs.per_decode * num_decodes

    def decode_step_seconds(self, num_decodes: int) -> float | None:
        """What a step of `num_decodes` decodes alone takes: the median of the recent such steps within an eighth
        of that width. Before there are any (a server's first burst), from the widest narrower decode steps
        measured, each further decode at DECODE_PRICE_RATIO times a prompt token's price (that price: what the
        recent steps took beyond those narrower ones, shared out so); without narrower ones, the line through
        the steps' totals. Not the two fitted prices: on a burst's first steps (prompt tokens near constant,
        decodes growing one a step) a decode came out at 3.3 ms where it takes 1. Nor the line alone there:
        once the window has only the burst's steps of 100-125 tokens it read 59 ms where it had read 23-30.
        None while unknown."""
        near = self._decode_step_measured(num_decodes)
        if near is not None:
            return near
        if len(self.steps) < MIN_STEPS:
            return None
        narrower = [width for width in self.decode_steps if width < num_decodes]
        if narrower:
            width = max(narrower)
            anchor = _median(list(self.decode_steps[width]), at_least=1)
            n = len(self.steps)
            mean_decodes = sum(d for _, d, _ in self.steps) / n
            mean_seconds = sum(y for _, _, y in self.steps) / n
            # the recent steps beyond the anchor: their prompt tokens at a price, their further decodes at the ratio
            priced = self._tokens_in_window / n - mean_decodes + DECODE_PRICE_RATIO * max(mean_decodes - width, 0)
            if priced > 0 and mean_seconds > anchor:
                per_token = (mean_seconds - anchor) / priced
                return anchor + DECODE_PRICE_RATIO * per_token * (num_decodes - width)
        fixed, per_token = _line([(t, y) for t, _, y in self._points()])
        return fixed + per_token * num_decodes

    def prompt_tokens_within(self, seconds: float, num_decodes: int = 0) -> int | None:
        """The most prompt tokens one step may compute beside `num_decodes` decodes to take at most `seconds`;
        None while unknown. From the fitted prices, except at a burst's edge, where the window holds fewer than
        FEW_PROMPT_STEPS steps that computed prompt tokens (see there)."""
        costs = self.costs()
        if costs is None:
            return None
        base = costs.fixed + costs.per_decode * num_decodes
        price = costs.per_prompt_token
        if num_decodes and self._prompt_steps_in_window < FEW_PROMPT_STEPS:
            measured = self._decode_step_measured(num_decodes)
            beyond = self._prompt_price_beyond_decodes()
            if measured is not None and beyond:
                base, price = measured, max(price, beyond)
        tokens = max(int((seconds - base) / price + 1e-6), 0)  # 1e-6: a float's rounding, not a token
        return tokens if self._prompt_steps_in_window or not num_decodes else tokens // 2

    def _decode_step_measured(self, num_decodes: int) -> float | None:
        """The median of the recent steps of decodes alone within an eighth of `num_decodes` (not every width is
        kept: a width is seen once a step as sequences finish), or None with fewer than MIN_DECODE_STEPS."""
        reach = num_decodes // 8
        return _median([s for width in range(num_decodes - reach, num_decodes + reach + 1)
                        for s in self.decode_steps.get(width, ())])

    def _prompt_price_beyond_decodes(self) -> float:
        """Seconds per prompt token beyond what a step of the same step's decodes alone takes (measured, else
        estimated), through the window's steps that computed prompt tokens beside decodes, else the wide ones
        before it; 0.0 where none did. Cached until the next step."""
        if self._price_beyond is None:
            base: dict[int, float | None] = {}  # decodes -> their step alone, looked up once a width
            excess = prompt = 0.0
            for tokens, decodes, seconds in self.steps if self._prompt_steps_in_window else self._points():
                if tokens > decodes and decodes:
                    if decodes not in base:
                        base[decodes] = self.decode_step_seconds(decodes)
                    if base[decodes] is not None:
                        excess += seconds - base[decodes]
                        prompt += tokens - decodes
            self._price_beyond = excess / prompt if excess > 0 and prompt > 0 else 0.0
        return self._price_beyond


def _fit(points: list[tuple[int, int, float]]) -> StepCosts:
    """Least squares through (tokens, decodes, seconds): a price for each kind of token where the points tell
    them apart, else one price (the line through the totals)."""
    n = len(points)
    mean_p = sum(t - d for t, d, _ in points) / n
    mean_d = sum(d for _, d, _ in points) / n
    mean_y = sum(y for _, _, y in points) / n
    s_pp = sum((t - d - mean_p) ** 2 for t, d, _ in points)
    s_dd = sum((d - mean_d) ** 2 for _, d, _ in points)
    s_pd = sum((t - d - mean_p) * (d - mean_d) for t, d, _ in points)
    det = s_pp * s_dd - s_pd * s_pd
    if det > MIN_INDEPENDENT_VARIANCE * s_pp * s_dd > 0:
        s_py = sum((t - d - mean_p) * (y - mean_y) for t, d, y in points)
        s_dy = sum((d - mean_d) * (y - mean_y) for _, d, y in points)
        per_prompt = (s_dd * s_py - s_pd * s_dy) / det
        per_decode = (s_pp * s_dy - s_pd * s_py) / det
        fixed = mean_y - per_prompt * mean_p - per_decode * mean_d
        # a decode runs its token through the same layers as a prompt token, then its logits and its sample:
        # never cheaper (a fit that says so has seen too few decodes, as at a burst's start after a quiet spell)
        if 0 < per_prompt <= per_decode and fixed >= 0:
            return StepCosts(fixed, per_prompt, per_decode)
    fixed, per_token = _line([(t, y) for t, _, y in points])
    return StepCosts(fixed, per_token, per_token)


def _median(values: list[float], at_least: int = MIN_DECODE_STEPS) -> float | None:
    """The median (the upper of the middle two), or None with fewer than `at_least` values."""
    if len(values) < at_least:
        return None
    return sorted(values)[len(values) // 2]


def _line(points: list[tuple[int, float]]) -> tuple[float, float]:
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
