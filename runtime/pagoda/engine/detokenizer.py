"""Incremental detokenization: text grows token by token and is never cut inside a character.

Decoding a window that starts a few tokens back keeps tokenizers' leading-space rules right; text
ending in U+FFFD is an incomplete multi-byte character and waits for the next token.
"""

from dataclasses import dataclass


@dataclass
class DetokenizerState:
    prefix_offset: int
    read_offset: int
    text: str = ""


def new_state(num_prompt_tokens: int) -> DetokenizerState:
    return DetokenizerState(prefix_offset=max(num_prompt_tokens - 5, 0), read_offset=num_prompt_tokens)


def detokenize_incrementally(tokenizer, token_ids: list[int], state: DetokenizerState,
                             skip_special_tokens: bool = True) -> str:
    """Decode the tokens appended since the last call; returns the new text (also added to state.text)."""
    prefix_text = tokenizer.decode(token_ids[state.prefix_offset : state.read_offset],
                                   skip_special_tokens=skip_special_tokens)
    full_text = tokenizer.decode(token_ids[state.prefix_offset :], skip_special_tokens=skip_special_tokens)
    if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
        new_text = full_text[len(prefix_text) :]
        state.prefix_offset, state.read_offset = state.read_offset, len(token_ids)
        state.text += new_text
        return new_text
    return ""


def flush(tokenizer, token_ids: list[int], state: DetokenizerState, skip_special_tokens: bool = True) -> None:
    """At the end of a sequence, emit whatever was held back, even an incomplete character."""
    if state.read_offset >= len(token_ids):
        return
    prefix_text = tokenizer.decode(token_ids[state.prefix_offset : state.read_offset],
                                   skip_special_tokens=skip_special_tokens)
    full_text = tokenizer.decode(token_ids[state.prefix_offset :], skip_special_tokens=skip_special_tokens)
    state.text += full_text[len(prefix_text) :]
    state.prefix_offset = state.read_offset = len(token_ids)
