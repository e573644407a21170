"""The one timestamp format the operator writes (status conditions, group annotations): RFC 3339 UTC."""

from __future__ import annotations

import datetime

FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def to_iso(moment: datetime.datetime) -> str:
    return moment.astimezone(datetime.timezone.utc).strftime(FORMAT)


def from_iso(text: str) -> datetime.datetime | None:
    """None for an empty or unreadable value (an annotation someone edited)."""
    try:
        moment = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except (AttributeError, ValueError):
        return None
    return moment if moment.tzinfo else moment.replace(tzinfo=datetime.timezone.utc)


def seconds_since(text: str, now: datetime.datetime) -> float | None:
    moment = from_iso(text)
    return None if moment is None else (now - moment).total_seconds()
