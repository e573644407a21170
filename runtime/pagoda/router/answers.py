"""What a backend answered, as text, for the prefix index.

The engine's prefix cache keeps the blocks of the tokens it generated, and a conversation's next turn
resends the answer as an assistant message, so the router records the answer in the chosen backend's
index too. Without it a turn matched only its previous prompt: with a short system prompt and a long answer
that is under half the new prompt, and the turn went by load, away from its history.
"""

from __future__ import annotations

import json

MAX_ANSWER_BYTES = 1 << 20  # a longer response is not recorded (its text would not fit one index anyway)


class AnswerTap:
    """Collects a response's bytes as they pass (bounded) and reads choice 0's text out of them once done."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0

    def add(self, chunk: bytes) -> None:
        if self.size <= MAX_ANSWER_BYTES:
            self.parts.append(chunk)
            self.size += len(chunk)

    def text(self, is_stream: bool) -> str | None:
        """Choice 0's generated text (chat `delta.content`/`message.content`, completion `text`); None when
        the response was too long, was an error, or was not one of those."""
        if self.size > MAX_ANSWER_BYTES:
            return None
        body = b"".join(self.parts)
        try:
            if not is_stream:
                return _choice_text(json.loads(body), "message")
            pieces = []
            for line in body.split(b"\n"):
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                piece = _choice_text(json.loads(line[6:]), "delta")
                if piece is None:
                    return None
                pieces.append(piece)
            return "".join(pieces)
        except (ValueError, TypeError, AttributeError):
            return None


def _choice_text(event, message_key: str) -> str | None:
    """Choice 0's text in one event or body ("" when it carries none, e.g. the usage chunk); None on an error."""
    if not isinstance(event, dict) or "error" in event:
        return None
    for choice in event.get("choices") or []:
        if choice.get("index", 0) != 0:
            continue
        if "text" in choice:
            return choice["text"] or ""
        return (choice.get(message_key) or {}).get("content") or ""
    return ""
