"""The runner's side of each request kind that does not sample (``core/request_kind.py`` declares the kinds):
a reader follows its sequences and, at the end of each one's prompt, makes its result from the last stage's
final hidden states where a generation would sample."""

from typing import Any, Protocol

import torch

from pagoda.core.request_kind import EMBED
from pagoda.core.scheduler_output import SchedulerOutput
from pagoda.sample.pooler import Pooler


class PromptReader(Protocol):
    def update(self, out: SchedulerOutput) -> None:
        """Follow the scheduler: its kind's new sequences (on reset), finished ones."""

    @property
    def active(self) -> bool:
        """Whether it follows any sequence (the model then keeps every hidden row: it may read any)."""

    def read(self, out: SchedulerOutput, hidden: torch.Tensor) -> dict[int, Any]:
        """hidden [num_tokens, hidden_size], rows in scheduled order -> the results of its sequences whose
        prompt ended this step."""


def prompt_readers() -> dict[str, PromptReader]:
    """One reader per kind that does not sample, by kind name."""
    return {EMBED.name: Pooler()}
