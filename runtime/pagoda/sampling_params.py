"""Per-request sampling settings, vLLM-compatible. Validated once, at construction: every value that
passes can be turned into tensors and generators without raising (ranges as vLLM's)."""

import math
from dataclasses import dataclass, field

from pagoda.config.kv_transfer import parse_kv_transfer_params
from pagoda.errors import InvalidParam

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_GRAMMAR_CHARS = 1 << 20  # a schema, regex or grammar longer than 1 MiB is refused unread
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """One constraint on the output, vLLM's shape: a JSON schema, a regex, a choice among strings, an EBNF
    grammar, or any JSON object. Exactly one is set. `field` names where the client put it (e.g.
    "response_format"), so a grammar that does not compile is reported against that field."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    field: str = "structured_outputs"
    # a reasoning model's output: the grammar starts after this token (its end-of-thinking tag), as vLLM's
    # structured outputs do with a reasoning parser; None: from the first output token
    reasoning_end_token_id: int | None = None

    def __post_init__(self) -> None:
        set_kinds = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise InvalidParam(self.field, "structured_outputs needs exactly one of json, regex, choice, grammar, "
                                           f"json_object; got {set_kinds or 'none'}")
        kind = set_kinds[0]
        value = getattr(self, kind)
        if kind == "json":
            if not isinstance(value, dict | str) or not value:
                raise InvalidParam(self.field, "a JSON schema must be an object (or its JSON text)")
        elif kind in ("regex", "grammar"):
            if not isinstance(value, str) or not value:
                raise InvalidParam(self.field, f"{kind} must be a non-empty string")
            if len(value) > MAX_GRAMMAR_CHARS:
                raise InvalidParam(self.field, f"{kind} is longer than {MAX_GRAMMAR_CHARS} characters")
        elif kind == "choice":
            if (not isinstance(value, list | tuple) or not value
                    or any(not isinstance(c, str) or not c for c in value)):
                raise InvalidParam(self.field, "choice must be a non-empty list of non-empty strings")
            self.choice = list(value)
        elif value is not True:
            raise InvalidParam(self.field, "json_object must be true")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0, as vLLM accepts) = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None = up to the context length
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives per generated token
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    prompt_logprobs: int | None = None  # logprob of every prompt token (the first has none) and its top-k
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # never generated (a multi-token word: its last token after its prefix)
    # bad_words as token sequences, with and without a leading space: the input processor fills them
    # (an init field so dataclasses.replace, as a fork does, keeps them)
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)
    # P/D disaggregation (vLLM's shape, config.kv_transfer): do_remote_decode to a prefill engine, the prefill's
    # returned params to a decode engine; a dict is parsed into KVTransferParams
    kv_transfer_params: object = None
    # a streamed answer's tokens per chunk after the first, as vLLM's: the server's --stream-interval or
    # this, the larger (None: the server's)
    stream_interval: int | None = None
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        elif isinstance(self.stop, list | tuple):
            self.stop_strings = list(self.stop)
        elif self.stop is None:
            self.stop_strings = []
        else:
            raise InvalidParam("stop", f"stop must be a string or a list of strings, got {self.stop!r}")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, list | tuple):
            raise InvalidParam("stop_token_ids", f"stop_token_ids must be a list of integers, got "
                                                 f"{self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()
        self.kv_transfer_params = parse_kv_transfer_params(self.kv_transfer_params)
        if self.kv_transfer_params is not None and self.n != 1:
            raise InvalidParam("kv_transfer_params", "kv_transfer_params needs n = 1")
        if self.top_k == 0:
            self.top_k = -1

    def _validate(self) -> None:
        def bad(name: str, why: str) -> InvalidParam:
            return InvalidParam(name, f"{name} {why}, got {getattr(self, name)!r}")

        def integer(name: str, low: int, high: int = INT64_MAX, optional: bool = False) -> None:
            value = getattr(self, name)
            if value is None and optional:
                return
            if not _is_int(value) or not low <= value <= high:
                upper = "" if high == INT64_MAX else f" and <= {high}"
                raise bad(name, f"must be an integer >= {low}{upper}")

        def number(name: str, low: float, high: float, low_open: bool = False) -> None:
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value):
                raise bad(name, "must be a finite number")
            if value < low or value > high or (low_open and value == low):
                if high == math.inf:
                    raise bad(name, f"must be {'>' if low_open else '>='} {low}")
                raise bad(name, f"must be in {'(' if low_open else '['}{low}, {high}]")

        integer("n", 1)
        number("temperature", 0.0, math.inf)
        number("top_p", 0.0, 1.0, low_open=True)
        if not _is_int(self.top_k) or not -1 <= self.top_k <= INT64_MAX:
            raise bad("top_k", "must be -1 (off) or an integer >= 1")
        number("min_p", 0.0, 1.0)
        number("presence_penalty", -2.0, 2.0)
        number("frequency_penalty", -2.0, 2.0)
        number("repetition_penalty", 0.0, math.inf, low_open=True)
        integer("max_tokens", 1, optional=True)
        integer("min_tokens", 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParam("min_tokens", f"min_tokens ({self.min_tokens}) must be <= max_tokens "
                                             f"({self.max_tokens})")
        integer("logprobs", 0, MAX_LOGPROBS, optional=True)
        if len(self.stop_strings) > MAX_STOP_STRINGS:
            raise InvalidParam("stop", f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop_strings)}")
        if any(not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS for s in self.stop_strings):
            raise bad("stop", f"must be non-empty strings of at most {MAX_STOP_STRING_CHARS} characters")
        if any(not _is_int(t) or not 0 <= t <= INT64_MAX for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if self.seed is not None:
            # every output draws from its own generator seeded with seed + index: all must fit an int64
            if not _is_int(self.seed) or not INT64_MIN <= self.seed <= INT64_MAX - (self.n - 1):
                raise bad("seed", f"must be an integer in [{INT64_MIN}, {INT64_MAX}] (and seed + n - 1 too)")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be a boolean")
        integer("prompt_logprobs", 0, MAX_LOGPROBS, optional=True)
        integer("stream_interval", 1, optional=True)
        self._validate_logits_processors()
        if self.structured_outputs is not None:
            if isinstance(self.structured_outputs, dict):
                try:
                    self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
                except TypeError as e:  # an unknown key
                    raise InvalidParam("structured_outputs", f"structured_outputs: {e}") from None
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise bad("structured_outputs", "must be StructuredOutputsParams")
            if self.ignore_eos:  # the grammar ends the output with an end-of-sequence token
                raise InvalidParam("ignore_eos", "ignore_eos cannot be combined with structured outputs")

    def _validate_logits_processors(self) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise InvalidParam("logit_bias", f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
            for token, bias in self.logit_bias.items():
                if not _is_int(token) or token < 0:
                    raise InvalidParam("logit_bias", f"logit_bias keys must be token ids (integers >= 0), got "
                                                     f"{token!r}")
                if not _is_number(bias) or not -100 <= bias <= 100:
                    raise InvalidParam("logit_bias", f"logit_bias values must be numbers in [-100, 100], got "
                                                     f"{bias!r} for token {token}")
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if (not isinstance(ids, list | tuple) or not ids
                    or any(not _is_int(t) or not 0 <= t <= INT64_MAX for t in ids)):
                raise InvalidParam("allowed_token_ids", f"allowed_token_ids must be a non-empty list of token ids, "
                                                        f"got {ids!r}")
            self.allowed_token_ids = list(ids)
        if self.bad_words is not None:
            words = self.bad_words
            if not isinstance(words, list | tuple) or any(not isinstance(w, str) or not w.strip() for w in words):
                raise InvalidParam("bad_words", f"bad_words must be a list of non-blank strings, got {words!r}")
            self.bad_words = list(words)

    @property
    def uses_logits_processors(self) -> bool:
        """Whether sampling must change this request's logits beyond the built-in sampler's settings."""
        return bool(self.logit_bias or self.allowed_token_ids is not None or self.bad_words_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
