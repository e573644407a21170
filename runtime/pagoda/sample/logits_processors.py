"""Per-request changes to the batch's logits before sampling: logit_bias, allowed_token_ids, bad_words.

They work on the whole batch's [N, V] logits tensor at once (a few indexed writes, no loop over the
vocabulary), after the grammar mask and before the sampler; a batch where no request uses them is
returned untouched, so they cost nothing there.
"""

import torch

from pagoda.sampling_params import SamplingParams


def apply_logits_processors(logits: torch.Tensor, params: list[SamplingParams], output_token_ids: list[list[int]],
                            in_place: bool = False) -> torch.Tensor:
    """logits [N, V] -> float32 [N, V] with each row's processors applied; the same tensor when no row uses
    any. in_place: the caller's tensor may be written (else a copy is, unless converting to float32 made
    one already). output_token_ids: each row's generated tokens so far."""
    rows = [i for i, p in enumerate(params) if p.uses_logits_processors]
    if not rows:
        return logits
    converted = logits.float()
    logits = converted.clone() if converted is logits and not in_place else converted
    vocab = logits.shape[1]
    bias_rows, bias_cols, bias_values = [], [], []
    allowed_rows, allowed_ids = [], []
    banned_rows, banned_cols = [], []
    for row in rows:
        p = params[row]
        if p.logit_bias:
            for token, bias in p.logit_bias.items():
                if token < vocab:  # ids were checked against the model's vocabulary on input
                    bias_rows.append(row)
                    bias_cols.append(token)
                    bias_values.append(bias)
        if p.allowed_token_ids is not None:
            allowed_rows.append(row)
            allowed_ids.append([t for t in p.allowed_token_ids if t < vocab])
        for token in banned_next_tokens(p.bad_words_token_ids, output_token_ids[row]):
            if token < vocab:
                banned_rows.append(row)
                banned_cols.append(token)
    if bias_rows:
        logits.index_put_((torch.tensor(bias_rows, device=logits.device), torch.tensor(bias_cols, device=logits.device)),
                          torch.tensor(bias_values, dtype=logits.dtype, device=logits.device), accumulate=True)
    for row, ids in zip(allowed_rows, allowed_ids):
        kept = logits[row, ids]  # [len(ids)]
        logits[row] = float("-inf")
        logits[row, ids] = kept
    if banned_rows:
        logits[banned_rows, banned_cols] = float("-inf")
    return logits


def banned_next_tokens(bad_words_token_ids: list[list[int]], output_token_ids: list[int]) -> list[int]:
    """vLLM's bad_words rule: a one-token word is always banned; a longer one bans its last token right
    after the rest of it was generated."""
    banned = []
    for word in bad_words_token_ids:
        prefix = word[:-1]
        if not prefix or (len(output_token_ids) >= len(prefix) and output_token_ids[-len(prefix):] == prefix):
            banned.append(word[-1])
    return banned


def tokenize_bad_words(tokenizer, words: list[str]) -> list[list[int]]:
    """Each word as the tokenizer writes it alone, and after a space where the space joins its first
    token (" word" as one token): a word can appear either way in generated text. A space that stays a
    token of its own is not banned (it would ban the word's tokens after every space)."""
    sequences: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        candidates = [bare]
        if spaced and bare and len(spaced) == len(bare) and spaced[0] != bare[0]:
            candidates.append(spaced)
        for ids in candidates:
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences
