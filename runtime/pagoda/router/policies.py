"""Routing policies: given a request and the backends that may take it, pick one and say why."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

from pagoda.router.backends import Backend
from pagoda.router.prefix_index import BLOCK_CHARS, PrefixIndex, block_hashes

POLICIES = ("round-robin", "least-load", "prefix", "session", "precise")
# bounded load (consistent hashing with bounded loads, Mirrokni et al.): a preferred backend (prefix match,
# session owner) is taken only while its load stays within BALANCE_FACTOR x the mean load, counting this
# request, plus BALANCE_SLACK; past that the request goes to the least-loaded backend instead. The slack is
# there because a continuous-batching replica runs a few more requests at once at little cost, while a
# conversation moved elsewhere recomputes its whole prompt (at 4 requests over 3 replicas the bound alone
# moved one turn in five)
BALANCE_FACTOR = 1.25
BALANCE_SLACK = 2
# a match is worth concentrating load only when it covers at least this share of the prompt and is not a
# shared prefix (PrefixIndex.shared: a system prompt that other conversations continued): a new
# conversation matching just a shared system prompt goes by load (its later turns then follow it), else
# the conversations behind one system prompt would all pile onto the replica that first saw it (a 3-replica
# run had 46 of 51 turns as prefix matches and placed 19, 26 and 6 turns)
MIN_MATCH_SHARE = 0.5


@dataclass
class RoutingRequest:
    """What a policy may look at: the prompt as text (for prefix), a session key (header or `user`)."""

    prefix_text: str | None = None
    session_key: str | None = None
    model: str | None = None
    # what joins the prompt's text and the answer's in the next request of a conversation (chat: the
    # assistant message's head; a completion: nothing); None where the answer is not recorded
    answer_prefix: str | None = None
    body: dict | None = field(default=None, repr=False)  # the JSON body (precise: what to tokenize)
    path: str | None = None  # the door the body was sent to (precise: how the server renders it)
    authorization: str | None = field(default=None, repr=False)  # the client's, for the replica's /tokenize
    token_ids: list[int] | None = field(default=None, repr=False)  # precise: the prompt's tokens, once known
    chains: dict = field(default_factory=dict, repr=False)  # precise: (block size, root) -> block hashes
    _hashes: list[int] | None = field(default=None, repr=False)

    def hashes(self) -> list[int]:
        if self._hashes is None:
            self._hashes = block_hashes(self.prefix_text) if self.prefix_text else []
        return self._hashes


@dataclass
class Decision:
    backend: Backend
    reason: str  # the label of pagoda_router:routing_decisions_total
    matched_chars: int = 0  # prefix: characters of the prompt the chosen backend is believed to hold
    prompt_chars: int = 0


def least_loaded(candidates: list[Backend], start: int = 0) -> Backend:
    """Lowest load; ties go round the list from `start`, so equal backends share the work."""
    n = len(candidates)
    order = [candidates[(start + i) % n] for i in range(n)]
    return min(order, key=lambda b: b.load())


def within_bound(backend: Backend, candidates: list[Backend]) -> bool:
    total = sum(b.load() for b in candidates) + 1  # + this request
    return backend.load() + 1 <= math.ceil(BALANCE_FACTOR * total / len(candidates)) + BALANCE_SLACK


class Policy:
    name = ""
    wants_answers = False  # answered() is called with the backend's generated text

    def __init__(self) -> None:
        self.turn = 0

    async def prepare(self, request: RoutingRequest, candidates: list[Backend], session) -> None:
        """Anything the policy must fetch before choosing (precise: the prompt's token ids); once a request."""

    def choose(self, request: RoutingRequest, candidates: list[Backend]) -> Decision:
        raise NotImplementedError

    def routed(self, request: RoutingRequest, decision: Decision) -> None:
        """The request went to decision.backend (called once it was accepted)."""

    def answered(self, request: RoutingRequest, decision: Decision, text: str) -> None:
        """decision.backend answered the request with `text` (choice 0's), completely."""

    def forget(self, url: str) -> None:
        """The backend left or came back empty."""

    def _next_turn(self) -> int:
        self.turn += 1
        return self.turn


class RoundRobin(Policy):
    name = "round-robin"

    def choose(self, request, candidates):
        return Decision(candidates[self._next_turn() % len(candidates)], "round-robin")


class LeastLoad(Policy):
    name = "least-load"

    def choose(self, request, candidates):
        return Decision(least_loaded(candidates, self._next_turn()), "least-load")


class Prefix(Policy):
    """The backend holding the longest prefix of the prompt, within the load bound; else least-load."""

    name = "prefix"
    wants_answers = True

    def __init__(self, index: PrefixIndex | None = None):
        super().__init__()
        self.index = index or PrefixIndex()

    def choose(self, request, candidates):
        hashes = request.hashes()
        prompt_chars = len(request.prefix_text or "")
        fallback = least_loaded(candidates, self._next_turn())
        if not hashes:
            return Decision(fallback, "no-prefix", 0, prompt_chars)
        matches = {b.url: self.index.match(b.url, hashes) for b in candidates}
        best = max(matches.values())
        if best == 0:
            return Decision(fallback, "no-prefix-match", 0, prompt_chars)
        short = best < MIN_MATCH_SHARE * len(hashes)
        if short or self.index.shared(hashes, best):
            # the least loaded; among equals the longest match, then round the list as least_loaded
            n = len(candidates)
            order = [candidates[(self.turn + i) % n] for i in range(n)]
            choice = min(order, key=lambda b: (b.load(), -matches[b.url]))
            reason = "prefix-short-match" if short else "prefix-shared"
            return Decision(choice, reason, matches[choice.url] * BLOCK_CHARS, prompt_chars)
        holders = [b for b in candidates if matches[b.url] == best]
        choice = least_loaded(holders, self.turn)
        if not within_bound(choice, candidates):
            return Decision(fallback, "prefix-overloaded", matches[fallback.url] * BLOCK_CHARS, prompt_chars)
        return Decision(choice, "prefix-match", best * BLOCK_CHARS, prompt_chars)

    def routed(self, request, decision):
        hashes = request.hashes()
        if hashes:
            self.index.insert(decision.backend.url, hashes)

    def answered(self, request, decision, text):
        # the engine caches the generated tokens' blocks too, and the next turn resends them
        if request.prefix_text and request.answer_prefix is not None and text:
            self.index.insert(decision.backend.url, block_hashes(request.prefix_text + request.answer_prefix + text))

    def forget(self, url):
        self.index.forget(url)


class Session(Policy):
    """Sticky by session key: rendezvous hashing (the same key -> the same backend, in every router replica,
    and only the sessions of a backend that leaves move). No key: least-load."""

    name = "session"

    @staticmethod
    def _score(key: str, url: str) -> int:
        return int.from_bytes(hashlib.blake2b(f"{key}\x00{url}".encode(), digest_size=8).digest(), "big")

    def choose(self, request, candidates):
        if not request.session_key:
            return Decision(least_loaded(candidates, self._next_turn()), "no-session-key")
        owner = max(candidates, key=lambda b: self._score(request.session_key, b.url))
        return Decision(owner, "session")


def make_policy(name: str) -> Policy:
    """The policies of this module; "precise" is pagoda.router.precise's (it builds on this one)."""
    classes = {cls.name: cls for cls in (RoundRobin, LeastLoad, Prefix, Session)}
    if name not in classes:
        raise ValueError(f"--policy {name!r}: choose one of {', '.join(POLICIES)}")
    return classes[name]()
