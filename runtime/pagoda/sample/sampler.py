"""Batched sampling: penalties, temperature, top-k, top-p, min-p, seeds and logprobs on tensors.

One row per token to sample. Per-request settings arrive as tensors, so no Python loop ever runs over
the vocabulary; the only per-row loop fills random numbers for rows that carry their own seed.
"""

from dataclasses import dataclass

import numpy as np
import torch

from pagoda.core.runner_output import SampledToken
from pagoda.layers import fused_cpu_ops


@dataclass
class SamplingTensors:
    temperature: torch.Tensor  # [N] float32, 0 = greedy
    top_p: torch.Tensor  # [N] float32
    top_k: torch.Tensor  # [N] int64, vocab size = off
    min_p: torch.Tensor  # [N] float32
    presence_penalty: torch.Tensor  # [N]
    frequency_penalty: torch.Tensor  # [N]
    repetition_penalty: torch.Tensor  # [N]
    prompt_token_ids: torch.Tensor | None  # [N, Lp] int64 padded with vocab_size; None without penalties
    output_token_ids: torch.Tensor | None  # [N, Lo] int64 padded with vocab_size
    banned_tokens: list[tuple[int, int]]  # (row, token): eos/stop ids before min_tokens
    generators: list[torch.Generator | None]  # per row; None = the shared generator
    num_logprobs: list[int | None]  # per row
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    any_penalty: bool

    @classmethod
    def build(cls, seqs: list, generators: list, vocab_size: int, eos_token_ids: set[int], device
              ) -> "SamplingTensors":
        """One row per sequence (the runner's: token_ids, num_prompt_tokens, params, matcher)."""
        params = [s.params for s in seqs]
        vocab = vocab_size
        f32 = lambda xs: torch.tensor(xs, dtype=torch.float32, device=device)  # noqa: E731
        any_penalty = any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in params)
        prompt_ids = output_ids = None
        if any_penalty:
            prompt_ids = _padded([s.token_ids[: s.num_prompt_tokens] for s in seqs], vocab, device)
            output_ids = _padded([s.token_ids[s.num_prompt_tokens :] for s in seqs], vocab, device)
        banned = []
        for row, (s, p) in enumerate(zip(seqs, params)):
            # a grammar decides when a constrained output ends: min_tokens yields to it
            if len(s.token_ids) - s.num_prompt_tokens < p.min_tokens and s.matcher is None:
                stops = set(p.stop_token_ids) | (set() if p.ignore_eos else eos_token_ids)
                banned += [(row, t) for t in stops if t < vocab]
        return cls(
            temperature=f32([p.temperature for p in params]),
            top_p=f32([p.top_p for p in params]),
            top_k=torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=device),
            min_p=f32([p.min_p for p in params]),
            presence_penalty=f32([p.presence_penalty for p in params]),
            frequency_penalty=f32([p.frequency_penalty for p in params]),
            repetition_penalty=f32([p.repetition_penalty for p in params]),
            prompt_token_ids=prompt_ids,
            output_token_ids=output_ids,
            banned_tokens=banned,
            generators=generators,
            num_logprobs=[p.logprobs for p in params],
            all_greedy=all(p.greedy for p in params),
            any_top_k=any(p.top_k > 0 for p in params),
            any_top_p=any(p.top_p < 1.0 for p in params),
            any_min_p=any(p.min_p > 0 for p in params),
            any_penalty=any_penalty,
        )


