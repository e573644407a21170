"""Scoring prompt tokens (vLLM's prompt_logprobs): each token's logprob under the model given the tokens
before it, with its rank and the top-k alternatives, from the hidden states of a prefill chunk."""

from collections.abc import Callable

import torch

from pagoda.core.runner_output import SampledToken

ROWS_PER_PIECE = 512  # logits are [rows, vocab] float32: bound the memory a long prompt takes


@torch.inference_mode()
def score_prompt_tokens(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                        target_ids: list[int], k: int, score: bool = True) -> list[SampledToken]:
    """hidden [R, H]: row i predicts target_ids[i]. Raw logprobs (log_softmax of the model's logits).
    score False: only take part in computing the logits (a TP rank that does not sample), return []."""
    scored: list[SampledToken] = []
    for begin in range(0, len(target_ids), ROWS_PER_PIECE):
        end = min(begin + ROWS_PER_PIECE, len(target_ids))
        logits = compute_logits(hidden[begin:end])  # [r, V]; collective under tensor parallelism
        if not score:
            continue
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # [r, V]
        targets = torch.tensor(target_ids[begin:end], device=logprobs.device)
        chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1)  # [r]
        ranks = (logprobs > chosen.unsqueeze(1)).sum(dim=1) + 1
        top_lp, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
        for i, (token, lp, rank) in enumerate(zip(target_ids[begin:end], chosen.tolist(), ranks.tolist())):
            scored.append(SampledToken(token, lp, rank, top_ids[i].tolist() if k else [],
                                       top_lp[i].tolist() if k else []))
    return scored


def score_scheduled_prompts(out, seqs, hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor],
                            score: bool) -> dict[int, tuple[int, list[SampledToken]]]:
    """The logprobs of the prompt tokens a step's chunks predict (out: its SchedulerOutput, seqs: the
    runner's sequences by id, hidden: the step's rows), for sequences that asked: seq id -> (position of
    the first scored token, scores). Hidden row of position p predicts the token at p + 1; a chunk ending
    mid-prompt leaves its last token's score to the next chunk, which starts with it. Every TP rank
    computes the logits (a collective gather); only the one that samples (`score`) keeps them."""
    result: dict[int, tuple[int, list[SampledToken]]] = {}
    row = 0
    for s in out.scheduled:
        seq = seqs[s.seq_id]
        k = seq.params.prompt_logprobs
        start = s.num_computed_tokens
        stop = min(start + s.num_new_tokens, seq.num_prompt_tokens - 1)  # the last prompt row predicts output
        if k is not None and stop > start:
            targets = seq.token_ids[start + 1 : stop + 1]
            scored = score_prompt_tokens(compute_logits, hidden[row : row + stop - start], targets, k, score)
            if score:
                result[s.seq_id] = (start + 1, scored)
        row += s.num_new_tokens
    return result
