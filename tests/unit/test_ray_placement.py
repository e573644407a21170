"""The Ray placement plan (pure) and the automatic backend outside a Ray cluster: no Ray needed."""

import sys

import pytest

from pagoda.config.ray_presence import ray_backend_wanted
from pagoda.executor.ray_cluster import describe_cluster, node_capacities, plan_placement

pytestmark = pytest.mark.unit


def test_a_node_that_holds_a_stage_gets_one_bundle_per_stage_on_distinct_nodes_when_there_are_enough():
    nodes = {"10.0.0.1": 8, "10.0.0.2": 2, "10.0.0.3": 1}
    plan = plan_placement(tp_size=2, pp_size=2, resource="GPU", driver_ip="10.0.0.1", node_capacities=nodes)
    assert plan.stages_packed and plan.strategy == "STRICT_SPREAD"
    # two nodes can hold a stage of 2: three stages share them
    plan = plan_placement(tp_size=2, pp_size=3, resource="GPU", driver_ip="10.0.0.1", node_capacities=nodes)
    assert plan.stages_packed and plan.strategy == "SPREAD"
    assert plan.bundles == [{"GPU": 2.0, "node:10.0.0.1": 0.001}, {"GPU": 2.0}, {"GPU": 2.0}]
    assert plan.bundle_of_rank == [0, 0, 1, 1, 2, 2]
    assert "3 bundle(s) {GPU: 2}, {GPU: 2}, {GPU: 2} (one per pipeline stage" in plan.describe()


def test_one_stage_is_strictly_packed_on_the_driver_node():
    plan = plan_placement(tp_size=4, pp_size=1, resource="CPU", driver_ip="10.0.0.1",
                          node_capacities={"10.0.0.1": 4, "10.0.0.2": 4})
    assert plan.strategy == "STRICT_PACK" and plan.bundles == [{"CPU": 4.0, "node:10.0.0.1": 0.001}]


def test_a_driver_node_smaller_than_a_stage_gets_one_bundle_per_rank():
    plan = plan_placement(tp_size=3, pp_size=1, resource="CPU", driver_ip="10.0.0.1",
                          node_capacities={"10.0.0.1": 1, "10.0.0.2": 8})
    assert not plan.stages_packed and plan.strategy == "PACK"
    assert plan.bundles == [{"CPU": 1.0, "node:10.0.0.1": 0.001}, {"CPU": 1.0}, {"CPU": 1.0}]
    assert plan.bundle_of_rank == [0, 1, 2]


def test_live_nodes_and_their_capacity_from_ray_nodes():
    nodes = [{"Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 2.0}},
             {"Alive": False, "NodeManagerAddress": "10.0.0.2", "Resources": {"CPU": 8.0}},
             {"Alive": True, "NodeManagerAddress": "10.0.0.3", "Resources": {}}]
    assert describe_cluster(nodes, "CPU") == "node 10.0.0.1 has 2 CPU, node 10.0.0.3 has 0 CPU"
    assert node_capacities(nodes, "CPU") == {"10.0.0.1": 2.0, "10.0.0.3": 0}


def test_a_process_that_never_imported_ray_is_not_in_a_ray_cluster(monkeypatch):
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    assert not ray_backend_wanted(4, "cpu")
    assert "ray" not in sys.modules  # deciding did not import it


def test_a_process_that_only_imported_ray_neither_uses_nor_starts_it():
    ray = pytest.importorskip("ray")
    assert not ray.is_initialized()
    # before the fix, looking for a current placement group auto-started a local Ray cluster, and a TP x PP
    # engine in any process that had imported Ray then waited on a placement group its node could not hold
    assert not ray_backend_wanted(4, "cpu")
    assert not ray.is_initialized(), "deciding the backend started Ray"
