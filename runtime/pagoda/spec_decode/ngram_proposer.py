"""Prompt lookup (n-gram) drafts: the tokens that followed the last earlier occurrence of the sequence's
own suffix. Pure Python and numpy, no torch: the scheduler proposes before it schedules."""

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pagoda.sampling_params import SamplingParams


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """Up to min(k, max_tokens) draft tokens continuing token_ids (prompt + output so far); [] if no
        suffix of min_n..max_n tokens occurred before. The longest matching suffix wins, then its latest
        earlier occurrence."""
        limit = min(self.k, max_tokens)
        if limit < 1 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = tokens[-n:]
            # [L - n, n]: every earlier window of n tokens (the suffix itself excluded)
            windows = sliding_window_view(tokens[:-1], n)
            starts = np.flatnonzero((windows == suffix).all(axis=1))
            if starts.size:
                follow = int(starts[-1]) + n
                return tokens[follow : follow + limit].tolist()
        return []


def can_speculate(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a sequence with these parameters takes drafts. The rest decode one token per step, in the
    same batches: structured outputs (the grammar would have to follow every draft), logprobs (reported
    per sampled token), penalties (they count the output so far, drafts included) and min_tokens not
    reached yet (eos is banned, so drafts past it would be judged by another distribution). The logits
    processors (logit_bias, allowed_token_ids, bad_words) do speculate: verification applies them at each
    position, counting the drafts before it as generated tokens."""
    return (params.structured_outputs is None and params.logprobs is None
            and not params.presence_penalty and not params.frequency_penalty
            and params.repetition_penalty == 1.0 and num_output_tokens >= params.min_tokens)
