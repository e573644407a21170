"""Structured outputs: a grammar engine (xgrammar) behind one small interface. `GrammarBackend` compiles
a request's constraint and makes matchers; `apply_bitmask` masks a batch's logits in one operation."""

from pagoda.structured_output.backend import (
    GrammarBackend,
    GrammarMatcher,
    apply_bitmask,
    get_grammar_backend,
)

__all__ = ["GrammarBackend", "GrammarMatcher", "apply_bitmask", "get_grammar_backend"]
