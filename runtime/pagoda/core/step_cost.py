"""What a step costs, learnt online from the steps the engine runs (no torch). The scheduler asks two things:

- what a step of `d` decodes alone takes: the median of the last such steps the engine ran (of about that
  width), each moved to the context asked about at the price of a context token, else extrapolated from the widest
  narrower one measured (`decode_step_seconds`);
- what a prompt token adds to a step: `prompt_token_seconds`, the least-squares price through the recent steps
  (seconds = fixed + per prompt token x prompt tokens + per decode x decodes), never under what the recent steps
  that carried prompt tokens beside decodes took per prompt token beyond their decodes alone.

A step of `d` decodes and `p` prompt tokens is then priced decode_step_seconds(d) + p x prompt_token_seconds(),
and `prompt_tokens_within(seconds, d)` is the `p` that keeps it within `seconds` (the ITL target). Every figure is
the engine's own measurement on its own machine: nothing is fitted offline but DECODE_PRICE_RATIO, used only
before any step of about that many decodes alone has run.

A decode reads its whole context's KV, so a step of `d` decodes costs more at long contexts than at short ones:
a width measured on one load (short chats) and asked about on the next (long documents) was off by half or more
(`pagoda bench schedule --one-server --prices xeon`: mid-c48's 32 decodes priced 23 ms after tiny-c32, where they
take ~40, and its queue sized from them). Each decode step is kept with the context tokens its decodes read, and
`context_token_seconds` is the least-squares price of one over the recent decode steps (with their widths, or over
one width's growing contexts)."""

from collections import deque
from dataclasses import dataclass

# the two fitted prices are told apart only where the steps' mixes differ enough: below this share of the
# variance that the prompt tokens and the decodes do not share, one price for every token (the line through the
# totals). Numerical, not tuned: it only rejects a near-singular 2x2 system
MIN_INDEPENDENT_VARIANCE = 0.05
# steps of decodes alone are kept apart by width (the last few of each); a measured figure is the median of at
# least MIN_DECODE_STEPS of them, so one step slowed by the machine (another process, a page fault) does not set it
DECODE_STEPS_PER_WIDTH = 8
MIN_DECODE_STEPS = 3
# the recent steps of decodes alone that a context token's price is fitted through, of any width. A context adds
# little to a step beside the machine's noise (a step of 4 decodes over 1,000 more positions: 1.3 ms in 25, on the
# Xeon), so the price needs many steps: at 64 `pagoda bench schedule --prices xeon` (3 % noise a step) fitted it
# 0.2-2.8x the true one over a load's p10-p90, at 256 0.9-1.2x (the first loads' first steps up to 1.5x)
DECODE_WINDOW = 256
# a context token's price is taken only when the steps tell it within this share of itself at one standard error
# (the fit's own scatter: a machine's noisy steps, or contexts that hardly vary, tell nothing); until then, the last
# price they told
CONTEXT_PRICE_ERROR = 0.25
# a decode's price against a prompt token's, used only until a step of about that many decodes alone is measured
# (a server's first burst): a decode runs its row through the same layers, then reads its whole context's KV,
# its logits and its sample. Measured for the default model on 2 Zen 4 cores: 0.78 against 0.55 ms offline,
# 1.0-1.2 against 0.68 served (docs/benchmarks.md, appendix); 1.5 put a step of 32 decodes alone at 0.91x what it
# then took (median of 52 served step logs). Wrong by a little, it only sizes the first burst's chunks
DECODE_PRICE_RATIO = 1.5


@dataclass(frozen=True)
class StepCosts:
    fixed: float  # seconds a step
    per_prompt_token: float
    per_decode: float


