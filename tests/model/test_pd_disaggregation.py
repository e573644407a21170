"""P/D disaggregation over NIXL (pagoda.kv_transfer): a prefill engine in its own process, a decode engine here.
The decode engine READs the prompt's KV blocks over NIXL (UCX, host memory) and decodes; its greedy tokens equal
a single engine's, and both engines' blocks are back to free afterwards. Faults (an unreachable peer, blocks
already gone) make the decode engine compute the prompt itself."""

import json
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("nixl_cu12")

from pagoda.entrypoints.llm import LLM  # noqa: E402
from pagoda.sampling_params import SamplingParams  # noqa: E402

COMMON = dict(dtype="float32", kv_cache_memory=0.01, block_size=16)
PROMPTS = ["the quick brown fox jumps over the lazy dog " * 3, "a b c d e f g h i j k l m n o p q r s t u v w x y z",
           "hello"]
MAX_TOKENS = 8
PRODUCER = {"kv_connector": "NixlConnector", "kv_role": "kv_producer",
            "kv_connector_extra_config": {"side_channel_port": 0}}
CONSUMER = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}

# the prefill engine's process: JSON commands on stdin, "PD " + JSON answers on stdout
_PREFILL_PROCESS = textwrap.dedent("""
    import json, sys, time
    from pagoda.entrypoints.llm import LLM
    from pagoda.sampling_params import SamplingParams
    llm = LLM(sys.argv[1], kv_transfer_config=json.loads(sys.argv[2]), **json.loads(sys.argv[3]))
    engine = llm.engine
    def answer(value):
        print("PD " + json.dumps(value), flush=True)
    answer("ready")
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "prefill":
            outputs = llm.generate(command["prompts"], SamplingParams(
                temperature=0, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
            answer([o.kv_transfer_params for o in outputs])
        elif command["op"] == "blocks":  # steps until no block is held for a pull (or 10 s)
            deadline = time.monotonic() + 10
            while engine.core.kv_connector.num_held and time.monotonic() < deadline:
                engine.step()
                time.sleep(0.05)
            answer({"free": engine.block_manager.num_free_blocks, "total": engine.num_blocks,
                    "held": engine.core.kv_connector.num_held})
""")


class PrefillProcess:
    def __init__(self, model_dir: Path, **engine_kwargs):
        """engine_kwargs: beside COMMON (tensor_parallel_size, ...)."""
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _PREFILL_PROCESS, str(model_dir), json.dumps(PRODUCER),
             json.dumps({**COMMON, **engine_kwargs})],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._read() == "ready"

    def _read(self):
        for line in self.proc.stdout:
            if line.startswith("PD "):
                return json.loads(line[3:])
        raise RuntimeError(f"the prefill process ended (exit {self.proc.wait()})")

    def ask(self, **command):
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self):
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def greedy_reference(model_dir) -> list[list[int]]:
    """PROMPTS' greedy tokens from one engine without a connector: what every P/D pair must reproduce."""
    with LLM(str(model_dir), **COMMON) as llm:
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def single_engine_tokens(tiny_llama_dir):
    return greedy_reference(tiny_llama_dir)


@pytest.fixture(scope="module")
def prefill(tiny_llama_dir):
    process = PrefillProcess(tiny_llama_dir)
    yield process
    process.close()


@pytest.fixture(scope="module")
def decode(tiny_llama_dir):
    # no prefix cache: a prompt decoded before would be found here, not pulled (or recomputed) again
    with LLM(str(tiny_llama_dir), kv_transfer_config=CONSUMER, enable_prefix_caching=False, **COMMON) as llm:
        yield llm


def _decode(llm, params_list):
    outputs = llm.generate(PROMPTS[:len(params_list)], [
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, kv_transfer_params=p) for p in params_list])
    return [o.outputs[0].token_ids for o in outputs]


def _stats(llm):
    return llm.engine.core.kv_connector.stats, llm.engine.executor.runner.kv_connector.stats


