"""The `ray` executor: the driver (global rank 0) runs in the engine's process, as with `mp`; the other
ranks are Ray actors in a placement group (see ray_cluster for the layout). They rendezvous with the
driver through its TCPStore and form the torch.distributed group exactly as `mp` ranks do (gloo on CPU,
NCCL on GPU), so everything after start-up is the driver's (pagoda.executor.driver).

Failures: a rank's actor that dies (its process, or its node) fails the group as soon as Ray reports it;
the group's heartbeat still fails it within seconds when Ray is slower to notice (a lost node). A cluster
that cannot hold the placement group within --distributed-timeout is refused naming what is missing.
"""

import dataclasses
import logging
import os
import threading
from collections import Counter

import torch

from pagoda.config import EngineConfig
from pagoda.config.ray_presence import current_node, device_resource
from pagoda.distributed.group import cpu_threads_per_rank, free_port
from pagoda.executor.driver import DriverExecutor
from pagoda.executor.ray_cluster import connect_to_ray, describe_cluster, node_capacities, plan_placement
from pagoda.executor.worker import run_worker

logger = logging.getLogger(__name__)

ACTOR_STOP_TIMEOUT = 10.0  # seconds the actors get to leave the group cleanly at shutdown


class RayPlacementError(RuntimeError):
    pass


SOCKET_IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def use_node_interface(node_ip: str) -> list[str]:
    """Collectives go over the interface holding this node's Ray address (other nodes reach it there),
    unless GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME say otherwise: gloo's default, the interface of the host
    name's address, is wrong wherever the host name resolves elsewhere (containers, namespaces).
    Returns the variables it set."""
    import psutil

    name = next((name for name, addresses in psutil.net_if_addrs().items()
                 if any(a.address == node_ip for a in addresses)), None)
    if name is None:
        return []
    unset = [variable for variable in SOCKET_IFNAME_VARIABLES if variable not in os.environ]
    for variable in unset:
        os.environ[variable] = name
    return unset


class RankActor:
    """One rank of the group in a Ray actor (wrapped with ray.remote when the executor starts)."""

    def where(self) -> tuple[str, list[str]]:
        import ray

        return ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()]

    def run(self, config: EngineConfig, rank: int, eos_token_ids: set[int], ranks_on_node: int, node_ip: str,
            device: str, log_level: int) -> None:
        """Join the group and serve schedules until the driver says stop. Blocking."""
        logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s",
                            datefmt="%H:%M:%S")
        torch.set_num_threads(cpu_threads_per_rank(ranks_on_node))
        use_node_interface(node_ip)
        run_worker(config, rank, eos_token_ids, device=device)


