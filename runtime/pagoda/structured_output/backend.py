"""The xgrammar backend (chosen over llguidance by measurement, see docs/server.md). Only this module
imports xgrammar."""

import functools
import json
import re
import threading

import torch
import xgrammar as xgr

from pagoda.errors import InvalidParam
from pagoda.sampling_params import StructuredOutputsParams

_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")


class GrammarMatcher:
    """One sequence's position in its grammar: fills its row of the batch's bitmask, follows its tokens."""

    def __init__(self, matcher: xgr.GrammarMatcher):
        self._matcher = matcher
        self.num_accepted = 0  # output tokens followed so far

    def accept(self, token_id: int) -> bool:
        self.num_accepted += 1
        return self._matcher.accept_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


class AfterReasoningMatcher:
    """A grammar that starts once the reasoning ends: every token is allowed up to and including the end
    token, then the grammar's matcher follows the rest."""

    def __init__(self, matcher: GrammarMatcher, end_token_id: int):
        self._matcher = matcher
        self._end = end_token_id
        self.reasoning_ended = False
        self.num_accepted = 0

    def accept(self, token_id: int) -> bool:
        self.num_accepted += 1
        if self.reasoning_ended:
            return self._matcher.accept(token_id)
        self.reasoning_ended = token_id == self._end
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.reasoning_ended:  # else the row keeps its allocation's all-allowed bits
            self._matcher.fill_bitmask(bitmask, row)

    @property
    def is_terminated(self) -> bool:
        return self.reasoning_ended and self._matcher.is_terminated


class GrammarBackend:
    """Compiles constraints for one tokenizer (compiled grammars cached by their text) and makes matchers.
    Thread-safe: the server compiles in worker threads while the engine thread makes matchers."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=True)

    def compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The constraint compiled; InvalidParam naming `spec.field` if it does not compile."""
        kind = spec.kind
        try:
            if kind == "json":
                schema = spec.json if isinstance(spec.json, dict) else json.loads(spec.json)
                schema = json.dumps(_without_control_characters(schema))
                # no free whitespace: a model that likes spaces could otherwise fill max_tokens with them
                return self._compiler.compile_json_schema(schema, any_whitespace=False)
            if kind == "json_object":
                return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return self._compiler.compile_regex(spec.regex)
            if kind == "choice":
                return self._compiler.compile_regex("|".join(f"(?:{_regex_literal(c)})" for c in spec.choice))
            return self._compiler.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError, TypeError, RecursionError) as e:
            first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            first_line = _LOG_PREFIX.sub("", first_line)  # xgrammar's "[time] file.cc:line: " says nothing to clients
            raise InvalidParam(spec.field, f"invalid {kind} for structured outputs: {first_line}") from None

    def matcher(self, spec: StructuredOutputsParams) -> GrammarMatcher | AfterReasoningMatcher:
        matcher = GrammarMatcher(xgr.GrammarMatcher(self.compile(spec)))
        if spec.reasoning_end_token_id is not None:
            return AfterReasoningMatcher(matcher, spec.reasoning_end_token_id)
        return matcher

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(num_rows, self.vocab_size)  # [num_rows, ceil(vocab / 32)] int32


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """logits [N, V] float32, bitmask [N, ceil(V / 32)] int32: disallowed tokens of `rows` become -inf."""
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)


def _regex_literal(text: str) -> str:
    return re.sub(r"[.^$*+?()\[\]{}|\\/]", lambda m: "\\" + m.group(0), text)


def _without_control_characters(schema):
    """xgrammar 0.2.8 lets raw control characters into length-bounded strings (which JSON forbids): such a
    string gets the equivalent pattern, which xgrammar compiles as a JSON string."""
    if isinstance(schema, list):
        return [_without_control_characters(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _without_control_characters(v) for k, v in schema.items()}
    bounded = "minLength" in out or "maxLength" in out
    if out.get("type") == "string" and bounded and "pattern" not in out and "format" not in out:
        low, high = out.get("minLength", 0), out.get("maxLength", "")
        if isinstance(low, int) and isinstance(high, int | str):
            out["pattern"] = f'^[^\\x00-\\x1f"\\\\]{{{low},{high}}}$'
    return out


_backends_lock = threading.Lock()


def get_grammar_backend(tokenizer_path: str, vocab_size: int, stop_token_ids: tuple[int, ...]) -> GrammarBackend:
    """One backend per tokenizer in a process: the input processor's compile warms the runner's cache."""
    with _backends_lock:
        return _backend(tokenizer_path, vocab_size, stop_token_ids)


@functools.lru_cache(maxsize=4)
def _backend(tokenizer_path: str, vocab_size: int, stop_token_ids: tuple[int, ...]) -> GrammarBackend:
    from transformers import AutoTokenizer

    return GrammarBackend(AutoTokenizer.from_pretrained(tokenizer_path), vocab_size, list(stop_token_ids))