class StepCostModel:
    def __init__(self, window: int = 64, wide_window: int = 8):
        # window: the recent steps the prices are fitted through (2-3 s of steps at the default model's pace on
        # 2 cores: recent enough to follow the machine's pace, which moves 10-30 % between minutes on a shared host)
        # (tokens computed, decodes, seconds, context tokens the decodes read)
        self.steps: deque[tuple[int, int, float, int]] = deque(maxlen=window)
        # the last steps wider than twice the recent mean, by their number among all steps: a long run of
        # decode-only steps (all of one width) would otherwise leave no second width to draw the line through
        # when the next prompts come
        self.wide: deque[tuple[int, int, int, float]] = deque(maxlen=wide_window)
        # likewise the last steps that computed prompt tokens beside decodes: a prompt token's price beyond the
        # decodes' own step, when the window has none (a burst's edge, after a run of decode steps)
        self.mixed: deque[tuple[int, int, float, int]] = deque(maxlen=wide_window)
        self._observed = 0  # steps seen in all
        self._tokens_in_window = 0  # the sum of self.steps' tokens
        self._mixed_in_window = 0  # self.steps' steps that computed prompt tokens beside decodes
        self._costs: StepCosts | None = None  # cached until the next step
        self._price: float | None = None  # likewise
        self._context_price: float | None = None  # the last price the decode steps told (context_token_seconds)
        self._context_price_stale = False  # decode steps came since it was fitted
        # decodes -> the last steps of them alone: (seconds, context tokens their decodes read)
        self.decode_steps: dict[int, deque[tuple[float, int]]] = {}
        self.context_fit = _ContextFit(DECODE_WINDOW)  # the recent steps of decodes alone, with their contexts

    def observe(self, num_tokens: int, seconds: float, num_decodes: int = 0, decode_context: int = 0) -> None:
        """A step ran: `num_tokens` computed, `num_decodes` of them one-token decodes, in `seconds`; its decodes
        read `decode_context` KV positions in all (SchedulerOutput.decode_context_tokens)."""
        if num_tokens <= 0 or seconds <= 0:
            return
        if not self.steps or num_tokens * len(self.steps) > 2 * self._tokens_in_window:  # > 2x the mean
            self.wide.append((self._observed, num_tokens, num_decodes, seconds))
        if len(self.steps) == self.steps.maxlen:
            oldest_tokens, oldest_decodes, _, _ = self.steps[0]
            self._tokens_in_window -= oldest_tokens
            self._mixed_in_window -= oldest_tokens > oldest_decodes > 0
        self.steps.append((num_tokens, num_decodes, seconds, decode_context))
        self._tokens_in_window += num_tokens
        self._mixed_in_window += num_tokens > num_decodes > 0
        if num_tokens > num_decodes > 0:
            self.mixed.append((num_tokens, num_decodes, seconds, decode_context))
        self._observed += 1
        self._costs = self._price = None
        if num_decodes == num_tokens:
            self.decode_steps.setdefault(num_decodes, deque(maxlen=DECODE_STEPS_PER_WIDTH)).append(
                (seconds, decode_context))
            self.context_fit.add(num_decodes, decode_context, seconds)
            self._context_price_stale = True

    def costs(self) -> StepCosts | None:
        """The fitted prices, or None before any step."""
        if not self.steps:
            return None
        if self._costs is None:
            self._costs = _fit(self._points())
        return self._costs

    def _points(self) -> list[tuple[int, int, float]]:
        """The steps fitted: the window's, and the wide ones before it."""
        first_in_window = self._observed - len(self.steps)
        return [*((t, d, y) for t, d, y, _ in self.steps),
                *((t, d, y) for i, t, d, y in self.wide if i < first_in_window)]

    def seconds_for(self, num_tokens: int, num_decodes: int = 0) -> float | None:
        """What a step of `num_tokens`, `num_decodes` of them decodes, costs by the fitted prices; None while
        unknown."""
        costs = self.costs()
        if costs is None:
            return None
        return costs.fixed + costs.per_prompt_token * (num_tokens - num_decodes) + costs.per_decode * num_decodes

    def decode_step_seconds(self, num_decodes: int, context: float | None = None) -> float | None:
        """What a step of `num_decodes` decodes alone takes, each reading `context` KV positions on average (None:
        as the steps measured read): the median of the recent such steps within an eighth of that width, each
        moved to that context at context_token_seconds(). Before there are any (a server's first burst), the
        widest narrower width measured (likewise moved) plus each further decode at DECODE_PRICE_RATIO times a
        prompt token's price; without narrower ones, the line through the steps' totals. Not the two fitted
        prices: on a burst's first steps (prompt tokens near constant, decodes growing one a step) they put a
        decode at 3.3 ms where it takes 1. None while unknown."""
        near = self._decode_step_measured(num_decodes, context)
        if near is not None:
            return near
        if not self.steps:
            return None
        narrower = [width for width in self.decode_steps if width < num_decodes]
        if narrower:
            width = max(narrower)
            anchor = self._moved(self.decode_steps[width], width, None, at_least=1)  # as measured: beside the window
            n = len(self.steps)
            mean_decodes = sum(d for _, d, _, _ in self.steps) / n
            mean_seconds = sum(y for _, _, y, _ in self.steps) / n
            # the recent steps beyond the anchor: their prompt tokens at a price, their further decodes at the ratio
            priced = self._tokens_in_window / n - mean_decodes + DECODE_PRICE_RATIO * max(mean_decodes - width, 0)
            if priced > 0 and mean_seconds > anchor:
                per_token = (mean_seconds - anchor) / priced
                moved = self._moved(self.decode_steps[width], width, context, at_least=1)
                return moved + DECODE_PRICE_RATIO * per_token * (num_decodes - width)
        fixed, per_token = _line([(t, y) for t, _, y in self._points()])
        return fixed + per_token * num_decodes

    def prompt_token_seconds(self) -> float | None:
        """What a prompt token adds to a step: the fitted price, never under what the window's steps that
        computed prompt tokens beside decodes took per prompt token beyond their decodes alone (else the last such
        steps before it). The second guards the burst's edge: after a long run of decode steps of one width the
        fit has little else to draw its line through and puts a prompt token a third under its price (served on
        2 Zen 4 cores: 0.42-0.45 against 0.60-0.66 ms). An under-priced token overruns the ITL target; an
        over-priced one costs a few tokens of one chunk. None while unknown."""
        costs = self.costs()
        if costs is None:
            return None
        if self._price is None:
            alone: dict[int, float | None] = {}  # decodes -> their step alone at no context, once a width
            context_price = self.context_token_seconds() or 0.0
            excess = prompt = 0.0
            for tokens, decodes, seconds, context in self.steps if self._mixed_in_window else self.mixed:
                if tokens > decodes > 0:
                    if decodes not in alone:
                        alone[decodes] = self.decode_step_seconds(decodes, 0.0)
                    if alone[decodes] is not None:  # its decodes alone, at the context they read
                        excess += seconds - alone[decodes] - context_price * context
                        prompt += tokens - decodes
            beyond = excess / prompt if excess > 0 and prompt > 0 else 0.0
            self._price = max(costs.per_prompt_token, beyond)
        return self._price

    def prompt_tokens_within(self, seconds: float, num_decodes: int = 0, context: float | None = None) -> int | None:
        """The most prompt tokens one step may compute beside `num_decodes` decodes (reading `context` positions
        each, as decode_step_seconds) to take at most `seconds`; None while unknown."""
        price = self.prompt_token_seconds()
        if price is None:
            return None
        base = self.decode_step_seconds(num_decodes, context) if num_decodes else self.costs().fixed
        return max(int((seconds - base) / price + 1e-6), 0)  # 1e-6: a float's rounding, not a token

    def context_token_seconds(self) -> float | None:
        """What a decode step pays for each KV position its decodes read: the least-squares price through the
        recent steps of decodes alone (seconds = fixed + per decode x decodes + this x context tokens), else the
        slope within each width over its growing contexts. Where the recent steps cannot tell it (too few; every
        width at one context, or context and width moving together, as at a load's end, its answers finishing one
        a step), the last price they told: it is the machine's and the model's, and the next load needs it at
        its start. None before any."""
        if self._context_price_stale:
            self._context_price = self.context_fit.price() or self._context_price
            self._context_price_stale = False
        return self._context_price

    def _moved(self, steps, num_decodes: int, context: float | None, at_least: int = MIN_DECODE_STEPS) -> float | None:
        """The median of measured decode steps' seconds, each moved to `num_decodes` decodes reading `context`
        positions each at the context price (as measured while there is none, or no context is asked about);
        None with fewer than `at_least` steps."""
        price = self.context_token_seconds() if context is not None else None
        if price is None:
            return _median([seconds for seconds, _ in steps], at_least)
        median = _median([seconds - price * read for seconds, read in steps], at_least)  # at no context
        return None if median is None else median + price * num_decodes * context

    def _decode_step_measured(self, num_decodes: int, context: float | None = None) -> float | None:
        """The median of the recent steps of decodes alone within an eighth of `num_decodes` (not every width is
        kept: a width is seen once a step as sequences finish), moved to `context`, or None with fewer than
        MIN_DECODE_STEPS."""
        reach = num_decodes // 8
        return self._moved([step for width in range(num_decodes - reach, num_decodes + reach + 1)
                            for step in self.decode_steps.get(width, ())], num_decodes, context)