def test_decode_pulls_the_prefill_kv_and_matches_a_single_engine(prefill, decode, single_engine_tokens):
    params = prefill.ask(op="prefill", prompts=PROMPTS)
    for p in params:
        assert p["do_remote_prefill"] is True and p["remote_block_ids"] and p["remote_port"] > 0
    scheduler_stats, worker_stats = _stats(decode)
    before = worker_stats.num_transfers
    assert _decode(decode, params) == single_engine_tokens
    # every prompt longer than one token came over NIXL ("hello" is 1 token + BOS: its block too)
    assert worker_stats.num_transfers - before == len(PROMPTS)
    assert worker_stats.bytes_transferred > 0 and scheduler_stats.num_recomputed_prompts == 0
    blocks = prefill.ask(op="blocks")
    assert blocks["held"] == 0 and blocks["free"] == blocks["total"]
    assert decode.engine.block_manager.num_free_blocks == decode.engine.num_blocks


def test_blocks_already_pulled_are_recomputed(prefill, decode, single_engine_tokens):
    params = prefill.ask(op="prefill", prompts=PROMPTS[:1])
    assert _decode(decode, params) == single_engine_tokens[:1]
    assert prefill.ask(op="blocks")["held"] == 0
    scheduler_stats, _ = _stats(decode)
    recomputed = scheduler_stats.num_recomputed_prompts
    assert _decode(decode, params) == single_engine_tokens[:1]  # the same params again: the blocks are gone
    assert scheduler_stats.num_recomputed_prompts == recomputed + 1
    assert decode.engine.block_manager.num_free_blocks == decode.engine.num_blocks


def test_an_unreachable_prefill_engine_is_recomputed(decode, single_engine_tokens):
    with socket.socket() as s:  # a port no one listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    params = {"do_remote_prefill": True, "remote_engine_id": "gone", "remote_block_ids": [0, 1, 2],
              "remote_host": "127.0.0.1", "remote_port": port}
    scheduler_stats, _ = _stats(decode)
    failed = scheduler_stats.num_failed_transfers
    assert _decode(decode, [params]) == single_engine_tokens[:1]
    assert scheduler_stats.num_failed_transfers == failed + 1
    assert decode.engine.block_manager.num_free_blocks == decode.engine.num_blocks


def test_the_decode_uses_the_pulled_kv(tiny_llama_dir, single_engine_tokens):
    """Noise written over the prefill's blocks before the pull changes the decode's tokens: the decode reads
    them, it does not compute the prompt again."""
    import torch

    producer = {**PRODUCER, "kv_connector_extra_config": {"side_channel_port": 0}}
    with LLM(str(tiny_llama_dir), kv_transfer_config=producer, **COMMON) as p, \
            LLM(str(tiny_llama_dir), kv_transfer_config=CONSUMER, **COMMON) as d:
        params = p.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=1,
                                                        kv_transfer_params={"do_remote_decode": True}))
        params = params[0].kv_transfer_params
        generator = torch.Generator().manual_seed(0)
        for cache in p.engine.executor.runner.kv_cache.caches:
            cache[:, params["remote_block_ids"]] = torch.randn(
                cache[:, params["remote_block_ids"]].shape, generator=generator) * 10
        assert _decode(d, [params]) != single_engine_tokens[:1]


def test_unpulled_blocks_are_freed_after_the_timeout(tiny_llama_dir):
    producer = {**PRODUCER, "kv_connector_extra_config": {"side_channel_port": 0, "abort_request_timeout": 0.2}}
    with LLM(str(tiny_llama_dir), kv_transfer_config=producer, **COMMON) as p:
        engine = p.engine
        out = p.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=1,
                                                     kv_transfer_params={"do_remote_decode": True}))
        assert out[0].kv_transfer_params["remote_block_ids"]
        assert engine.block_manager.num_free_blocks < engine.num_blocks  # held for a decode engine
        time.sleep(0.3)
        engine.step()
        assert engine.block_manager.num_free_blocks == engine.num_blocks
        assert engine.core.kv_connector.stats.num_held_timeouts == 1
