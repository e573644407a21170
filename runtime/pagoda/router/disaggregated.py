"""P/D disaggregation: a prompt's prefill on one backend, its decode on another, the KV cache moving between
them (the engines' `--kv-transfer-config`, NixlConnector).

The router runs the protocol of vLLM's disaggregated proxies and llm-d's routing sidecar (`nixlv2`): it sends
the request to a prefill backend with `max_tokens: 1`, `stream: false` and `kv_transfer_params:
{"do_remote_decode": true, ...}`, reads the `kv_transfer_params` of its answer (the blocks to pull and where
from), and forwards the original request with those params to a decode backend, whose answer streams back as
any other. The prefill backend is chosen by `--prefill-policy` (prefix by default: a prompt that extends an
earlier one goes where its blocks are cached), the decode backend by `--policy`.

A prompt under `--pd-threshold` tokens goes to a decode backend alone, as llm-d's P/D decider does (a short
prefill costs less than a transfer). A prefill that fails (no prefill backend, refused, an error status, an
answer without `kv_transfer_params`) is not the client's failure: the request goes to a decode backend alone,
which computes the prompt itself, and `pagoda_router:pd_prefill_failures_total{reason}` counts it. So is a
prefill that has not answered within `--prefill-timeout` seconds (reason `timeout`): a hung prefill backend
must not hold the request forever.

The EPP's P/D mode (pagoda.router.epp) uses `prefill_for` to name the prefill endpoint in llm-d's
`x-prefiller-host-port` header; the sidecar beside the decode pod then runs the protocol above.
"""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
from prometheus_client import Counter
from starlette.types import Send

from pagoda.http.errors import APIError
from pagoda.router.metrics import PREFIX
from pagoda.router.policies import Decision, RoutingRequest
from pagoda.router.proxy import ProxyResponse, Router

logger = logging.getLogger(__name__)

PD_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})  # the doors vLLM's proxies split
PREFILL_BACKEND_HEADER = "x-pagoda-prefill-backend"  # on a P/D response: which backend ran the prefill
PREFILLER_HEADER = "x-prefiller-host-port"  # llm-d (EPP -> sidecar): the prefill endpoint, `ip:port`
CHARS_PER_TOKEN = 4  # llm-d's estimate of a prompt's tokens (AverageCharactersPerToken)
PREFILL_METRICS_PREFIX = PREFIX + "prefill_"
# what the prefill request carries (vLLM's toy proxy and llm-d's sidecar send exactly these keys)
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
_NOT_TO_PREFILL = frozenset({"accept-encoding"})  # its JSON is read here, so uncompressed


def estimated_tokens(body: dict) -> int | None:
    """The prompt's length in tokens as llm-d estimates it (bytes / 4; a chat's messages as JSON); a prompt of
    token ids counts exactly. None when the body has no prompt."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return len(prompt.encode()) // CHARS_PER_TOKEN
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) for t in prompt):
            return len(prompt)
        if isinstance(prompt[0], str):
            return len(prompt[0].encode()) // CHARS_PER_TOKEN
    messages = body.get("messages")
    if isinstance(messages, list):
        return len(json.dumps(messages, separators=(",", ":")).encode()) // CHARS_PER_TOKEN
    return None


def prefill_body(body: dict) -> bytes:
    """The request as the prefill backend gets it: one token, no stream, its KV kept for a remote decode."""
    prefill = {**body, "kv_transfer_params": dict(PREFILL_PARAMS), "stream": False, "max_tokens": 1}
    prefill.pop("stream_options", None)
    prefill.pop("min_tokens", None)  # over max_tokens 1 it would be refused
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    return json.dumps(prefill).encode()


class Disaggregation:
    """The prefill backends (their own pool, policy and metrics: a Router) and the choice to use them."""

    def __init__(self, prefill: Router, threshold: int, registry, timeout_s: float):
        self.prefill = prefill
        self.threshold = threshold
        self.timeout_s = timeout_s  # a prefill's whole answer (one forward pass and one token) within this
        self.requests = Counter(PREFIX + "pd_requests", "Generation requests by how they ran: `prefill-decode`, "
                                "`decode-only` (below --pd-threshold, or the client sent its own "
                                "kv_transfer_params) or `fallback` (the prefill failed; decode computed the "
                                "prompt).", ["path"], registry=registry)
        self.prefill_failures = Counter(PREFIX + "pd_prefill_failures", "Prefills that failed, so the request "
                                        "went to a decode backend alone, by reason.", ["reason"],
                                        registry=registry)

    def skip_reason(self, method: str, path: str | None, body: dict | None) -> str | None:
        """Why a request goes to a decode backend alone; None when it takes the P/D path. `other` (not a
        generation request) is not counted."""
        if method != "POST" or (path or "").partition("?")[0] not in PD_PATHS or not isinstance(body, dict):
            return "other"
        if "kv_transfer_params" in body:  # a client (another proxy) running the protocol itself
            return "client-params"
        tokens = estimated_tokens(body)
        if tokens is None or tokens < self.threshold:
            return "below-threshold"
        return None

    def choose_prefill(self, request: RoutingRequest) -> tuple[Decision | None, str]:
        """A healthy, unsaturated prefill backend by the prefill policy, or None and why there is none."""
        try:
            return self.prefill.choose(request, set()), ""
        except APIError as e:
            return None, "no-prefill-backend" if e.status == 503 else "prefill-saturated"

    def prefill_for(self, method: str, path: str | None, request: RoutingRequest) -> Decision | None:
        """The EPP: the prefill backend to name to the decode pod's sidecar, or None for decode alone."""
        skip = self.skip_reason(method, path, request.body)
        if skip is not None:
            if skip != "other":
                self.requests.labels("decode-only").inc()
            return None
        decision, reason = self.choose_prefill(request)
        if decision is None:
            self.prefill_failures.labels(reason).inc()
            self.requests.labels("fallback").inc()
            return None
        self.requests.labels("prefill-decode").inc()
        self.prefill.policy.routed(request, decision)
        return decision


