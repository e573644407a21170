"""The precise policy: route by what each replica's prefix cache holds now (its KV events, ``kv_index``),
measured in the request's own blocks.

The request's token ids come from a replica's ``POST /tokenize``, sent the door's own body
(``{"endpoint": path, "request": body}``: chat with its tools and ``chat_template_kwargs``, Responses with
its instructions, items and stored ``previous_response_id`` history, Messages with its system prompt), which
the server renders by the code the door runs, so the tokens are the engine's; a completion's text prompt
goes as ``{"prompt"}``, and a body of token ids is used as is. A Responses follow-up's history is stored on
one replica: the others answer 404, and are tried in turn. Their block hashes are the engine's
(``core.block_hash``, the adapter's root when the model is an adapter the events named); each replica scores
the longest run of leading blocks it holds. The longest run, held by one replica, wins within the prefix
policy's load bound. A request no single replica holds most of (a brand-new conversation: no run, a run
under half the prompt, or a run that several replicas hold, such as a shared system prompt) is a new
tenant of some replica's cache: it goes, within the same load bound, to the replica whose cache churns
least (``KVIndex.churn``: blocks stored lately, from its events, plus those expected of requests routed
there), ties to the longest run, then the least load. Placing new conversations by in-flight load alone
spreads requests but not cache footprints: with users thinking between turns, a replica's in-flight count
says little about how many live conversations it must keep cached, and one replica ended up evicting 2-3x
another's blocks (docs/router.md, "precise").
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from pagoda.core.block_hash import BASE_ROOT, chain_hashes, lora_root
from pagoda.http.doors import TOKENIZE_ENDPOINTS
from pagoda.router.backends import Backend
from pagoda.router.kv_index import KVIndex
from pagoda.router.policies import (
    MIN_MATCH_SHARE,
    Decision,
    Policy,
    RoutingRequest,
    least_loaded,
    within_bound,
)

logger = logging.getLogger(__name__)

TOKENIZE_TIMEOUT = 5.0


def tokenize_query(request: RoutingRequest) -> dict | None:
    """What a replica's /tokenize is sent: a door's own body with its path, which the server renders as that
    door does; a completion's text prompt in vLLM's shape; None when there is nothing to tokenize."""
    body = request.body
    door = request.path if request.path in TOKENIZE_ENDPOINTS else None
    if request.path is None and isinstance(body.get("messages"), list):
        door = "/v1/chat/completions"  # no path known (a caller of the policy alone): a chat body
    if door is not None:
        return {"model": body.get("model"), "endpoint": door, "request": body}
    if isinstance(body.get("prompt"), str):
        return {"model": body.get("model"), "prompt": body["prompt"]}
    return None


class Precise(Policy):
    name = "precise"

    def __init__(self, index: KVIndex | None = None):
        super().__init__()
        self.index = index or KVIndex()

    async def prepare(self, request: RoutingRequest, candidates: list[Backend],
                      session: aiohttp.ClientSession | None) -> None:
        """Find the request's token ids (once), from its body or a replica's /tokenize."""
        if request.token_ids is not None or request.body is None:
            return
        body = request.body
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            request.token_ids = prompt
            return
        query = tokenize_query(request)
        if query is None or session is None or not candidates:
            return
        n = len(candidates)
        order = [candidates[(self.turn + i) % n] for i in range(n)]
        # a Responses follow-up renders its stored history, which one replica holds: the others say 404
        tries = order if query.get("endpoint") == "/v1/responses" and body.get("previous_response_id") else order[:1]
        headers = {"Authorization": request.authorization} if request.authorization else {}
        for backend in tries:
            try:
                async with session.post(backend.url + "/tokenize", json=query, headers=headers,
                                        timeout=aiohttp.ClientTimeout(total=TOKENIZE_TIMEOUT)) as r:
                    if r.status == 200:
                        request.token_ids = (await r.json()).get("tokens")
                    if r.status != 404:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                logger.debug("tokenize on %s failed: %s", backend.url, e)
                return

    def hashes_for(self, request: RoutingRequest, url: str) -> list[int]:
        entry = self.index.entry(url)
        if not request.token_ids or entry is None or entry.block_size is None:
            return []
        root = lora_root(request.model) if request.model in entry.lora_names else BASE_ROOT
        key = (entry.block_size, root)
        cached = request.chains.get(key)
        if cached is None:
            # the engine never reuses the last prompt token's block-to-be (its logits are computed)
            ids = request.token_ids[: len(request.token_ids) - 1]
            cached = request.chains[key] = chain_hashes(ids, entry.block_size, root)
        return cached

    def least_churn(self, candidates: list[Backend], matches: dict[str, int]) -> Backend:
        """A new tenant's replica: within the load bound, the least churning cache; then the longest run, the
        least load, round the list (the least loaded replica is always within the bound). A replica not heard
        from yet counts at the others' mean churn (unknown, not idle: one that never publishes must not draw
        every new conversation)."""
        now = time.monotonic()
        n = len(candidates)
        order = [candidates[(self.turn + i) % n] for i in range(n)]
        allowed = [b for b in order if within_bound(b, candidates)] or order
        known = {b.url: self.index.churn(b.url, now) for b in candidates if self.index.entries(b.url)}
        unknown = sum(known.values()) / len(known) if known else 0.0
        return min(allowed, key=lambda b: (known.get(b.url, unknown), -matches.get(b.url, 0), b.load()))

    def choose(self, request, candidates):
        fallback = least_loaded(candidates, self._next_turn())
        chains = {b.url: self.hashes_for(request, b.url) for b in candidates}
        prompt_blocks = max((len(c) for c in chains.values()), default=0)
        if prompt_blocks == 0:
            return Decision(fallback, "no-tokens" if not request.token_ids else "no-prefix")
        matches = {b.url: self.index.match(b.url, chains[b.url]) for b in candidates}
        best = max(matches.values())
        if best == 0:
            return Decision(self.least_churn(candidates, matches), "no-prefix-match", 0, prompt_blocks)
        if best < MIN_MATCH_SHARE * prompt_blocks:
            choice = self.least_churn(candidates, matches)
            return Decision(choice, "prefix-short-match", matches[choice.url], prompt_blocks)
        holders = [b for b in candidates if matches[b.url] == best]
        if len(holders) > 1:  # a shared prefix (a system prompt): no replica holds this request's own blocks
            choice = self.least_churn(holders, matches)
            if within_bound(choice, candidates):
                return Decision(choice, "prefix-shared", best, prompt_blocks)
            return Decision(fallback, "prefix-overloaded", matches[fallback.url], prompt_blocks)
        choice = holders[0]
        if not within_bound(choice, candidates):
            return Decision(fallback, "prefix-overloaded", matches[fallback.url], prompt_blocks)
        return Decision(choice, "prefix-match", best, prompt_blocks)

    def routed(self, request, decision):
        """Count the blocks the request will store there (its prompt past the run held, and its answer's, at
        most) until the replica's events bring the real ones."""
        url = decision.backend.url
        entry = self.index.entry(url)
        if not request.token_ids or entry is None or not entry.block_size:
            return
        body = request.body or {}
        answer = body.get("max_completion_tokens") or body.get("max_tokens") or body.get("max_output_tokens") or 0
        answer = answer if isinstance(answer, int) and answer > 0 else 0
        total = (len(request.token_ids) + answer) // entry.block_size
        self.index.expect(url, total - self.index.match(url, self.hashes_for(request, url)))
