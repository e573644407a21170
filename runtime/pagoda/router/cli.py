"""`pagoda router` flags (DESIGN.md: --backend URL ... | --k8s-service NAME [--namespace NS], --policy,
--host, --port) and the entry point. Each flag can also come from PAGODA_ROUTER_<FLAG>; flags win."""

from __future__ import annotations

import argparse
import os

from pagoda.router.args import RouterArgs
from pagoda.router.policies import POLICIES

ENV_PREFIX = "PAGODA_ROUTER_"


def _env(flag: str, default=None):
    return os.environ.get(ENV_PREFIX + flag.replace("-", "_").upper(), default)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative integer")
    return value


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = RouterArgs()
    source = parser.add_mutually_exclusive_group()  # PAGODA_ROUTER_BACKEND / _K8S_SERVICE: see router_args
    source.add_argument("--backend", "--decode-backend", action="append", dest="backends", metavar="URL",
                        help="a `pagoda serve` replica's root URL, e.g. http://10.0.0.5:8000 (repeatable; "
                             "PAGODA_ROUTER_BACKEND takes a comma-separated list); with --prefill-backend, "
                             "a decode backend")
    source.add_argument("--k8s-service", metavar="NAME",
                        help="discover the replicas from this Kubernetes Service's EndpointSlices (watched)")
    parser.add_argument("--namespace", metavar="NS", default=_env("namespace"),
                        help="the Service's namespace (default: the pod's own, else `default`)")
    parser.add_argument("--policy", choices=POLICIES, default=_env("policy"),
                        help=f"how a backend is chosen (default: {defaults.policy}; least-load for the decode "
                             "backends in P/D mode)")
    parser.add_argument("--host", default=_env("host", defaults.host))
    # string defaults: argparse converts them with `type`, so a bad variable is an error naming the flag
    parser.add_argument("--port", type=int, default=_env("port", str(defaults.port)))
    parser.add_argument("--max-in-flight-per-backend", type=_positive_int,
                        default=_env("max-in-flight-per-backend", str(defaults.max_in_flight_per_backend)),
                        help="requests the router keeps open to one backend; past this on every backend it "
                             "answers 429 with Retry-After (default: %(default)s)")
    parser.add_argument("--session-header", default=_env("session-header", defaults.session_header),
                        help="the header the session policy sticks by; else the body's `user` "
                             "(default: %(default)s)")
    parser.add_argument("--backend-api-key", default=_env("backend-api-key", os.environ.get("PAGODA_API_KEY")),
                        help="the replicas' API key, for reading their /v1/models (which models and adapters "
                             "each serves); clients' own keys are passed through unchanged")
    parser.add_argument("--kv-events-endpoint", default=_env("kv-events-endpoint", defaults.kv_events_endpoint),
                        help="--policy precise: each backend's KV events PUB endpoint, a template over its URL "
                             "({host}; {port} is its HTTP port) (default: %(default)s, the endpoint of "
                             "`pagoda serve --kv-events-config '{\"enable_kv_cache_events\": true}'`)")
    parser.add_argument("--kv-events-replay-endpoint", default=_env("kv-events-replay-endpoint"),
                        help="--policy precise: each backend's replay endpoint, a template as above (e.g. "
                             "tcp://{host}:5558); fills sequence gaps (default: none: a gap clears the entry)")
    parser.add_argument("--kv-events-topic", default=_env("kv-events-topic", defaults.kv_events_topic),
                        help="--policy precise: the topic the backends publish on (default: all)")
    parser.add_argument("--epp", action="store_true", default=_env("epp", "") in ("1", "true", "True"),
                        help="also serve the Gateway API Inference Extension's Endpoint Picker protocol (Envoy "
                             "ext_proc over gRPC, with gRPC health) on --epp-port: a gateway's InferencePool "
                             "points at it. See docs/router.md")
    parser.add_argument("--epp-port", type=int, default=_env("epp-port", str(defaults.epp_port)),
                        help="the Endpoint Picker's gRPC port (default: %(default)s)")
    parser.add_argument("--epp-max-queue", type=_positive_int,
                        default=_env("epp-max-queue", str(defaults.epp_max_queue)),
                        help="--epp: a backend with this many requests waiting takes no more; with every "
                             "backend so, the picker answers 429 (default: %(default)s)")
    parser.add_argument("--epp-fallbacks", type=_non_negative_int,
                        default=_env("epp-fallbacks", str(defaults.epp_fallbacks)),
                        help="--epp: name up to this many other endpoints after the chosen one (least loaded "
                             "first), `ip:port,ip:port,...`, for a gateway that retries down the list; Envoy's "
                             "ORIGINAL_DST cluster reads one endpoint only (default: %(default)s)")
    prefill = parser.add_mutually_exclusive_group()  # P/D disaggregation (pagoda.router.disaggregated)
    prefill.add_argument("--prefill-backend", action="append", dest="prefill_backends", metavar="URL",
                         help="P/D mode: a prefill backend (`pagoda serve --kv-transfer-config` with kv_role "
                              "kv_producer or kv_both) (repeatable; PAGODA_ROUTER_PREFILL_BACKEND takes a "
                              "comma-separated list); --backend then names the decode backends")
    prefill.add_argument("--prefill-k8s-service", metavar="NAME",
                         help="P/D mode: discover the prefill backends from this Service's EndpointSlices")
    parser.add_argument("--prefill-policy", choices=POLICIES,
                        default=_env("prefill-policy", defaults.prefill_policy),
                        help="P/D mode: how a prefill backend is chosen (default: %(default)s)")
    parser.add_argument("--pd-threshold", type=_non_negative_int,
                        default=_env("pd-threshold", str(defaults.pd_threshold)),
                        help="P/D mode: a prompt under this many tokens (estimated as llm-d does: its bytes / 4) "
                             "skips the prefill backends and goes to a decode backend alone (default: "
                             "%(default)s: every prompt takes the P/D path)")
    parser.add_argument("--prefill-timeout", type=_positive_float, metavar="SECONDS",
                        default=_env("prefill-timeout", str(defaults.prefill_timeout)),
                        help="P/D mode: a prefill not answered within this many seconds is given up and the "
                             "request goes to a decode backend alone, which computes the prompt (a hung prefill "
                             "backend must not hold requests forever; a prefill is one forward pass, so this is "
                             "far above a long prompt's prefill) (default: %(default)s)")
    parser.add_argument("--log-level", default=_env("log-level", defaults.log_level),
                        choices=("debug", "info", "warning", "error", "critical"))


