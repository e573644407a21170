"""Each group's durable bookkeeping, kept as annotations on its head StatefulSet, and the rules
that move it on. Kept in the cluster, not in memory, so an operator restart or a failed pass never
loses a group restart, a backoff or a rollout deadline."""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass, replace

from .times import seconds_since, to_iso

ANNOTATION_EPOCH = "pagoda.dev/epoch"
ANNOTATION_RECREATIONS = "pagoda.dev/recreations"
ANNOTATION_RECREATED_AT = "pagoda.dev/recreated-at"
ANNOTATION_RECREATE_PENDING = "pagoda.dev/recreate-pending"
ANNOTATION_MEMBERS = "pagoda.dev/members"
ANNOTATION_REPLACED_AT = "pagoda.dev/replaced-at"
ANNOTATION_READY_SINCE = "pagoda.dev/ready-since"
ANNOTATION_GENERATION = "pagoda.dev/generation"


@dataclass(frozen=True)
class GroupRecord:
    """Per-group bookkeeping kept as annotations on the group's head StatefulSet.

    epoch: bumped to recreate the group (it changes the pod revision, so old pods are told apart);
    recreations/recreated_at: consecutive recreations and the last one, for the backoff;
    pending: a recreation was asked for during the backoff and is still owed;
    replaced_at: when the group last got a new revision (created, rolled or recreated), for the
    rollout's progress deadline;
    ready_since: when a group that has been recreated became Ready, so its backoff is forgotten only
    once it has stayed Ready for a while (a group that crashes right after Ready keeps backing off);
    members: (pod name, pod UID) of every pod seen in the group at its revision. A member that is gone
    or came back with another UID was lost: kept here, not in memory, so neither an API error nor an
    operator restart can forget it (a recreated pod has the same name, revision and 0 restarts)."""
    epoch: int = 0
    recreations: int = 0
    recreated_at: str = ""
    pending: bool = False
    members: tuple[tuple[str, str], ...] = ()
    replaced_at: str = ""
    ready_since: str = ""
    generation: str = ""  # the LLMDeployment's generation when the group got its current template

    def annotations(self) -> dict[str, str]:
        return {
            ANNOTATION_EPOCH: str(self.epoch),
            ANNOTATION_RECREATIONS: str(self.recreations),
            ANNOTATION_RECREATED_AT: self.recreated_at,
            ANNOTATION_RECREATE_PENDING: "true" if self.pending else "false",
            ANNOTATION_MEMBERS: json.dumps(dict(self.members), sort_keys=True, separators=(",", ":")),
            ANNOTATION_REPLACED_AT: self.replaced_at,
            ANNOTATION_READY_SINCE: self.ready_since,
            ANNOTATION_GENERATION: self.generation,
        }

    @classmethod
    def from_annotations(cls, annotations: dict[str, str] | None) -> GroupRecord:
        a = annotations or {}
        return cls(
            epoch=int(a.get(ANNOTATION_EPOCH) or 0),
            recreations=int(a.get(ANNOTATION_RECREATIONS) or 0),
            recreated_at=a.get(ANNOTATION_RECREATED_AT) or "",
            pending=a.get(ANNOTATION_RECREATE_PENDING) == "true",
            members=_members(a.get(ANNOTATION_MEMBERS)),
            replaced_at=a.get(ANNOTATION_REPLACED_AT) or "",
            ready_since=a.get(ANNOTATION_READY_SINCE) or "",
            generation=a.get(ANNOTATION_GENERATION) or "",
        )


def _members(text: str | None) -> tuple[tuple[str, str], ...]:
    try:
        members = json.loads(text or "{}")
    except ValueError:
        return ()  # an edited, unreadable annotation: start recording again
    if not isinstance(members, dict):
        return ()
    return tuple(sorted((str(k), str(v)) for k, v in members.items()))


def backoff_after(record: GroupRecord, ready: bool, now: datetime.datetime, reset_seconds: float) -> GroupRecord:
    """The group's backoff bookkeeping after this pass: a recreated group that has stayed Ready for
    `reset_seconds` has stopped crashing and starts again from no backoff; leaving Ready restarts
    the clock. Nothing is tracked for a group that was never recreated."""
    if not record.recreations:
        return record if not record.ready_since else replace(record, ready_since="")
    if not ready:
        return replace(record, ready_since="")
    if not record.ready_since:
        return replace(record, ready_since=to_iso(now))
    if (seconds_since(record.ready_since, now) or 0) >= reset_seconds:
        return replace(record, recreations=0, ready_since="")
    return record
