"""Completions' `suffix`: a fill-in-the-middle prompt, for tokenizers that have FIM tokens."""

from pagoda.http.errors import invalid_request

# (prefix, suffix, middle) token spellings, prefix-suffix-middle order: StarCoder / SmolLM, Qwen2.5-Coder
FIM_TOKEN_SETS = (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
                  ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"))


def fim_token_ids(tokenizer) -> tuple[int, int, int] | None:
    vocab = tokenizer.get_vocab()
    for names in FIM_TOKEN_SETS:
        if all(name in vocab for name in names):
            return tuple(vocab[name] for name in names)
    return None


def fill_in_the_middle(tokenizer, prompt, suffix: str) -> list[int]:
    """prompt (text or token ids) and suffix -> <prefix> prompt <suffix> suffix <middle>, as token ids: the
    model writes what goes between them. A 400 naming `suffix` if the tokenizer has no FIM tokens."""
    ids = fim_token_ids(tokenizer)
    if ids is None:
        raise invalid_request("suffix needs a model whose tokenizer has fill-in-the-middle tokens (e.g. "
                              "<fim_prefix>, <fim_suffix>, <fim_middle>); this one has none", "suffix")
    prefix_id, suffix_id, middle_id = ids
    prompt_ids = prompt if isinstance(prompt, list) else tokenizer.encode(prompt, add_special_tokens=False)
    return [prefix_id, *prompt_ids, suffix_id, *tokenizer.encode(suffix, add_special_tokens=False), middle_id]
