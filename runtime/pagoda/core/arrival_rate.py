"""The pace at which prompt tokens arrive while the requests outgrow the engine. Pure Python, no torch.

Under ``--target-itl-ms auto`` a waiting queue claims a share of the engine's time by its size (the scheduler's
queue share). In an open loop past what the machine serves that alone is too late: prompts arriving steadily at a
pace that needs most of the engine are admitted only once a queue deep enough to claim that share stands, and every
prompt then waits behind it. This counts the prompt tokens that arrived over the last ``window`` seconds, by the
requests' own arrival times (no clock of its own: the window ends at the newest arrival), so that the scheduler can
grant the prompts the share their pace needs before a queue forms.

A closed loop's answers that end together send their users' prompts back at the same pace, and there the pace must
not count (tiny-c32's and chat-c32's ITL tails, docs/benchmarks.md): each user's next prompt only replaces a
finished request. So the pace counts only while the number of requests in the engine sets a new high within each
third of the window: an open loop past the machine's rate keeps outgrowing it; a closed loop's number stops at its
users', and its first burst, arrived at one instant, falls within two thirds at most.
"""

from collections import deque
from dataclasses import dataclass, field

# Seconds of arrivals the pace is counted over: long enough to hold a dozen Poisson arrivals at the rates where the
# queue share stands (4-8 a second on two cores) and a new high in each third, short enough to follow a load that
# changes within a few seconds
DEFAULT_WINDOW = 2.0


@dataclass
class ArrivalRate:
    window: float = DEFAULT_WINDOW
    _arrivals: deque = field(default_factory=deque)  # (arrival time, prompt tokens, high after it), oldest first
    _tokens: int = 0  # the sum of _arrivals' tokens
    _high: int = 0  # the most requests the engine has held at once since it was last idle
    _high_before: int = 0  # the high before the window's oldest arrival

    def note(self, arrival_time: float, prompt_tokens: int, num_requests: int) -> None:
        """A prompt of `prompt_tokens` arrived at `arrival_time` (seconds, the requests' clock); the engine now holds
        `num_requests` requests."""
        if self.window <= 0:  # off
            return
        if self._arrivals and arrival_time < self._arrivals[-1][0]:
            arrival_time = self._arrivals[-1][0]  # a late-queued request (a requeue): counted as now
        self._high = max(self._high, num_requests)
        self._arrivals.append((arrival_time, prompt_tokens, self._high))
        self._tokens += prompt_tokens
        while self._arrivals[0][0] <= arrival_time - self.window:
            _, tokens, self._high_before = self._arrivals.popleft()
            self._tokens -= tokens

    def idle(self) -> None:
        """No request is left: the next load's count starts afresh."""
        self._arrivals.clear()
        self._tokens = self._high = self._high_before = 0

    def tokens_per_second(self) -> float:
        """The prompt tokens that arrived within the window ending at the newest arrival, per second, while the
        requests' high rose within each of its thirds; else 0."""
        if not self._arrivals:
            return 0.0
        newest = self._arrivals[-1][0]
        highs = [self._high_before, self._high_before, self._high_before, self._arrivals[-1][2]]
        for t, _, high in self._arrivals:  # the high at each third's end (highs only rise)
            for third in (1, 2):
                if t <= newest - (3 - third) * self.window / 3:
                    highs[third] = high
        if not highs[0] < highs[1] < highs[2] < highs[3]:
            return 0.0
        return self._tokens / self.window
