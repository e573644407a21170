"""What Pagoda asks of a Ray cluster (torch-free): whether this process runs inside one, and the placement
group that holds a group's ranks. Ray is imported only here and in ray_executor, and only when used, so
Pagoda imports without Ray installed.

Placement: the driver (global rank 0) runs in the engine's process, so the first bundle is pinned to its
node. When that node can hold a whole pipeline stage, there is one bundle per stage (a bundle never spans
nodes: a stage's TP ranks share a node, and its collectives shared memory or NVLink) and the stages go to
distinct nodes when the cluster has enough nodes that can each hold one (STRICT_SPREAD). When it cannot, there is one bundle per rank, packed
as tightly as the cluster allows (TP collectives then cross the network, as in vLLM's Ray layout).
"""

import logging
import os
from dataclasses import dataclass
from pathlib import Path

RAY_TOKEN_HINT = ("if `ray start` logged 'Token authentication is enabled', set RAY_AUTH_MODE=token here and make "
                  "the cluster's token readable: copy the head's ~/.ray/auth_token to this machine's home (or set "
                  "RAY_AUTH_TOKEN to its contents)")

logger = logging.getLogger(__name__)


def ray_token_available() -> bool:
    """A Ray authentication token where Ray looks for one: RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return True
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token"
    return Path(path).is_file()


def connect_to_ray(logging_level: int = logging.WARNING) -> None:
    """ray.init() for the executor: the cluster at RAY_ADDRESS or the one started on this machine, else a
    new local one. A cluster started by `ray start` where a token exists (an earlier local ray.init() writes
    ~/.ray/auth_token) requires token authentication; Ray turns it on by itself only for
    ray.init(address="auto") without RAY_ADDRESS. Here it is turned on whenever a token is available and
    RAY_AUTH_MODE is unset (a token also connects to a cluster without authentication)."""
    import ray

    if "RAY_AUTH_MODE" not in os.environ and ray_token_available():
        logger.info("Ray: a token is available (%s), using token authentication (RAY_AUTH_MODE=token)",
                    "RAY_AUTH_TOKEN" if os.environ.get("RAY_AUTH_TOKEN") else "~/.ray/auth_token")
        os.environ["RAY_AUTH_MODE"] = "token"
        try:  # Ray reads its settings once, at import: make it read them again (what Ray itself does)
            from ray._raylet import Config

            Config.initialize("")
        except (ImportError, AttributeError):
            pass
    try:
        ray.init(logging_level=logging_level)
    except (ConnectionError, RuntimeError) as e:
        address = os.environ.get("RAY_ADDRESS", "the local cluster")
        raise ConnectionError(f"could not connect to the Ray cluster at {address}: {e}; {RAY_TOKEN_HINT}") from e


@dataclass(frozen=True)
class PlacementPlan:
    bundles: list[dict[str, float]]
    strategy: str  # a Ray placement group strategy
    bundle_of_rank: list[int]  # bundle index of every global rank (rank 0 = the driver)
    stages_packed: bool  # one bundle per pipeline stage

    def describe(self) -> str:
        shown = ", ".join("{" + ", ".join(f"{k}: {v:g}" for k, v in b.items() if not k.startswith("node:")) + "}"
                          for b in self.bundles)
        what = "one per pipeline stage, each on one node" if self.stages_packed else "one per rank"
        return f"{len(self.bundles)} bundle(s) {shown} ({what}, the first on the driver's node)"


def plan_placement(tp_size: int, pp_size: int, resource: str, driver_ip: str, node_capacities: dict[str, float],
                   ) -> PlacementPlan:
    """node_capacities: each live node's total of `resource`, by node IP."""
    world = tp_size * pp_size
    driver_node_capacity = node_capacities.get(driver_ip, 0)
    if driver_node_capacity >= tp_size:
        bundles = [{resource: float(tp_size)} for _ in range(pp_size)]
        # a node per stage where the cluster has enough nodes that can hold one (waiting for them to be
        # free, as Ray's soft SPREAD would not); shared nodes otherwise
        nodes_for_a_stage = sum(capacity >= tp_size for capacity in node_capacities.values())
        strategy = "STRICT_PACK" if pp_size == 1 else "STRICT_SPREAD" if nodes_for_a_stage >= pp_size else "SPREAD"
        bundle_of_rank = [rank // tp_size for rank in range(world)]
    else:
        bundles = [{resource: 1.0} for _ in range(world)]
        strategy = "PACK"
        bundle_of_rank = list(range(world))
    bundles[0][f"node:{driver_ip}"] = 0.001  # Ray's per-node resource: the driver's rank lives there
    return PlacementPlan(bundles, strategy, bundle_of_rank, driver_node_capacity >= tp_size)


def node_capacities(nodes: list[dict], resource: str) -> dict[str, float]:
    """Each live node's total of `resource`, by IP, from ray.nodes()."""
    return {n["NodeManagerAddress"]: n["Resources"].get(resource, 0) for n in nodes if n.get("Alive")}


def describe_cluster(nodes: list[dict], resource: str) -> str:
    """Each live node's total of `resource`, for error messages."""
    alive = [n for n in nodes if n.get("Alive")]
    if not alive:
        return "no live nodes"
    return ", ".join(f"node {n['NodeManagerAddress']} has {n['Resources'].get(resource, 0):g} {resource}"
                     for n in alive)
