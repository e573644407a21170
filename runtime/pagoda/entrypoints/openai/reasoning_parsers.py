"""Reasoning parsers (`--reasoning-parser`, vLLM's names): a thinking model's output -> its reasoning and
its content. DeepSeek-R1 and Qwen3 think in `<think>…</think>` before they answer; gpt-oss in its Harmony
format's analysis channel (``openai_gptoss``: harmony_reasoning.py).

The split works on the text, so it is the same however the output arrives: whole, or streamed in deltas cut
anywhere (a tag split across deltas is held back until it is whole). The tags must be single tokens of the
model's vocabulary, as vLLM requires: the structured-output grammar starts after the end tag's token id.

As vLLM's parsers: a leading `<think>` is dropped (newer templates put it in the prompt, so the output starts
inside the thinking); text up to `</think>` is reasoning, the rest is content; an output that never closes
its thinking is all reasoning (it was cut short). Qwen3's parser differs only when the request turns
thinking off (`chat_template_kwargs: {"enable_thinking": false}`): then the output thinks only if it opens
with `<think>`; otherwise it is all content.
When the prompt already ends the thinking (Qwen3's template with thinking off writes `<think></think>`
into it), the whole output is content.
"""

from dataclasses import dataclass

START, END = "<think>", "</think>"


class ReasoningSplitter:
    """One output's split, fed its cumulative text as it grows; `reasoning` and `content` hold the text
    classified so far, `feed` returns the new reasoning."""

    def __init__(self, in_reasoning: bool, starts_with_tag_only: bool = False):
        self.in_reasoning = in_reasoning
        # thinking turned off: the output thinks only if it opens with <think> (undecided until then)
        self._undecided = in_reasoning and starts_with_tag_only
        self.reasoning = ""
        self.content = ""
        self._seen = 0  # characters of the cumulative text consumed
        self._held = ""  # text that may be the start of a tag

    def feed(self, text: str, final: bool = False) -> str:
        """text: the whole output so far (it only grows). Returns the reasoning this call added."""
        before = len(self.reasoning)
        pending = self._held + text[self._seen:]
        self._seen = len(text)
        self._held = ""
        if self._undecided:
            if START.startswith(pending) and not final:
                self._held = pending
                return ""
            self._undecided = False
            self.in_reasoning = pending.startswith(START)
        while pending and self.in_reasoning:
            start, end = pending.find(START), pending.find(END)
            if end >= 0 and (start < 0 or end < start):
                self.reasoning += pending[:end]
                pending = pending[end + len(END):]
                self.in_reasoning = False
            elif start >= 0:  # the opening tag is not text: drop it
                self.reasoning += pending[:start]
                pending = pending[start + len(START):]
            else:
                keep = 0 if final else _partial_tag(pending)
                self.reasoning += pending[: len(pending) - keep]
                self._held = pending[len(pending) - keep:]
                pending = ""
        if not self.in_reasoning:
            self.content += pending
        return self.reasoning[before:]


def _partial_tag(text: str) -> int:
    """How many trailing characters could begin a tag."""
    for k in range(min(len(END) - 1, len(text)), 0, -1):
        tail = text[-k:]
        if END.startswith(tail) or START.startswith(tail):
            return k
    return 0


@dataclass
class ReasoningParser:
    """One model family's reasoning format, bound to a tokenizer (the tags' token ids)."""

    name: str
    start_token_id: int
    end_token_id: int

    def prompt_ends_reasoning(self, prompt_token_ids: list[int]) -> bool:
        """Whether the prompt already closed the thinking (the last tag in it is </think>), as vLLM's
        is_reasoning_end: then the output is all content and the grammar starts at once."""
        for token in reversed(prompt_token_ids):
            if token == self.start_token_id:
                return False
            if token == self.end_token_id:
                return True
        return False

    def output_params(self, params):
        """The sampling parameters the split needs: these tags are text, so any will do."""
        return params

    def thinking_disabled(self, chat_template_kwargs: dict | None) -> bool:
        return self.name == "qwen3" and (chat_template_kwargs or {}).get("enable_thinking", True) is False

    def splitter(self, prompt_token_ids: list[int], chat_template_kwargs: dict | None = None) -> ReasoningSplitter:
        return ReasoningSplitter(in_reasoning=not self.prompt_ends_reasoning(prompt_token_ids),
                                 starts_with_tag_only=self.thinking_disabled(chat_template_kwargs))

    def split(self, text: str, prompt_token_ids: list[int],
              chat_template_kwargs: dict | None = None) -> tuple[str | None, str | None]:
        """A whole output -> (reasoning, content), each None when empty."""
        splitter = self.splitter(prompt_token_ids, chat_template_kwargs)
        splitter.feed(text, final=True)
        return splitter.reasoning or None, splitter.content or None

    def grammar_waits(self, prompt_token_ids: list[int], chat_template_kwargs: dict | None = None) -> bool:
        """Whether a structured output's grammar must wait for the end tag (the output starts thinking)."""
        return not self.prompt_ends_reasoning(prompt_token_ids) and not self.thinking_disabled(chat_template_kwargs)

    def count_reasoning_tokens(self, token_ids: list[int], prompt_token_ids: list[int]) -> int:
        """Output tokens inside the thinking, the tags not counted."""
        if self.prompt_ends_reasoning(prompt_token_ids):
            return 0
        count = 0
        for token in token_ids:
            if token == self.end_token_id:
                return count
            count += token != self.start_token_id
        return count


REASONING_PARSERS = ("deepseek_r1", "qwen3", "openai_gptoss")


def reasoning_parser(name: str, tokenizer):
    """The parser for `--reasoning-parser NAME`; ValueError naming the flag when the tokenizer lacks the
    tags as single tokens."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser {name!r}: choose from {', '.join(REASONING_PARSERS)}")
    if name == "openai_gptoss":
        from pagoda.entrypoints.openai.harmony_reasoning import HarmonyReasoningParser

        return HarmonyReasoningParser.for_tokenizer(tokenizer)
    vocab = tokenizer.get_vocab()
    missing = [tag for tag in (START, END) if tag not in vocab]
    if missing:
        raise ValueError(f"--reasoning-parser {name}: the model's tokenizer has no {' or '.join(missing)} token")
    return ReasoningParser(name, vocab[START], vocab[END])
