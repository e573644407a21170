"""Data parallelism (engine/data_parallel.py): one engine core per DP rank, each with its own scheduler, block
manager and KV cache; with MoE and expert parallelism the experts split over every DP x TP rank and each MoE
layer exchanges tokens between the ranks. Greedy tokens equal transformers' whichever rank served a request."""

import pytest
from checkpoints import hf_greedy

from pagoda import LLM, SamplingParams
from pagoda.config import EngineArgs
from pagoda.errors import InvalidParam

pytestmark = pytest.mark.distributed

PROMPTS = ["Hello, my name is", "Continuous batching lets new requests join between steps. " * 2,
           "The capital of France is", "one two three four five six"]
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
MOE = ("mixtral", "qwen2-moe", "qwen3-moe", "olmoe")


@pytest.fixture(scope="module")
def reference(tiny_model_factory):
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = hf_greedy(tiny_model_factory(arch), PROMPTS, MAX_TOKENS)
        return cache[arch]

    return get


def dp_llm(path, **kwargs):
    options = dict(dtype="float32", kv_cache_memory=0.02, max_num_batched_tokens=16, data_parallel_size=2)
    return LLM(str(path), **{**options, **kwargs})


def served_ranks(llm) -> list[int]:
    """Sequences each DP rank was given so far."""
    return llm.engine.core.num_added


def run(llm, prompts=PROMPTS, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("arch", MOE)
def test_moe_dp2_with_experts_over_both_ranks_equals_transformers(tiny_model_factory, reference, arch):
    llm = dp_llm(tiny_model_factory(arch), enable_expert_parallel=True)
    try:
        assert run(llm) == reference(arch)
        # both ranks served requests, and each holds half the experts
        ranks = [core.block_manager for core in llm.engine.core.cores]
        assert all(bm.num_blocks > 0 for bm in ranks)
        assert all(n > 0 for n in served_ranks(llm))
        stats = llm.engine.get_stats()
        assert sum(sum(c) for c in stats.expert_tokens.values()) > 0
        # one request alone: the other rank is idle and runs dummy batches while this one steps
        assert run(llm, PROMPTS[:1]) == reference(arch)[:1]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_dense_dp2_equals_transformers(tiny_model_factory, reference, arch):
    llm = dp_llm(tiny_model_factory(arch))
    try:
        assert run(llm) == reference(arch)
        assert all(n > 0 for n in served_ranks(llm))
        # each rank counts the prompts it prefilled; the engine's count is their sum
        prompt_tokens = sum(len(llm.engine.process_prompt(p, GREEDY)[1]) for p in PROMPTS)
        stats = llm.engine.get_stats()
        assert stats.prompt_tokens == sum(r.prompt_tokens for r in stats.data_parallel) == prompt_tokens
        assert all(r.prompt_tokens > 0 for r in stats.data_parallel)
    finally:
        llm.shutdown()


def test_mixtral_dp2_tp2_with_experts_over_four_ranks(tiny_model_factory, reference):
    llm = dp_llm(tiny_model_factory("mixtral"), enable_expert_parallel=True, tensor_parallel_size=2)
    try:
        assert run(llm) == reference("mixtral")
        assert all(n > 0 for n in served_ranks(llm))
    finally:
        llm.shutdown()


def test_bad_combinations_are_refused_by_name():
    with pytest.raises(InvalidParam) as e:
        EngineArgs(data_parallel_size=2, pipeline_parallel_size=2).validate()
    assert e.value.param == "pipeline_parallel_size" and "data_parallel_size=2" in str(e.value)
    with pytest.raises(InvalidParam) as e:
        EngineArgs(data_parallel_size=0).validate()
    assert e.value.param == "data_parallel_size"
    with pytest.raises(InvalidParam) as e:
        EngineArgs(data_parallel_size=2, distributed_executor_backend="uni").validate()
    assert e.value.param == "distributed_executor_backend"
    EngineArgs(data_parallel_size=2).validate()  # no longer refused


def test_abort_on_one_rank_while_the_other_steps(tiny_model_factory, reference):
    llm = dp_llm(tiny_model_factory("mixtral"), enable_expert_parallel=True)
    engine = llm.engine
    try:
        engine.add_request("kept", PROMPTS[0], GREEDY)
        engine.add_request("aborted", PROMPTS[1], GREEDY)
        assert engine.core.num_added == [1, 1]  # one on each rank
        outputs = {}
        for _ in range(3):
            outputs.update({o.request_id: o for o in engine.step()})
        assert engine.abort_request("aborted") is not None
        while engine.has_unfinished_requests():  # rank 1 idle from here: dummy batches
            outputs.update({o.request_id: o for o in engine.step()})
        assert outputs["kept"].outputs[0].token_ids == reference("mixtral")[0]
        assert [core.block_manager.num_used_blocks for core in engine.core.cores] == [0, 0]
        assert engine.get_stats().finished_reasons.get("abort") == 1
    finally:
        llm.shutdown()


def test_preemption_on_a_rank_keeps_greedy_tokens(tiny_model_factory):
    path = tiny_model_factory("mixtral")
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = hf_greedy(path, PROMPTS, 40)
    # 9 blocks of 16 tokens per rank: the long prompt's sequence takes 8 by its end, the others 4 each
    llm = dp_llm(path, enable_expert_parallel=True, max_model_len=128, preemption_mode="recompute",
                 kv_cache_memory=9 * 8192 / 2**30)
    try:
        assert [core.block_manager.num_blocks for core in llm.engine.core.cores] == [9, 9]
        assert run(llm, PROMPTS, long) == expected
        assert llm.engine.get_stats().num_preemptions > 0
    finally:
        llm.shutdown()


def test_a_dead_rank_fails_the_engine_without_a_hang(tiny_model_factory):
    import time

    llm = dp_llm(tiny_model_factory("llama"), distributed_timeout=30)
    try:
        assert run(llm, PROMPTS[:2])
        llm.engine.executor.children[0].kill()  # DP rank 1's process
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="rank1"):
            for _ in range(50):  # the watcher notices within a second or two
                run(llm, PROMPTS[:2])
                time.sleep(0.2)
        assert time.monotonic() - started < 30
    finally:
        llm.shutdown()