def _padded(rows: list[list[int]], pad: int, device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    out = np.full((len(rows), width), pad, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return torch.from_numpy(out).to(device)


class Sampler:
    def __init__(self, generator: torch.Generator | None = None):
        self.generator = generator

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, t: SamplingTensors, raw_logits: torch.Tensor | None = None
                 ) -> list[SampledToken]:
        """logits [N, V] float32 -> one token per row. raw_logits [N, V]: the model's logits before a
        grammar masked `logits`, for the logprobs (None: `logits` are the model's)."""
        logits = logits.float()
        want_logprobs = any(n is not None for n in t.num_logprobs)
        raw = logits if raw_logits is None else raw_logits.float()
        raw_logprobs = torch.log_softmax(raw, dim=-1) if want_logprobs else None
        logits = self.process_logits(logits, t)
        greedy_tokens = fused_cpu_ops.argmax(logits)
        if t.all_greedy:
            tokens = greedy_tokens
        else:
            tokens = self._sample_random(logits, t, greedy_tokens)
        token_list = tokens.tolist()
        if not want_logprobs:
            return [SampledToken(tok) for tok in token_list]
        return self._with_logprobs(raw_logprobs, tokens, token_list, t.num_logprobs)

    @staticmethod
    def process_logits(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        """float32 logits [N, V] -> the logits every row samples from: penalties, banned tokens."""
        if t.any_penalty:
            logits = apply_penalties(logits, t)
        if t.banned_tokens:
            rows, cols = zip(*t.banned_tokens)
            logits[list(rows), list(cols)] = float("-inf")
        return logits

    @staticmethod
    def probabilities(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        """processed logits [N, V] -> the distribution a non-greedy row samples from [N, V]: temperature,
        top-k, top-p, min-p (greedy rows: as with temperature 1; callers take their argmax)."""
        is_greedy = t.temperature < 1e-5
        temperature = torch.where(is_greedy, torch.ones_like(t.temperature), t.temperature)
        logits = logits / temperature.unsqueeze(1)
        if t.any_top_k or t.any_top_p:
            logits = apply_top_k_top_p(logits, t.top_k if t.any_top_k else None, t.top_p if t.any_top_p else None)
        probs = torch.softmax(logits, dim=-1)
        if t.any_min_p:
            threshold = t.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs

    def _sample_random(self, logits, t: SamplingTensors, greedy_tokens):
        if fused_cpu_ops.usable(logits):
            return self._sample_cpu(logits, t)
        is_greedy = t.temperature < 1e-5
        probs = self.probabilities(logits, t)
        # argmax(p / E) with E ~ Exp(1) draws from p (the exponential race) without a CPU sync
        noise = torch.empty_like(probs)
        shared_rows = [i for i, g in enumerate(t.generators) if g is None]
        if shared_rows:
            noise[shared_rows] = torch.empty(len(shared_rows), probs.shape[1], device=probs.device).exponential_(
                generator=self.generator)
        for i, gen in enumerate(t.generators):
            if gen is not None:
                noise[i].exponential_(generator=gen)
        sampled = fused_cpu_ops.argmax(probs / noise)
        return torch.where(is_greedy, greedy_tokens, sampled)

    def _sample_cpu(self, logits, t: SamplingTensors):
        """The CPU's draw (sampler_cpu.cpp): each row's softmax(logits / temperature) with min-p, by its inverse
        cumulative distribution and one uniform number (the exponential race above needs a random number and a
        log per vocabulary entry: tens of milliseconds a step on a CPU). Top-k and top-p mask first, as -inf."""
        temperature = t.temperature
        if t.any_top_k or t.any_top_p:
            is_greedy = temperature < 1e-5
            logits = logits / torch.where(is_greedy, torch.ones_like(temperature), temperature).unsqueeze(1)
            logits = apply_top_k_top_p(logits, t.top_k if t.any_top_k else None, t.top_p if t.any_top_p else None)
            temperature = torch.where(is_greedy, temperature, torch.ones_like(temperature))  # greedy rows stay so
        return torch.ops.pagoda_cpu.sample_categorical(logits.contiguous(), temperature.contiguous(),
                                                       t.min_p.contiguous(), self._uniforms(t.generators))

    def _uniforms(self, generators: list) -> torch.Tensor:
        """One uniform number in [0, 1) per row, float64: from the row's own generator (a seeded request) or the
        shared one."""
        shared_rows = [i for i, g in enumerate(generators) if g is None]
        if len(shared_rows) == len(generators):
            return torch.rand(len(generators), dtype=torch.float64, generator=self.generator)
        uniforms = torch.empty(len(generators), dtype=torch.float64)
        if shared_rows:
            uniforms[shared_rows] = torch.rand(len(shared_rows), dtype=torch.float64, generator=self.generator)
        for i, gen in enumerate(generators):
            if gen is not None:
                uniforms[i] = torch.rand(1, dtype=torch.float64, generator=gen)
        return uniforms

    @staticmethod
    def _with_logprobs(raw_logprobs, tokens, token_list, num_logprobs) -> list[SampledToken]:
        sampled_lp = raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
        ranks = (raw_logprobs > sampled_lp.unsqueeze(1)).sum(dim=1) + 1
        k = max(n or 0 for n in num_logprobs)
        top_lp, top_ids = raw_logprobs.topk(k, dim=-1) if k else (None, None)
        out = []
        for i, tok in enumerate(token_list):
            n = num_logprobs[i]
            if n is None:
                out.append(SampledToken(tok))
                continue
            out.append(SampledToken(tok, float(sampled_lp[i]), int(ranks[i]),
                                    top_ids[i, :n].tolist() if n else [], top_lp[i, :n].tolist() if n else []))
        return out


def token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, L] padded with vocab_size -> [N, vocab_size] occurrence counts."""
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.float32, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    vocab = logits.shape[1]
    output_counts = token_counts(t.output_token_ids, vocab)
    # repetition penalty (as in HF/vLLM): over prompt and output tokens, divide positive logits
    seen = (output_counts > 0) | (token_counts(t.prompt_token_ids, vocab) > 0)
    rep = t.repetition_penalty.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    # OpenAI presence/frequency penalties: over output tokens only
    logits = logits - t.frequency_penalty.unsqueeze(1) * output_counts
    return logits - t.presence_penalty.unsqueeze(1) * (output_counts > 0).float()


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None):
    """Mask everything outside each row's top-k and nucleus (top-p) with -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[1]
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - top_k.clamp(1, vocab)).unsqueeze(1))  # [N, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - top_p.unsqueeze(1))
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
