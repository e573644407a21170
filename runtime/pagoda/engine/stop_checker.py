"""When a sequence stops: pure functions of its tokens, its text and its parameters (no model needed)."""

from dataclasses import dataclass

from pagoda.core.sequence import Sequence
from pagoda.sampling_params import SamplingParams


@dataclass(frozen=True)
class Stop:
    reason: str  # "stop" | "length"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    text: str | None = None  # the text cut at a stop string (None: keep the text as it is)


def check_stop(seq: Sequence, text: str, num_new_chars: int, eos_token_ids: set[int],
               max_model_len: int) -> Stop | None:
    """After a token was appended to `seq` and detokenized (`text` is the whole output text, of which the
    last `num_new_chars` characters are new): does the sequence stop, and why?"""
    params = seq.params
    token = seq.token_ids[-1]
    if seq.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and token in eos_token_ids:
            return Stop("stop")
        if token in params.stop_token_ids:
            return Stop("stop", token)
        if num_new_chars and params.stop_strings:
            hit = find_stop_string(text, num_new_chars, params)
            if hit is not None:
                return hit
    max_tokens = params.max_tokens or max_model_len
    if seq.num_output_tokens >= max_tokens or seq.num_tokens >= max_model_len:
        return Stop("length")
    return None


def find_stop_string(text: str, num_new_chars: int, params: SamplingParams) -> Stop | None:
    """The first stop string that the new characters complete; the text is cut before it (or after it,
    with include_stop_str_in_output). Only windows that reach into the new characters are searched."""
    for stop in params.stop_strings:
        start = max(len(text) - num_new_chars - len(stop) + 1, 0)
        at = text.find(stop, start)
        if at != -1:
            end = at + len(stop) if params.include_stop_str_in_output else at
            return Stop("stop", stop, text[:end])
    return None


def hold_back_chars(params: SamplingParams) -> int:
    """Characters a running sequence withholds from its visible text: they might begin a stop string."""
    return max(max((len(s) for s in params.stop_strings), default=0) - 1, 0)


def visible_text(text: str, hold_back: int, finished: bool) -> str:
    if finished or not hold_back:
        return text
    return text[: max(len(text) - hold_back, 0)]
