"""Input processing: a prompt (text, token ids, or {"prompt"/"prompt_token_ids"}) and its sampling
parameters become validated token ids, before the request reaches the engine core. Everything a client
can get wrong is caught here, as InvalidParam naming the field, so nothing it sends raises in a step."""

from dataclasses import dataclass

from pagoda.core.request_kind import RequestParams, kind_of
from pagoda.errors import InvalidParam
from pagoda.sample.logits_processors import tokenize_bad_words
from pagoda.sampling_params import SamplingParams
from pagoda.structured_output import get_grammar_backend


@dataclass(frozen=True)
class ProcessedPrompt:
    text: str | None
    token_ids: list[int]


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, max_num_seqs: int,
                 grammar_key: tuple[str, int, tuple[int, ...]] | None = None):
        self.tokenizer = tokenizer
        self.grammar_key = grammar_key  # (tokenizer path, vocab size, stop ids) of the grammar backend
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs

    def process(self, prompt, params: RequestParams) -> ProcessedPrompt:
        kind_of(params)  # raises InvalidParam for parameters of no kind
        text, token_ids = self._split(prompt)
        if token_ids is None:
            if not isinstance(text, str) or not text:
                raise InvalidParam("prompt", "prompt must not be empty")
            # a string of n characters never encodes to more than ~4n tokens: refuse absurd ones unread
            if len(text) > 64 * self.max_model_len:
                raise InvalidParam("prompt", f"the prompt has {len(text)} characters, more than this model's "
                                             f"maximum context length of {self.max_model_len} tokens can hold")
            token_ids = self.tokenizer.encode(text)
        self.check_request(token_ids, params)
        return ProcessedPrompt(text, list(token_ids))

    def check_request(self, token_ids, params: RequestParams) -> None:
        """The prompt's token ids, and the parameters of a kind that samples; a kind that does not generates
        nothing, so its prompt may fill the context."""
        self.check_token_ids(token_ids)
        if kind_of(params).samples:
            self.check_params(params)
            self.check_length(len(token_ids), params)
        else:
            self.check_prompt_fits(len(token_ids))

    @staticmethod
    def _split(prompt) -> tuple[str | None, list[int] | None]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text = prompt.get("prompt")
                if text is not None and not isinstance(text, str):
                    raise InvalidParam("prompt", f"prompt must be a string, got {type(text).__name__}")
                return text, prompt["prompt_token_ids"]
            if "prompt" in prompt:
                return prompt["prompt"], None
            raise InvalidParam("prompt", "prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return prompt, None
        if isinstance(prompt, list | tuple):
            return None, list(prompt)
        raise InvalidParam("prompt", f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def check_token_ids(self, token_ids) -> None:
        if not isinstance(token_ids, list | tuple) or not token_ids:
            raise InvalidParam("prompt", "prompt must not be empty")
        vocab = self.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in token_ids):
            raise InvalidParam("prompt", f"prompt token ids must be integers in [0, {vocab})")

    def check_params(self, params: SamplingParams) -> None:
        if params.n > self.max_num_seqs:
            raise InvalidParam("n", f"n ({params.n}) must be <= max_num_seqs ({self.max_num_seqs}): every "
                                    "output is a running sequence")
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise InvalidParam("stop_token_ids", f"stop_token_ids must be in [0, {self.vocab_size})")
        for name in ("logit_bias", "allowed_token_ids"):
            outside = sorted(t for t in getattr(params, name) or () if t >= self.vocab_size)
            if outside:
                raise InvalidParam(name, f"{name} has token ids outside this model's vocabulary [0, "
                                         f"{self.vocab_size}): {outside[:8]}")
        if params.bad_words:  # this engine's tokenizer (the same params may have served another model)
            params.bad_words_token_ids = tokenize_bad_words(self.tokenizer, params.bad_words)
        if params.structured_outputs is not None:
            if self.grammar_key is None:
                raise InvalidParam("structured_outputs", "structured outputs are not available in this engine")
            # compiled here, off the engine thread; the model runner's compile of it is then a cache hit
            get_grammar_backend(*self.grammar_key).compile(params.structured_outputs)

    def check_prompt_fits(self, num_prompt_tokens: int) -> None:
        if num_prompt_tokens > self.max_model_len:
            raise InvalidParam("input", f"This model's maximum context length is {self.max_model_len} tokens. "
                                        f"However, the input has {num_prompt_tokens} tokens.")

    def check_length(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        limit = self.max_model_len
        wanted = num_prompt_tokens + (params.max_tokens or 1)
        if num_prompt_tokens >= limit or wanted > limit:
            raise InvalidParam(
                "prompt" if num_prompt_tokens >= limit else "max_tokens",
                f"This model's maximum context length is {limit} tokens. However, you requested {wanted} tokens "
                f"({num_prompt_tokens} in the prompt, {params.max_tokens or 1} for the completion).")


def check_priority(priority, policy: str) -> None:
    """A request's `priority` (vLLM's): an integer, other than 0 only under the priority policy."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise InvalidParam("priority", f"priority must be an integer; got {priority!r}")
    if priority != 0 and policy != "priority":
        raise InvalidParam("priority", f"priority {priority} needs the priority scheduling policy "
                                       "(--scheduling-policy priority); this engine schedules first come, first served")