class RayExecutor(DriverExecutor):
    def _start_other_ranks(self, config: EngineConfig, eos_token_ids: set[int]) -> tuple[EngineConfig, int]:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():  # RAY_ADDRESS or a cluster started on this machine; else a local one
            connect_to_ray(logging.WARNING)
        p = config.parallel
        resource = device_resource(config.device)
        driver_node = current_node()
        driver_ip = driver_node["NodeManagerAddress"]
        plan = plan_placement(self.tp_size, self.pp_size, resource, driver_ip, node_capacities(ray.nodes(), resource))
        if not plan.stages_packed and self.tp_size > 1:
            logger.warning("this node (%s) has %g %s, fewer than one pipeline stage's %d ranks: TP ranks will "
                           "span nodes and their collectives cross the network", driver_ip,
                           driver_node["Resources"].get(resource, 0), resource, self.tp_size)
        self.placement_group = placement_group(plan.bundles, strategy=plan.strategy)
        timeout = p.distributed_timeout
        if not self.placement_group.wait(timeout_seconds=timeout):
            raise RayPlacementError(
                f"the Ray cluster could not hold tensor_parallel_size={self.tp_size} x "
                f"pipeline_parallel_size={self.pp_size} within {timeout:g}s (--distributed-timeout): it "
                f"needs {plan.describe()}; {describe_cluster(ray.nodes(), resource)} "
                f"(available now: {ray.available_resources().get(resource, 0):g} {resource})")

        gpu = resource == "GPU"
        actor_class = ray.remote(RankActor)

        def place(rank: int):
            strategy = PlacementGroupSchedulingStrategy(self.placement_group, plan.bundle_of_rank[rank])
            return actor_class.options(num_cpus=0 if gpu else 1, num_gpus=1 if gpu else 0,
                                       scheduling_strategy=strategy).remote()

        self.actors = {rank: place(rank) for rank in range(1, p.world_size)}
        # on a GPU the driver's share of its bundle is held by an idle actor, which tells it which GPU is its
        self.driver_gpu_holder = place(0) if gpu else None
        located = dict(zip(self.actors, ray.get([a.where.remote() for a in self.actors.values()],
                                                timeout=timeout)))
        ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        self.node_of_rank = {0: driver_ip, **{rank: ips[node_id] for rank, (node_id, _) in located.items()}}
        ranks_per_node = Counter(self.node_of_rank.values())
        logger.info("Ray placement: %s", ", ".join(f"rank {r} on {ip}" for r, ip in sorted(self.node_of_rank.items())))

        config = dataclasses.replace(config, parallel=dataclasses.replace(p, master_addr=driver_ip,
                                                                          master_port=free_port()))
        self._ifname_variables_set = use_node_interface(driver_ip)
        if gpu:
            self._driver_gpu = ray.get(self.driver_gpu_holder.where.remote(), timeout=timeout)[1][0]
        log_level = logging.getLogger().level
        self.runs = {}
        for rank, actor in self.actors.items():
            ip = self.node_of_rank[rank]
            # Ray shows an actor only its own GPU
            ref = actor.run.remote(config, rank, eos_token_ids, ranks_per_node[ip], ip, "cuda:0" if gpu else "cpu",
                                   log_level)
            self.runs[ref] = rank
        self._watching = threading.Event()
        self._watching.set()
        threading.Thread(target=self._watch, name="pagoda-ray-watch", daemon=True).start()
        return config, ranks_per_node[driver_ip]

    def _group_formed(self) -> None:
        self._restore_interface_variables()

    def _restore_interface_variables(self) -> None:
        """They are read only while the groups form: leave the process as it was."""
        for variable in getattr(self, "_ifname_variables_set", []):
            os.environ.pop(variable, None)
        self._ifname_variables_set = []

    def _driver_device(self, config: EngineConfig) -> str:
        if not config.device.startswith("cuda"):
            return "cpu"
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # Ray's GPU ids are the node's physical ones
        index = visible.split(",").index(self._driver_gpu) if visible else int(self._driver_gpu)
        torch.cuda.set_device(index)
        return f"cuda:{index}"

    def _watch(self) -> None:
        """Fails the group when a rank's actor finishes before shutdown: its process or node died, or
        the rank raised."""
        import ray

        pending = list(self.runs)
        while pending and self._watching.is_set():
            ready, pending = ray.wait(pending, num_returns=1, timeout=1.0)
            for ref in ready:
                if not self._watching.is_set():
                    return
                rank = self.runs[ref]
                try:
                    ray.get(ref)
                    why = "left the group"
                except ray.exceptions.RayActorError as e:
                    why = f"died: {_first_line(e)}"
                except ray.exceptions.RayTaskError as e:
                    why = f"failed: {_first_line(e.cause if e.cause is not None else e)}"
                except Exception as e:  # any other way Ray lost it
                    why = f"was lost: {_first_line(e)}"
                # before the group formed, this also ends the driver's rendezvous (DriverExecutor.failure)
                self._fail(f"the Ray actor of rank {rank} (node {self.node_of_rank[rank]}) {why}")
                # a rank that raised is still alive: ending it closes its sockets, so collectives waiting
                # on it fail now instead of at their timeout, as when an `mp` rank exits
                ray.kill(self.actors[rank])

    def _fail(self, message: str) -> None:
        placement = getattr(self, "node_of_rank", None)
        if placement and "Ray actor" not in message:  # the heartbeat's message: say where the ranks were
            message += " [Ray placement: " + ", ".join(f"rank {r} on {ip}" for r, ip in sorted(placement.items())) + "]"
        super()._fail(message)

    def _stop_watching(self) -> None:
        if hasattr(self, "_watching"):
            self._watching.clear()

    def _stop_other_ranks(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        self._restore_interface_variables()  # start-up may have failed before the group formed
        if not ray.is_initialized():
            return
        runs = list(getattr(self, "runs", {}))
        if runs and self.failure is None:
            ray.wait(runs, num_returns=len(runs), timeout=ACTOR_STOP_TIMEOUT)
        for actor in [*getattr(self, "actors", {}).values(), getattr(self, "driver_gpu_holder", None)]:
            if actor is not None:
                ray.kill(actor)
        if getattr(self, "placement_group", None) is not None:
            remove_placement_group(self.placement_group)


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0][:300] if lines else type(error).__name__