def test_balancing_prefers_the_rank_whose_prefix_cache_holds_the_prompt(tiny_model_factory):
    llm = dp_llm(tiny_model_factory("llama"))
    engine, long_prompt = llm.engine, PROMPTS[1]
    try:
        run(llm, [long_prompt])  # rank 0 (both idle: the lower rank) caches its blocks
        assert engine.core.num_added == [1, 0]
        engine.add_request("busy", PROMPTS[0], GREEDY)  # rank 0 again (a tie)
        engine.add_request("again", long_prompt, GREEDY)  # loads 1 and 0 are close: the cache decides
        assert engine.core.num_added == [3, 0]
        engine.add_request("other", PROMPTS[2], GREEDY)  # nothing cached anywhere: the least loaded
        assert engine.core.num_added == [3, 1]
        outputs = {}
        while engine.has_unfinished_requests():
            outputs.update({o.request_id: o for o in engine.step()})
        assert outputs["again"].num_cached_tokens > 0
    finally:
        llm.shutdown()


def test_kv_events_carry_the_rank_and_each_rank_publishes_on_its_own_port():
    from pagoda.config.kv_events import KVEventsConfig

    config = KVEventsConfig.parse({"enable_kv_cache_events": True, "endpoint": "tcp://*:5557",
                                   "replay_endpoint": "ipc:///tmp/replay"})
    assert config.for_data_parallel_rank(0) is config
    one = config.for_data_parallel_rank(1)
    assert (one.endpoint, one.replay_endpoint) == ("tcp://*:5558", "ipc:///tmp/replay_dp1")


def test_engine_core_process_runs_the_dp_ranks(tiny_model_factory, reference, monkeypatch):
    """The engine core in a process of its own (the default with a GPU) holds the DP ranks the same way."""
    import asyncio

    from pagoda.engine.core_client import AsyncMPEngine

    monkeypatch.setenv("PAGODA_ENABLE_ENGINE_CORE_PROCESS", "1")
    engine = AsyncMPEngine.from_engine_args(EngineArgs(
        model=str(tiny_model_factory("mixtral")), dtype="float32", kv_cache_memory=0.02, max_num_batched_tokens=16,
        data_parallel_size=2, enable_expert_parallel=True))

    async def generate(index, prompt):
        async for out in engine.generate(prompt, GREEDY, str(index)):
            last = out
        return last.outputs[0].token_ids

    async def everything():
        return await asyncio.gather(*(generate(i, p) for i, p in enumerate(PROMPTS)))

    try:
        assert asyncio.run(everything()) == reference("mixtral")
        assert [rank.num_requests_added for rank in engine.get_stats().data_parallel] == [2, 2]
    finally:
        engine.shutdown()


def test_dp_over_two_nodes_with_a_headless_node(tiny_model_factory, reference, tmp_path):
    """DP=2 with one DP rank per node (here two processes on loopback): the head runs rank 0 and the engine, a
    `pagoda serve --headless` node rank 1 (only /health and /metrics on its port); experts over both."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    def free_port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    path, rpc_port = tiny_model_factory("mixtral"), free_port()
    nodes = ["-dp", "2", "--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1",
             "--data-parallel-rpc-port", str(rpc_port)]
    log = open(tmp_path / "headless.log", "wb")
    headless = subprocess.Popen([str(Path(sys.executable).parent / "pagoda"), "serve", str(path), "--headless",
                                 "--data-parallel-start-rank", "1", "--port", str(free_port()), "--dtype", "float32",
                                 "--kv-cache-memory", "0.02", "--max-num-batched-tokens", "16",
                                 "--enable-expert-parallel", "--distributed-timeout", "60", *nodes],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        llm = dp_llm(path, enable_expert_parallel=True, data_parallel_size_local=1, distributed_timeout=60,
                     data_parallel_address="127.0.0.1", data_parallel_rpc_port=rpc_port)
        try:
            assert run(llm) == reference("mixtral")
            assert all(n > 0 for n in served_ranks(llm))
        finally:
            llm.shutdown()
        assert headless.wait(30) == 0, (tmp_path / "headless.log").read_text()[-3000:]
    finally:
        if headless.poll() is None:
            headless.kill()
            headless.wait()


def test_an_idle_engine_outlives_the_group_timeout(tiny_model_factory):
    """The other DP ranks wait for their next schedule longer than distributed_timeout while nothing comes
    (a point-to-point recv would time out there and take the rank down)."""
    import time

    llm = dp_llm(tiny_model_factory("llama"), distributed_timeout=10)  # (a loaded machine joins in time)
    try:
        first = run(llm, PROMPTS[:2])
        time.sleep(14)
        assert run(llm, PROMPTS[:2]) == first
    finally:
        llm.shutdown()
