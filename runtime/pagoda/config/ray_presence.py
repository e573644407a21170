"""What the configuration asks of Ray, torch-free and without importing it unless this process already did:
whether it is installed, whether this process runs inside a Ray cluster, and so whether the ray executor is
the automatic choice (config/resolve.py). The executor (executor/ray_cluster.py) places ranks with the same
answers."""

import importlib.util
import sys

RAY_INSTALL_HINT = "pip install 'pagoda[ray]'"


def ray_installed() -> bool:
    return importlib.util.find_spec("ray") is not None


def device_resource(device: str) -> str:
    """The Ray resource one rank takes."""
    return "GPU" if device.startswith("cuda") else "CPU"


def inside_ray_cluster() -> bool:
    """This process joined a Ray cluster: it called ray.init(), or it is a Ray task or actor (which Ray
    initialises), placement groups included. Only asks an initialised Ray: most of Ray's API, placement
    group lookups among them, would otherwise start a local cluster just by being called."""
    ray = sys.modules.get("ray")  # a process that never imported Ray has not joined a cluster
    return ray is not None and ray.is_initialized()


def current_node() -> dict:
    """This process's Ray node, as ray.nodes() describes it (NodeID, NodeManagerAddress, Resources)."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    return next(n for n in ray.nodes() if n["NodeID"] == node_id)


def ray_backend_wanted(world_size: int, device: str) -> bool:
    """vLLM's automatic choice: Ray when this process runs inside a Ray cluster and its own node cannot
    hold every rank."""
    if world_size == 1 or not inside_ray_cluster():
        return False
    return current_node()["Resources"].get(device_resource(device), 0) < world_size