class PrefillFailed(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason  # the label of pagoda_router:pd_prefill_failures_total


class DisaggregatedResponse(ProxyResponse):
    """ProxyResponse whose forwarding runs the prefill first (when the request takes the P/D path) and then
    sends the decode with the prefill's kv_transfer_params; every other request forwards as before."""

    def __init__(self, pd: Disaggregation, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pd = pd

    async def forward(self, send: Send) -> None:
        body = self.request.body
        skip = self.pd.skip_reason(self.method, self.path, body)
        if skip is not None:
            if skip != "other":
                self.pd.requests.labels("decode-only").inc()
            return await super().forward(send)
        try:
            params = await self.run_prefill(body)
        except PrefillFailed as failure:
            logger.warning("prefill failed (%s); the decode backend computes the prompt", failure)
            self.pd.prefill_failures.labels(failure.reason).inc()
            self.pd.requests.labels("fallback").inc()
            return await super().forward(send)
        self.pd.requests.labels("prefill-decode").inc()
        self.request_body = json.dumps({**body, "kv_transfer_params": params}).encode()
        return await super().forward(send)

    async def run_prefill(self, body: dict) -> dict:
        """The prefill's kv_transfer_params (what the decode backend pulls, from where)."""
        prefill = self.pd.prefill
        await prefill.prepare(self.request)
        decision, reason = self.pd.choose_prefill(self.request)
        if decision is None:
            raise PrefillFailed(reason, "no prefill backend is in the rotation" if reason == "no-prefill-backend"
                                else "every prefill backend is saturated")
        backend = decision.backend
        headers = [(k, v) for k, v in self.forward_headers if k.lower() not in _NOT_TO_PREFILL]
        backend.in_flight += 1
        deadline = asyncio.timeout(self.pd.timeout_s)
        try:
            async with deadline:
                async with prefill.session.post(backend.url + self.path, headers=headers,
                                                data=prefill_body(body), allow_redirects=False,
                                                skip_auto_headers=("Accept-Encoding", "User-Agent")) as response:
                    prefill.metrics.requests.labels(backend.url, str(response.status)).inc()
                    answer = await response.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            prefill.metrics.requests.labels(backend.url, "error").inc()
            if deadline.expired():  # slow or hung, not gone: it stays in the rotation (the probe judges it)
                raise PrefillFailed("timeout", f"{backend.url}: no answer within --prefill-timeout "
                                    f"{self.pd.timeout_s:g} s") from None
            if isinstance(e, (aiohttp.ClientConnectorError, asyncio.TimeoutError)):
                backend.mark_down(f"{type(e).__name__}: {e}")  # leaves now; the health probe brings it back
                prefill.backend_changed(backend, False)
                raise PrefillFailed("connect", f"{backend.url}: {type(e).__name__}: {e}") from None
            raise PrefillFailed("error", f"{backend.url}: {type(e).__name__}: {e}") from None
        finally:
            backend.in_flight -= 1
        if response.status != 200:
            raise PrefillFailed(f"status-{response.status}", f"{backend.url} answered {response.status}: "
                                f"{answer[:300].decode(errors='replace')}")
        try:
            params = json.loads(answer).get("kv_transfer_params")
        except (ValueError, AttributeError):
            params = None
        if not isinstance(params, dict):
            raise PrefillFailed("no-kv-transfer-params", f"{backend.url} answered without kv_transfer_params "
                                "(is it serving with --kv-transfer-config?)")
        prefill.policy.routed(self.request, decision)
        self.extra_headers.append((PREFILL_BACKEND_HEADER.encode(), backend.url.encode()))
        return params


__all__ = ["Disaggregation", "DisaggregatedResponse", "PREFILLER_HEADER", "estimated_tokens", "prefill_body"]
