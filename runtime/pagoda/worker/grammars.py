"""Structured outputs in the model runner: each constrained sequence's grammar matcher follows the
sequence's own tokens, and a batch's constrained rows are masked by their grammars in one operation."""

from collections.abc import Callable

import torch

from pagoda.structured_output import apply_bitmask
from pagoda.worker.input_batch import RunnerSeq


def advance_matchers(seqs: dict[int, RunnerSeq], seq_ids: list[int], failed: dict[int, str],
                     backend: Callable[[], object]) -> None:
    """Bring each constrained sequence's matcher up to its tokens. A matcher is made fresh when the runner
    (re)learns a sequence (new, resumed after preemption, or a fork) and replays its output tokens, so
    it always follows the sequence's own tokens. A failure concerns one sequence: it goes to `failed`."""
    for seq_id in dict.fromkeys(seq_ids):
        seq = seqs[seq_id]
        spec = seq.params.structured_outputs
        if spec is None or seq_id in failed:
            continue
        try:
            if seq.matcher is None:
                seq.matcher = backend().matcher(spec)
            for token in seq.token_ids[seq.num_prompt_tokens + seq.matcher.num_accepted:]:
                if not seq.matcher.accept(token):
                    failed[seq_id] = f"token {token} does not follow its grammar"
                    break
        except Exception as e:  # noqa: BLE001 - handed to the engine as this sequence's failure
            failed[seq_id] = f"following its grammar failed: {e!r}"


def mask_grammars(logits: torch.Tensor, seqs: dict[int, RunnerSeq], seq_ids: list[int],
                  backend: Callable[[], object]) -> torch.Tensor:
    """logits [N, V] -> float32 [N, V] with the constrained rows masked by their grammars in one operation
    (a copy: the raw logits still give logprobs); the same tensor when no row is constrained."""
    rows = [i for i, seq_id in enumerate(seq_ids) if seqs[seq_id].matcher is not None]
    if not rows:
        return logits
    bitmask = backend().allocate_bitmask(len(seq_ids))  # [N, ceil(V / 32)] int32
    for row in rows:
        seqs[seq_ids[row]].matcher.fill_bitmask(bitmask, row)
    masked = logits.float().clone()
    apply_bitmask(masked, bitmask, rows)
    return masked