class _ContextFit:
    """Least squares through the recent steps of decodes alone, (decodes, context tokens, seconds), kept as running
    sums over a window (O(1) a step): the price of a context token (StepCostModel.context_token_seconds)."""

    def __init__(self, window: int):
        self.points: deque[tuple[int, int, float]] = deque()
        self.window = window
        self.sums = _Sums()  # over every point
        self.by_width: dict[int, _Sums] = {}  # over each width's points

    def add(self, decodes: int, context: int, seconds: float) -> None:
        self.points.append((decodes, context, seconds))
        self.sums.add(decodes, context, seconds, 1)
        self.by_width.setdefault(decodes, _Sums()).add(decodes, context, seconds, 1)
        if len(self.points) > self.window:
            old = self.points.popleft()
            self.sums.add(*old, -1)
            width = self.by_width[old[0]]
            width.add(*old, -1)
            if not width.n:
                del self.by_width[old[0]]

    def price(self) -> float | None:
        """Positive and within CONTEXT_PRICE_ERROR of itself at one standard error, else None."""
        n = self.sums.n
        s_dd, s_cc, s_dc, s_cy, s_dy, s_yy = self.sums.centered()
        det = s_dd * s_cc - s_dc * s_dc
        if n > 3 and s_dd > 0 and det > MIN_INDEPENDENT_VARIANCE * s_dd * s_cc:  # fixed + per decode + per context
            price = (s_dd * s_cy - s_dc * s_dy) / det
            per_decode = (s_cc * s_dy - s_dc * s_cy) / det
            residual = s_yy - price * s_cy - per_decode * s_dy  # the squares least squares leaves
            variance = residual / (n - 3) * s_dd / det
        else:  # width and context move together: within each width, the slope over its contexts
            s_cc = s_cy = s_yy = 0.0
            for width in self.by_width.values():
                _, cc, _, cy, _, yy = width.centered()
                s_cc, s_cy, s_yy = s_cc + cc, s_cy + cy, s_yy + yy
            free = n - len(self.by_width) - 1
            if s_cc <= 0 or free <= 0:
                return None
            price = s_cy / s_cc
            variance = (s_yy - price * s_cy) / free / s_cc
        if price <= 0 or variance > (CONTEXT_PRICE_ERROR * price) ** 2:
            return None
        return price


class _Sums:
    """Running sums of (decodes, context, seconds) points, and their sums of squares and products."""

    def __init__(self):
        self.n = 0
        self.d = self.c = self.y = self.dd = self.cc = self.dc = self.cy = self.dy = self.yy = 0.0

    def add(self, d: int, c: int, y: float, sign: int) -> None:
        self.n += sign
        self.d += sign * d
        self.c += sign * c
        self.y += sign * y
        self.dd += sign * d * d
        self.cc += sign * c * c
        self.dc += sign * d * c
        self.cy += sign * c * y
        self.dy += sign * d * y
        self.yy += sign * y * y

    def centered(self) -> tuple[float, float, float, float, float, float]:
        """s_dd, s_cc, s_dc, s_cy, s_dy, s_yy: the sums about the means (never below 0 where they are squares)."""
        if not self.n:
            return 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
        n = self.n
        return (max(self.dd - self.d * self.d / n, 0.0), max(self.cc - self.c * self.c / n, 0.0),
                self.dc - self.d * self.c / n, self.cy - self.c * self.y / n, self.dy - self.d * self.y / n,
                max(self.yy - self.y * self.y / n, 0.0))


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