def router_args(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> RouterArgs:
    from pagoda.router.backends import normalize_url

    if not ns.backends and not ns.k8s_service:  # neither flag: the environment's (a flag replaces both)
        env_backends = _env("backend")
        ns.backends = [u for u in env_backends.split(",") if u.strip()] if env_backends else None
        ns.k8s_service = None if ns.backends else _env("k8s-service")
    if not ns.backends and not ns.k8s_service:
        parser.error("give the replicas: --backend URL (repeatable) or --k8s-service NAME")
    if ns.namespace and not ns.k8s_service:
        parser.error("--namespace goes with --k8s-service")
    if ns.k8s_service:
        from pagoda.router.kubernetes import load_config

        try:
            load_config(ns.namespace)  # no API to talk to is a usage error now, not a crash at start-up
        except (ValueError, OSError, KeyError, StopIteration) as e:
            parser.error(f"--k8s-service: cannot reach the Kubernetes API: {e}")
    if not ns.prefill_backends and not ns.prefill_k8s_service:
        env_prefill = _env("prefill-backend")
        ns.prefill_backends = [u for u in env_prefill.split(",") if u.strip()] if env_prefill else None
        ns.prefill_k8s_service = None if ns.prefill_backends else _env("prefill-k8s-service")
    if ns.prefill_k8s_service and not ns.k8s_service:
        parser.error("--prefill-k8s-service goes with --k8s-service (the decode backends' Service)")
    disaggregated = bool(ns.prefill_backends or ns.prefill_k8s_service)
    backends, prefill_backends = [], []
    for urls, normalized, flag in ((ns.backends, backends, "--backend"),
                                   (ns.prefill_backends, prefill_backends, "--prefill-backend")):
        for url in urls or []:
            try:
                normalized.append(normalize_url(url))
            except ValueError as e:
                parser.error(str(e).replace("--backend", flag, 1))
    if set(backends) & set(prefill_backends):
        parser.error(f"{sorted(set(backends) & set(prefill_backends))[0]} is both a --backend (decode) and a "
                     "--prefill-backend; a backend has one role")
    policy = ns.policy or ("least-load" if disaggregated else RouterArgs().policy)
    for flag in ("kv_events_endpoint", "kv_events_replay_endpoint"):
        template = getattr(ns, flag)
        if template is not None:
            try:
                template.format(host="h", port=1)
            except (KeyError, IndexError, ValueError) as e:
                parser.error(f"--{flag.replace('_', '-')} {template!r}: use {{host}} and {{port}} only ({e})")
    if not 0 < ns.epp_port < 65536:
        parser.error(f"--epp-port {ns.epp_port} is not a TCP port")
    if not 0 < ns.port < 65536:
        parser.error(f"--port {ns.port} is not a TCP port")
    return RouterArgs(backends=backends, k8s_service=ns.k8s_service, namespace=ns.namespace, policy=policy,
                      host=ns.host, port=ns.port, max_in_flight_per_backend=ns.max_in_flight_per_backend,
                      session_header=ns.session_header.lower(), backend_api_key=ns.backend_api_key,
                      log_level=ns.log_level, kv_events_endpoint=ns.kv_events_endpoint,
                      kv_events_replay_endpoint=ns.kv_events_replay_endpoint, kv_events_topic=ns.kv_events_topic,
                      epp=ns.epp, epp_port=ns.epp_port, epp_max_queue=ns.epp_max_queue,
                      epp_fallbacks=ns.epp_fallbacks, prefill_backends=prefill_backends,
                      prefill_k8s_service=ns.prefill_k8s_service, prefill_policy=ns.prefill_policy,
                      pd_threshold=ns.pd_threshold, prefill_timeout=ns.prefill_timeout)


def run(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    """After the caller configured logging (from --log-level)."""
    from pagoda.router.app import run_router

    return run_router(router_args(parser, ns))
