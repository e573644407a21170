"""`pagoda-operator` / `python -m pagoda_operator`: run the LLMDeployment operator."""

from __future__ import annotations

import argparse
import logging
import sys

from .settings import OperatorSettings

HELP = """Settings come from the environment:
  PAGODA_OPERATOR_NAMESPACES        comma-separated namespaces to watch (default: all)
  PAGODA_OPERATOR_RUNTIME_IMAGE     image for LLMDeployments without spec.image
  PAGODA_OPERATOR_LOG_LEVEL         DEBUG, INFO (default), WARNING, ERROR
  PAGODA_OPERATOR_LIVENESS_PORT     port of GET /healthz (default 8080)
  PAGODA_OPERATOR_CLUSTER_DOMAIN    cluster DNS domain (default cluster.local)
  PAGODA_OPERATOR_MAX_WORLD_SIZE    largest TP x PP per group (default 256)
  PAGODA_OPERATOR_RESYNC_SECONDS    periodic reconcile interval (default 30)
  PAGODA_OPERATOR_RECREATE_BACKOFF_SECONDS / _MAX_SECONDS   group restart backoff (default 10 / 300)
  PAGODA_OPERATOR_RECREATE_BACKOFF_RESET_SECONDS  time Ready before the backoff is forgotten (default 600)
  PAGODA_OPERATOR_LEADER_ELECTION   true: only the holder of a Lease acts (default false)
  PAGODA_OPERATOR_LEASE_NAME / _LEASE_NAMESPACE / _IDENTITY   the Lease, and this replica's name in it
  PAGODA_OPERATOR_METRICS_PORT      port of the operator's own GET /metrics (default 8081; 0: off)
  PAGODA_OPERATOR_PROMETHEUS_ADDRESS  Prometheus that KEDA ScaledObjects query
                                    (default http://prometheus-operated.monitoring.svc:9090)
  PAGODA_OPERATOR_DISCOVERY_SECONDS how long "is KEDA / Volcano installed" is cached (default 60)
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="pagoda-operator", description="Kubernetes operator for Pagoda LLMDeployments.",
        epilog=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(sys.argv[1:] if argv is None else argv)
    settings = OperatorSettings.from_env()
    logging.basicConfig(level=settings.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .main import run  # noqa: PLC0415  (after logging is set up; keeps --help fast)

    run(settings)


if __name__ == "__main__":
    main()
