"""What a newcomer runs: the docs' examples as plain top-level scripts, with no `if __name__ == "__main__":`
guard, in a subprocess. Local worker ranks start by fork where that is safe, so these run; where spawn
must be used, the error says in one line what to add. The Ray recipe runs against a `ray start` cluster
with Ray's default authentication: token authentication, since an earlier local `ray.init()` left a token
in ~/.ray/auth_token (here a home of the test's own)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from ray_nodes import RayNode, wait_for_nodes

from pagoda import LLM, SamplingParams
from pagoda.config.default_model import cache_dir
from pagoda.distributed.group import free_port

pytestmark = pytest.mark.distributed

PROMPTS = ["Hello, my name is", "The capital of France is"]

# docs/distributed.md's example, with the model path, max_tokens and a small KV cache as arguments
SCRIPT = """
import sys
from pagoda import LLM, SamplingParams

llm = LLM(sys.argv[1], dtype="float32", kv_cache_memory=0.02, swap_space=0, tensor_parallel_size=int(sys.argv[2]),
          pipeline_parallel_size=int(sys.argv[3]))
outs = llm.generate(["Hello, my name is", "The capital of France is"],
                    SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
print("TOKENS", [o.outputs[0].token_ids for o in outs])
"""

# vLLM's multi-node recipe (docs/distributed.md#ray), s/vllm/pagoda/, run to the end
RECIPE = """
import asyncio, sys
import ray
from pagoda import AsyncEngineArgs, AsyncLLMEngine, SamplingParams

ray.init(address="auto")
engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=sys.argv[1], tensor_parallel_size=2, dtype="float32",
                                                         kv_cache_memory=0.02, swap_space=0))

async def main():
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = []
    for i, prompt in enumerate(["Hello, my name is", "The capital of France is"]):
        async for out in engine.generate(prompt, params, request_id=str(i)):
            pass
        tokens.append(out.outputs[0].token_ids)
    print("BACKEND", engine.config.parallel.distributed_executor_backend)
    print("TOKENS", tokens)

asyncio.run(main())
engine.shutdown()
"""


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama", num_layers=2)


@pytest.fixture(scope="module")
def reference(model):
    with LLM(str(model), dtype="float32", kv_cache_memory=0.02, swap_space=0) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def run_script(tmp_path: Path, text: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    script = tmp_path / "example.py"
    script.write_text(text)
    full = {k: v for k, v in os.environ.items() if k != "PAGODA_WORKER_MULTIPROC_METHOD"}
    full.update({"TOKENIZERS_PARALLELISM": "false", **(env or {})})
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=600,
                          env=full)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_an_unguarded_script_forks_its_workers_and_equals_one_process(model, reference, tmp_path, tp, pp):
    result = run_script(tmp_path, SCRIPT, str(model), str(tp), str(pp))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"TOKENS {reference}" in result.stdout
    assert "bootstrapping phase" not in result.stderr
    # a script that never calls shutdown() still ends cleanly
    assert "could not tell the workers to stop" not in result.stderr
    assert "Traceback" not in result.stderr


def test_an_unguarded_script_that_must_spawn_says_what_to_add(model, tmp_path):
    result = run_script(tmp_path, SCRIPT, str(model), "2", "1", env={"PAGODA_WORKER_MULTIPROC_METHOD": "spawn"})
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert "PAGODA_WORKER_MULTIPROC_METHOD=spawn" in last
    assert 'put the code that builds the engine (example.py, line 5) under `if __name__ == "__main__":`' in last
    assert "bootstrapping phase" not in result.stderr


def test_the_start_method_variable_is_checked(model, tmp_path):
    result = run_script(tmp_path, SCRIPT, str(model), "2", "1", env={"PAGODA_WORKER_MULTIPROC_METHOD": "forkserver"})
    assert result.returncode != 0
    assert "PAGODA_WORKER_MULTIPROC_METHOD must be fork or spawn; got 'forkserver'" in result.stderr


# --- Ray -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """`ray start --head --port=P` as docs/distributed.md says (a free port, its own temp dir, 2 CPUs), in a
    home where an earlier local ray.init() left its token: Ray then starts the cluster with token auth."""
    pytest.importorskip("ray")
    base = tmp_path_factory.mktemp("ray-head")
    home = base / "home"
    env = {"HOME": str(home), "RAY_TMPDIR": str(base / "tmp"), "PAGODA_CACHE_DIR": str(cache_dir())}
    made = subprocess.run([str(Path(sys.executable).parent / "ray"), "get-auth-token", "--generate"],
                          capture_output=True, text=True, env={**os.environ, **env})
    assert (home / ".ray" / "auth_token").is_file(), made.stderr
    port = free_port()
    head = RayNode(base / "tmp", base / "head.log", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
                   "--num-cpus=2", "--include-dashboard=false", "--object-store-memory=100000000",
                   env={k: v for k, v in env.items()})
    try:
        address = f"127.0.0.1:{port}"
        # the probe names the address: Ray turns token authentication on by itself only for "auto"
        wait_for_nodes(address, [head], env={**env, "RAY_AUTH_MODE": "token"})
        assert "Token authentication is enabled" in head.log_path.read_text()
        yield address, env
    finally:
        head.stop()


def test_the_ray_recipe_as_written_runs_against_a_ray_start_cluster(ray_head, model, reference, tmp_path):
    """The head node holds both ranks: the backend is mp, and the workers fork beside Ray's threads."""
    _, env = ray_head
    result = run_script(tmp_path, RECIPE, str(model), env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "BACKEND mp" in result.stdout
    assert f"TOKENS {reference}" in result.stdout


CONNECT = """
import ray
from pagoda.executor.ray_cluster import connect_to_ray

connect_to_ray()
print("NODES", sum(n["Alive"] for n in ray.nodes()))
"""


def test_pagoda_connects_to_a_token_cluster_at_ray_address(ray_head, tmp_path):
    """RAY_ADDRESS (as `RAY_ADDRESS=HEAD:6379 pagoda serve ... --distributed-executor-backend ray`): Ray
    itself would not turn token authentication on; Pagoda does, having found the token."""
    address, env = ray_head
    result = run_script(tmp_path, CONNECT, env={**env, "RAY_ADDRESS": address})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "NODES 1" in result.stdout
