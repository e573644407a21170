"""`--reasoning-parser openai_gptoss`: gpt-oss's Harmony output -> reasoning and content.

gpt-oss answers in messages, each a header and a body:
``<|channel|>analysis<|message|>…thinking…<|end|><|start|>assistant<|channel|>final<|message|>…answer…<|return|>``
(the chat template's generation prompt ends with ``<|start|>assistant``). Bodies of the analysis channel are
the reasoning; bodies of the others (final, and commentary: preambles and tool calls) are the content; headers
and markers are neither. The markers are special tokens, so the parser asks for outputs detokenized with
them (``output_params``). As the ``<think>`` splitter, it works on the cumulative text however it is cut into
deltas (a marker split across deltas is held back until whole), and an output with no marker at all is all
content (a model that does not speak Harmony).

A structured output's grammar applies from the first token here (``grammar_waits`` is false): Harmony's
end of thinking is a run of tokens (``<|channel|>final<|message|>``), not one token the grammar can wait for.
"""

import dataclasses
from dataclasses import dataclass

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, RETURN, CALL)
ENDS_BODY = (END, RETURN, CALL)
REASONING_CHANNEL = "analysis"


def channel_name(header: str) -> str:
    """'analysis', 'final', or 'commentary' of a header's text after <|channel|> (' to=…', <|constrain|> …)."""
    return header.strip().split(" ")[0].split("<")[0]


class HarmonySplitter:
    """One output's split, fed its cumulative text as it grows (ReasoningSplitter's contract)."""

    def __init__(self, in_body_of: str | None = None):
        self.channel = in_body_of  # the body being read: its channel; None: reading a header
        self.header = ""  # the current header's text after <|channel|>
        self.in_channel_name = False
        self.seen_marker = in_body_of is not None
        self.reasoning = ""
        self.content = ""
        self._unclassified = ""  # text before any marker: content unless a header follows
        self._seen = 0
        self._held = ""

    def feed(self, text: str, final: bool = False) -> str:
        before = len(self.reasoning)
        pending = self._held + text[self._seen:]
        self._seen, self._held = len(text), ""
        while pending:
            at, marker = _first_marker(pending)
            if marker is None:
                keep = 0 if final else _partial_marker(pending)
                self._take(pending[: len(pending) - keep])
                self._held = pending[len(pending) - keep:]
                break
            self._take(pending[:at])
            self._mark(marker)
            pending = pending[at + len(marker):]
        if final and not self.seen_marker:  # no Harmony at all: the text is the answer
            self.content += self._unclassified
            self._unclassified = ""
        return self.reasoning[before:]

    def _take(self, text: str) -> None:
        if not text:
            return
        if self.channel is not None:
            if self.channel == REASONING_CHANNEL:
                self.reasoning += text
            else:
                self.content += text
        elif self.in_channel_name:
            self.header += text
        elif not self.seen_marker:
            self._unclassified += text

    def _mark(self, marker: str) -> None:
        self.seen_marker = True
        self._unclassified = ""  # a role name ("assistant") before the first header's marker
        if marker == MESSAGE and self.channel is None:
            self.channel, self.in_channel_name = channel_name(self.header), False
        elif marker == CHANNEL and self.channel is None:
            self.header, self.in_channel_name = "", True
        elif marker in ENDS_BODY or marker == START:
            self.channel, self.header, self.in_channel_name = None, "", False


def _first_marker(text: str) -> tuple[int, str | None]:
    found = [(text.find(m), m) for m in MARKERS if m in text]
    return min(found) if found else (-1, None)


def _partial_marker(text: str) -> int:
    """How many trailing characters could begin a marker."""
    for k in range(min(max(map(len, MARKERS)) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-k:]) for m in MARKERS):
            return k
    return 0


@dataclass
class HarmonyReasoningParser:
    """ReasoningParser's interface for Harmony, bound to the tokenizer's marker ids."""

    name: str
    ids: dict  # marker -> token id
    decode: object  # token ids -> text
    end_token_id: int | None = None  # no single token ends the thinking (see the module docstring)

    @classmethod
    def for_tokenizer(cls, tokenizer) -> "HarmonyReasoningParser":
        vocab = tokenizer.get_vocab()
        missing = [m for m in MARKERS if m not in vocab]
        if missing:
            raise ValueError(f"--reasoning-parser openai_gptoss: the model's tokenizer has no {', '.join(missing)} "
                             "token (gpt-oss's Harmony format)")
        return cls("openai_gptoss", {m: vocab[m] for m in MARKERS}, tokenizer.decode)

    def output_params(self, params):
        """The markers are special tokens: the split reads the text with them (and strips them itself)."""
        return dataclasses.replace(params, skip_special_tokens=False)

    def _open_body(self, prompt_token_ids: list[int]) -> str | None:
        """The channel whose body the prompt leaves open (a prompt ending in …<|channel|>final<|message|>),
        else None: the output starts with a header."""
        by_id = {i: m for m, i in self.ids.items()}
        for k in range(len(prompt_token_ids) - 1, -1, -1):
            marker = by_id.get(prompt_token_ids[k])
            if marker is None:
                continue
            if marker != MESSAGE:
                return None
            for j in range(k - 1, -1, -1):
                if by_id.get(prompt_token_ids[j]) in (CHANNEL, START):
                    return channel_name(self.decode(prompt_token_ids[j + 1 : k]))
            return None
        return None

    def prompt_ends_reasoning(self, prompt_token_ids: list[int]) -> bool:
        return self._open_body(prompt_token_ids) not in (None, REASONING_CHANNEL)

    def thinking_disabled(self, chat_template_kwargs: dict | None) -> bool:
        return False

    def splitter(self, prompt_token_ids: list[int], chat_template_kwargs: dict | None = None) -> HarmonySplitter:
        return HarmonySplitter(self._open_body(prompt_token_ids))

    def split(self, text: str, prompt_token_ids: list[int],
              chat_template_kwargs: dict | None = None) -> tuple[str | None, str | None]:
        splitter = self.splitter(prompt_token_ids, chat_template_kwargs)
        splitter.feed(text, final=True)
        return splitter.reasoning or None, splitter.content or None

    def grammar_waits(self, prompt_token_ids: list[int], chat_template_kwargs: dict | None = None) -> bool:
        return False

    def count_reasoning_tokens(self, token_ids: list[int], prompt_token_ids: list[int]) -> int:
        """Output tokens in analysis bodies, markers and headers not counted."""
        by_id = {i: m for m, i in self.ids.items()}
        channel, header_start, count = self._open_body(prompt_token_ids), None, 0
        for k, token in enumerate(token_ids):
            marker = by_id.get(token)
            if marker is None:
                count += channel == REASONING_CHANNEL
            elif marker == CHANNEL and channel is None:
                header_start = k + 1
            elif marker == MESSAGE and channel is None:
                channel = channel_name(self.decode(token_ids[header_start:k])) if header_start is not None else ""
            elif marker in ENDS_BODY or marker == START:
                channel, header_start = None, None
        return count
