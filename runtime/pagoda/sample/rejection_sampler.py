"""Verifying drafts (speculative sampling, Leviathan et al. / Chen et al.): the output keeps exactly the
target's distribution.

For draft x_j proposed with probability q_j(x_j) where the target gives p_j(x_j): accept it with
probability min(1, p_j(x_j) / q_j(x_j)); at the first rejection emit a token drawn from
norm(max(0, p_j - q_j)) and stop; if every draft is accepted, emit one more token drawn from p_k. An
n-gram draft is a point mass (q_j(x_j) = 1). Greedy rows have a one-hot p, so a draft is accepted iff it
is the argmax and the emitted token is the argmax: the output equals decoding without speculation.
"""

import torch

from pagoda.layers import fused_cpu_ops


class RejectionSampler:
    def __init__(self, generator: torch.Generator | None = None):
        self.generator = generator  # for rows without a seed of their own

    @torch.inference_mode()
    def __call__(self, target_probs: torch.Tensor, draft_token_ids: list[list[int]],
                 draft_probs: list[torch.Tensor | None] | None, is_greedy: list[bool],
                 generators: list[torch.Generator | None]) -> list[list[int]]:
        """target_probs [R, V]: the target's distribution at each scheduled position, k_i + 1 consecutive
        rows for sequence i (its last token, then each draft); draft_token_ids[i]: its k_i drafts;
        draft_probs[i] [k_i, V]: the distributions they were drawn from (None for a sequence, or for all:
        point masses); is_greedy / generators: per sequence. Returns per sequence its accepted drafts then
        one token."""
        device = target_probs.device
        num_drafts = [len(d) for d in draft_token_ids]
        if draft_probs is None:
            draft_probs = [None] * len(num_drafts)
        starts = [0]
        for k in num_drafts:
            starts.append(starts[-1] + k + 1)
        draft_rows = torch.tensor([starts[i] + j for i, k in enumerate(num_drafts) for j in range(k)],
                                  dtype=torch.long, device=device)
        drafts = torch.tensor([t for d in draft_token_ids for t in d], dtype=torch.long, device=device)  # [D]
        p_draft = target_probs[draft_rows, drafts]  # [D]
        # [D]: q(x) of each draft, 1 for a point mass
        q_draft = torch.cat([q[torch.arange(k, device=device), torch.tensor(d, device=device)] if q is not None
                             else torch.ones(k, dtype=target_probs.dtype, device=device)
                             for q, d, k in zip(draft_probs, draft_token_ids, num_drafts)])
        uniform = torch.cat([torch.rand(k, generator=self._gen(g), device=device)
                             for k, g in zip(num_drafts, generators)])  # [D]
        # accept with probability min(1, p / q): u < p / q, written without dividing by q
        accepted = (uniform * q_draft < p_draft).tolist()

        num_accepted, final_rows = [], []
        offset = 0
        for i, k in enumerate(num_drafts):
            n = next((j for j in range(k) if not accepted[offset + j]), k)
            num_accepted.append(n)
            if n == k:  # every draft accepted: one more token from the target at the last position
                final_rows.append(target_probs[starts[i] + k])
            else:
                p = target_probs[starts[i] + n]
                if draft_probs[i] is not None:
                    q = draft_probs[i][n]
                else:
                    q = torch.zeros_like(p)
                    q[draft_token_ids[i][n]] = 1.0
                residual = (p - q).clamp_(min=0.0)
                # a rejection means sum(max(0, p - q)) > 0; keep p if rounding left nothing
                final_rows.append(residual if float(residual.sum()) > 0 else p)
            offset += k
        final = torch.stack(final_rows)  # [S, V], unnormalized where residual
        tokens = sample_rows(final, is_greedy, [self._gen(g) for g in generators])
        return [draft_token_ids[i][:n] + [tok] for i, (n, tok) in enumerate(zip(num_accepted, tokens))]

    def _gen(self, generator: torch.Generator | None) -> torch.Generator | None:
        return generator if generator is not None else self.generator



def sample_rows(weights: torch.Tensor, is_greedy: list[bool], generators: list[torch.Generator | None]
                ) -> list[int]:
    """One token per row of non-negative weights [S, V] (not necessarily normalized): argmax for greedy
    rows, else a draw from w / sum(w): on the CPU by the kernel's inverse distribution (sampler_cpu.cpp, on
    log w), elsewhere by the exponential race argmax(w / E), E ~ Exp(1)."""
    if fused_cpu_ops.usable(weights):
        uniforms = torch.cat([torch.rand(1, dtype=torch.float64, generator=g) for g in generators])
        temperature = torch.tensor([0.0 if greedy else 1.0 for greedy in is_greedy])
        return torch.ops.pagoda_cpu.sample_categorical(weights.float().log().contiguous(), temperature,
                                                       torch.zeros(len(is_greedy)), uniforms).tolist()
    noise = torch.empty_like(weights)
    for row, g in enumerate(generators):
        noise[row].exponential_(generator=g)
    sampled = fused_cpu_ops.argmax(weights / noise)
    greedy = torch.tensor(is_greedy, device=weights.device)
    return torch.where(greedy, fused_cpu_ops.argmax(weights), sampled).tolist()


def target_probs(sampler, logits: torch.Tensor, t) -> tuple[torch.Tensor, list[bool]]:
    """The target's distribution per row [N, V] as the sampler would draw from it (penalties, banned tokens,
    temperature, top-k/p, min-p); greedy rows one-hot at their argmax. Also which rows are greedy."""
    logits = sampler.process_logits(logits.float(), t)
    probs = sampler.probabilities(logits, t)
    is_greedy = t.temperature < 1e-5
    if bool(is_greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(is_greedy.unsqueeze(1), one_hot, probs)
    return probs, is_greedy.tolist()
