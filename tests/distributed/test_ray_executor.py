"""The `ray` executor on a two-node Ray cluster: a head in this network namespace and a worker node in
another one (hosts.py), each advertising 2 CPUs. Greedy tokens equal the single-process engine's; the
vLLM multi-node recipe runs as written; a killed actor, a lost node and a cluster too small fail clearly.

Ray start-up is slow: one cluster for the module, few engines, and the test that kills the worker node
runs last."""

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from hosts import make_two_hosts, remove_two_hosts
from ray_nodes import RayNode, wait_for_nodes

from pagoda import LLM, EngineArgs, SamplingParams
from pagoda.config import create_engine_config
from pagoda.config.default_model import default_model_path

pytestmark = pytest.mark.distributed

ray = pytest.importorskip("ray")

PROMPTS = ["Hello, my name is", "The quick brown fox jumps over the lazy dog. Paged attention stores keys"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
CPUS_PER_NODE = 2


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    def __init__(self, hosts, base: Path):
        self.hosts = hosts
        self.address = f"{hosts.head_ip}:{free_port()}"
        common = [f"--num-cpus={CPUS_PER_NODE}", "--object-store-memory=100000000"]
        self.head = RayNode(base / "head", base / "head.log", "--head", f"--port={self.address.split(':')[1]}",
                            f"--node-ip-address={hosts.head_ip}", "--include-dashboard=false", *common)
        self.worker = RayNode(base / "worker", base / "worker.log", f"--address={self.address}",
                              f"--node-ip-address={hosts.worker_ip}", *common, prefix=hosts.exec_prefix())

    def stop(self) -> None:
        for node in (self.worker, self.head):
            node.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    try:
        hosts = make_two_hosts()
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot make network namespaces here: {(getattr(e, 'stderr', '') or str(e)).strip()}")
    started = None
    # Ray turns on token authentication for every cluster on a machine once some local ray.init() left a
    # token in ~/.ray/auth_token; this private test cluster must not depend on what other Ray use left there
    env = pytest.MonkeyPatch()
    env.setenv("RAY_AUTH_MODE", "disabled")
    try:
        started = Cluster(hosts, tmp_path_factory.mktemp("ray"))
        wait_for_nodes(started.address, [started.head, started.worker])
        ray.init(address=started.address, logging_level="warning")
        yield started
    finally:
        ray.shutdown()  # later tests in this process must not see a Ray cluster
        if started is not None:
            started.stop()
            assert started.head.session_pids() == [] and started.worker.session_pids() == []
        remove_two_hosts(hosts)
        env.undo()


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama", num_layers=3, num_kv_heads=1)


@pytest.fixture(scope="module")
def reference(model):
    with LLM(str(model), dtype="float32", kv_cache_memory=0.02) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def greedy(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def test_inside_the_cluster_ray_is_chosen_when_this_node_cannot_hold_every_rank(cluster, model):
    def backend(**kwargs) -> str:
        return create_engine_config(EngineArgs(model=str(model), **kwargs)).parallel.distributed_executor_backend

    assert backend(tensor_parallel_size=2) == "mp"  # the head node has 2 CPUs
    assert backend(tensor_parallel_size=4) == "ray"  # (4: the model's 4 heads split evenly, 3 would not)
    assert backend(tensor_parallel_size=4, distributed_executor_backend="mp") == "mp"  # the flag wins
    assert backend() == "uni"


def test_tp2_x_pp2_packs_each_stage_on_a_node_and_equals_one_process(cluster, model, reference):
    with LLM(str(model), dtype="float32", kv_cache_memory=0.02, distributed_executor_backend="ray",
             tensor_parallel_size=2, pipeline_parallel_size=2) as llm:
        hosts = cluster.hosts
        assert llm.engine.executor.node_of_rank == {0: hosts.head_ip, 1: hosts.head_ip,
                                                    2: hosts.worker_ip, 3: hosts.worker_ip}
        assert greedy(llm) == reference


def test_pp2_with_a_draft_model_equals_one_process(cluster, model, reference):
    """The draft model runs unsharded on the driver, in this process; its drafts travel with each batch
    to the Ray actor of the last stage, which verifies them."""
    draft = {"model": str(model), "num_speculative_tokens": 3}
    with LLM(str(model), dtype="float32", kv_cache_memory=0.02, distributed_executor_backend="ray",
             pipeline_parallel_size=2, speculative_config=draft) as llm:
        assert llm.engine.executor.node_of_rank == {0: cluster.hosts.head_ip, 1: cluster.hosts.worker_ip}
        assert greedy(llm) == reference
        stats = llm.engine.get_stats()
        llm.engine.block_manager.check_no_leaks()
    assert stats.spec_decode_num_drafts > 0
    # the target is its own draft: under greedy nearly every draft is accepted
    assert stats.spec_decode_num_accepted_tokens > 0.9 * stats.spec_decode_num_draft_tokens


def test_pp2_spreads_stages_and_a_killed_actor_fails_the_engine_naming_it(cluster, model, reference):
    llm = LLM(str(model), dtype="float32", kv_cache_memory=0.02, distributed_executor_backend="ray",
              pipeline_parallel_size=2)
    try:
        executor = llm.engine.executor
        # the head could hold both stages: STRICT_SPREAD still puts the second on the other node
        assert executor.node_of_rank == {0: cluster.hosts.head_ip, 1: cluster.hosts.worker_ip}
        assert greedy(llm) == reference

        ray.kill(executor.actors[1])
        started = time.monotonic()
        while executor.failure is None:
            assert time.monotonic() - started < 10, "no failure 10 s after the actor was killed"
            time.sleep(0.1)
        assert f"the Ray actor of rank 1 (node {cluster.hosts.worker_ip}) died" in executor.failure
        with pytest.raises(RuntimeError, match="distributed group failed: the Ray actor of rank 1"):
            llm.generate(PROMPTS[0], PARAMS, use_tqdm=False)
    finally:
        llm.shutdown()


def test_a_cluster_too_small_is_refused_naming_what_is_missing(cluster, model):
    started = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        LLM(str(model), dtype="float32", kv_cache_memory=0.02, distributed_executor_backend="ray",
            tensor_parallel_size=2, pipeline_parallel_size=3, distributed_timeout=5)
    assert time.monotonic() - started < 60
    message = str(err.value)
    assert "could not hold tensor_parallel_size=2 x pipeline_parallel_size=3 within 5s" in message
    assert "3 bundle(s) {CPU: 2}, {CPU: 2}, {CPU: 2} (one per pipeline stage" in message
    assert f"node {cluster.hosts.head_ip} has 2 CPU" in message and f"node {cluster.hosts.worker_ip} has 2 CPU" in message
    assert ray.available_resources().get("CPU") == 2 * CPUS_PER_NODE  # the placement group was removed


@pytest.mark.heavy  # make test: expert parallelism in test_multinode, Ray's stage placement in tp2_x_pp2 above
def test_expert_parallel_moe_with_a_stage_on_each_node_equals_one_process(cluster, tiny_model_factory):
    """A Mixtral of 2 layers and 4 experts, TP=2 x PP=2 with expert parallelism: stage 0 on the head and
    stage 1 on the worker node, each splitting its layer's experts over its node's two actors."""
    model = tiny_model_factory("mixtral")
    with LLM(str(model), dtype="float32", kv_cache_memory=0.02) as llm:
        expected = greedy(llm)
    with LLM(str(model), dtype="float32", kv_cache_memory=0.02, distributed_executor_backend="ray",
             tensor_parallel_size=2, pipeline_parallel_size=2, enable_expert_parallel=True) as llm:
        hosts = cluster.hosts
        assert llm.engine.executor.node_of_rank == {0: hosts.head_ip, 1: hosts.head_ip,
                                                    2: hosts.worker_ip, 3: hosts.worker_ip}
        assert greedy(llm) == expected
        stats = llm.engine.get_stats()
    assert sorted(stats.expert_tokens) == [1] and sum(stats.expert_tokens[1]) > 0  # the worker node's layer


def test_tp2_with_lora_adapters_equals_peft(cluster, model, tmp_path):
    """Two adapters and the base model in one batch, TP=2 over Ray actors (A/B sharded per rank, each actor
    reading the adapter files itself): greedy tokens equal PeftModel's."""
    from checkpoints import peft_greedy, write_lora_adapter

    from pagoda import LoRARequest

    a = write_lora_adapter(model, tmp_path / "a", rank=8, seed=41)
    b = write_lora_adapter(model, tmp_path / "b", rank=4, seed=42, targets=("k_proj", "o_proj", "up_proj", "down_proj"))
    reference = {name: peft_greedy(model, path, PROMPTS, PARAMS.max_tokens)
                 for name, path in (("base", None), ("a", a), ("b", b))}
    loras = {"base": None, "a": LoRARequest("a", 1, str(a)), "b": LoRARequest("b", 2, str(b))}
    order = [(i, name) for i in range(len(PROMPTS)) for name in ("a", "base", "b")]
    with LLM(str(model), dtype="float32", kv_cache_memory=0.02, distributed_executor_backend="ray",
             tensor_parallel_size=2, enable_lora=True, max_loras=2, max_lora_rank=8) as llm:
        assert llm.engine.config.parallel.distributed_executor_backend == "ray"
        outs = llm.generate([PROMPTS[i] for i, _ in order], PARAMS, use_tqdm=False,
                            lora_request=[loras[name] for _, name in order])
        assert [o.outputs[0].token_ids for o in outs] == [reference[name][i] for i, name in order]
        llm.engine.block_manager.check_no_leaks()


RECIPE = """
import asyncio, sys, ray
from pagoda import AsyncEngineArgs, AsyncLLMEngine, SamplingParams

ray.init(address="auto")
engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=sys.argv[1], tensor_parallel_size=3))

async def main():
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    async for output in engine.generate(sys.argv[2], params, request_id="1"):
        pass
    print("BACKEND", engine.config.parallel.distributed_executor_backend)
    print("PLACEMENT", sorted(set(engine.engine.executor.node_of_rank.values())))
    print("TOKENS", output.outputs[0].token_ids)

asyncio.run(main())
engine.shutdown()
"""


@pytest.mark.heavy  # make test: Ray chosen by itself and ranks over both nodes, in the tests above
def test_the_vllm_multinode_recipe_distributes_the_default_model_over_the_cluster(cluster, tmp_path):
    """vLLM's recipe with s/vllm/pagoda/, on the default model. tensor_parallel_size=3: its 9 attention
    heads cannot be split in two. The head node has 2 CPUs, fewer than 3 ranks: Ray is chosen by itself."""
    model = default_model_path()
    prompt = "The capital of France is"
    with LLM(model) as llm:
        expected = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                use_tqdm=False)[0].outputs[0].token_ids
    script = tmp_path / "recipe.py"
    script.write_text(RECIPE)
    result = subprocess.run([sys.executable, str(script), model, prompt], capture_output=True, text=True,
                            timeout=900, env={**os.environ, "RAY_ADDRESS": cluster.address})
    assert result.returncode == 0, result.stderr[-4000:]
    assert "BACKEND ray" in result.stdout
    assert f"PLACEMENT {sorted([cluster.hosts.head_ip, cluster.hosts.worker_ip])}" in result.stdout
    assert f"TOKENS {expected}" in result.stdout


def test_serve_with_ray_turns_unhealthy_and_exits_when_a_node_is_lost(cluster, model, reference, tmp_path):
    """Last in the module: it kills the worker node."""
    port = free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", str(model), "--host", "127.0.0.1",
             "--port", str(port), "--dtype", "float32", "--kv-cache-memory", "0.02",
             "--pipeline-parallel-size", "2", "--distributed-executor-backend", "ray"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "RAY_ADDRESS": cluster.address})
    url = f"http://127.0.0.1:{port}"

    def health() -> int:
        try:
            return httpx.get(url + "/health", timeout=2).status_code
        except httpx.TransportError:
            return 0

    try:
        deadline = time.monotonic() + 300
        while health() != 200:
            assert server.poll() is None, log_path.read_text()[-4000:]
            assert time.monotonic() < deadline, log_path.read_text()[-4000:]
            time.sleep(0.5)
        response = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": str(model), "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "ignore_eos": True})
        assert response.status_code == 200, response.text

        cluster.worker.kill_all()
        started = time.monotonic()
        while health() == 200:
            assert time.monotonic() - started < 10, "/health still 200 10 s after the node was lost"
            time.sleep(0.2)
        server.wait(30)
        assert server.returncode != 0
        log = log_path.read_text()
        assert "distributed group failed" in log and cluster.hosts.worker_ip in log, log[-4000:]
    finally:
        if server.poll() is None:
            server.terminate()
            server.wait(30)
