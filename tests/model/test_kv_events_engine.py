"""KV events from a real engine (tiny model, a KV cache small enough to evict), read off ZMQ the way vLLM's
consumers read them: msgspec structs written here after vLLM 0.32's ``vllm.distributed.kv_events`` (not
Pagoda's own), the frames (topic, sequence number, payload), the replay socket. Every event of the run is
accounted for: replaying them gives exactly the engine's cached blocks; the hashes are the token ids' chain."""

import os
import socket
import subprocess
from typing import Any

import msgspec
import pytest
import zmq

from pagoda import LLM, SamplingParams
from pagoda.core.block_hash import chain_hashes

pytestmark = pytest.mark.model


# --- vLLM 0.32's event structs, as its consumers declare them ------------------------------------------

class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
BLOCK_SIZE = 16
BLOCK_BYTES = 8192  # the tiny llama's KV block of 16 tokens, float32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replay(context, endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """Ask the replay socket for every kept batch from `start` on (vLLM's protocol, a DEALER client)."""
    dealer = context.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        got = []
        while True:
            assert dealer.poll(30_000), "the replay socket did not answer"
            _, seq, payload = dealer.recv_multipart()
            seq = int.from_bytes(seq, "big", signed=True)
            if seq == -1:
                assert payload == b""
                return got
            got.append((seq, payload))
    finally:
        dealer.close(linger=0)


@pytest.fixture(scope="module")
def run(tiny_model_factory, tmp_path_factory):
    pub, rep = f"ipc://{tmp_path_factory.mktemp('kv-events')}/pub", free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub,
              "replay_endpoint": f"tcp://127.0.0.1:{rep}", "topic": "kv@test"}
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@test")
    # 12 blocks: the prompts' blocks do not all fit, so later prompts evict earlier ones
    llm = LLM(str(tiny_model_factory("llama")), dtype="float32", kv_cache_memory=12 * BLOCK_BYTES / 2**30,
              max_model_len=128, kv_events_config=config)
    sub.connect(pub)  # an ipc endpoint is bound by the engine (vLLM's rule: wildcards and local transports)
    try:
        tokenizer = llm.get_tokenizer()
        prompts = [f"System prompt, shared. Question {i}: " + "ab " * (3 * i + 5)
                   for i in range(6)]
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        for prompt in prompts + prompts[:2]:  # one at a time: each evicts what the cache cannot keep
            llm.generate([prompt], params, use_tqdm=False)
        cached = set(llm.engine.block_manager.cached_blocks)
        llm.engine.core.kv_events.flush()
        whole = replay(context, f"tcp://127.0.0.1:{rep}", 0)
        later = replay(context, f"tcp://127.0.0.1:{rep}", 3)
        llm.shutdown()  # publishes what is queued, closes the sockets
        live = []
        while sub.poll(2000):
            live.append(sub.recv_multipart())
        yield {"live": live, "replay": whole, "later": later, "cached": cached,
               "prompt_ids": [tokenizer.encode(p) for p in prompts]}
    finally:
        llm.shutdown()
        sub.close(linger=0)
        context.term()


def apply(batches) -> tuple[set[int], int]:
    held, removed = set(), 0
    for batch in batches:
        for e in batch.events:
            if isinstance(e, AllBlocksCleared):
                held.clear()
            elif isinstance(e, BlockStored) and e.medium == "GPU":
                assert e.block_size == BLOCK_SIZE and len(e.token_ids) == BLOCK_SIZE * len(e.block_hashes)
                assert not held & set(e.block_hashes)
                held.update(e.block_hashes)
            elif isinstance(e, BlockRemoved) and e.medium == "GPU":
                assert set(e.block_hashes) <= held
                held.difference_update(e.block_hashes)
                removed += len(e.block_hashes)
    return held, removed


def test_every_event_is_accounted_for_through_evictions(run):
    whole = run["replay"]
    assert [seq for seq, _ in whole] == list(range(len(whole)))  # from 0, no gap
    batches = [DECODER.decode(payload) for _, payload in whole]
    assert isinstance(batches[0].events[0], AllBlocksCleared)  # a fresh engine says its cache is empty
    assert all(b.data_parallel_rank == 0 and b.ts > 0 for b in batches)
    held, removed = apply(batches)
    assert removed > 0, "the run was meant to evict"
    assert held == run["cached"]
    assert run["later"] == whole[3:]


def test_the_live_stream_is_vllms_framing_in_order(run):
    frames = run["live"]
    assert frames and all(len(f) == 3 and f[0] == b"kv@test" for f in frames)
    seqs = [int.from_bytes(f[1], "big") for f in frames]
    # contiguous, ending with the run's last batch (the subscription may have joined after the first ones)
    assert seqs == list(range(seqs[0], len(run["replay"])))
    assert [f[2] for f in frames] == [payload for _, payload in run["replay"][seqs[0]:]]


def test_published_hashes_are_computable_from_token_ids(run):
    stored = {h for _, payload in run["replay"] for e in DECODER.decode(payload).events
              if isinstance(e, BlockStored) for h in e.block_hashes}
    for ids in run["prompt_ids"]:
        expected = chain_hashes(ids, BLOCK_SIZE)[: (len(ids) - 1) // BLOCK_SIZE]
        assert expected and set(expected) <= stored


VLLM_PEER_PYTHON = os.environ.get("PAGODA_VLLM_PEER_PYTHON", "/tmp/vllm-cpu-peer/bin/python")
DECODE_WITH_VLLM = """
import sys, msgspec
from vllm.distributed.kv_events import KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared
decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
data = open(sys.argv[1], "rb").read()
kinds = {BlockStored: "stored", BlockRemoved: "removed", AllBlocksCleared: "cleared"}
while data:
    n = int.from_bytes(data[:4], "big")
    batch = decoder.decode(data[4:4 + n])
    data = data[4 + n:]
    print(" ".join(kinds[type(e)] + ":" + str(len(getattr(e, "block_hashes", []))) for e in batch.events))
"""


@pytest.mark.skipif(not os.path.exists(VLLM_PEER_PYTHON), reason="no vLLM to decode with (PAGODA_VLLM_PEER_PYTHON, "
                    "or the venv of the vllm-cpu peer script)")
def test_vllms_own_classes_read_every_event(run, tmp_path):
    frames = tmp_path / "batches"
    frames.write_bytes(b"".join(len(p).to_bytes(4, "big") + p for _, p in run["replay"]))
    done = subprocess.run([VLLM_PEER_PYTHON, "-c", DECODE_WITH_VLLM, str(frames)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    kinds = {BlockStored: "stored", BlockRemoved: "removed", AllBlocksCleared: "cleared"}
    ours = [" ".join(kinds[type(e)] + ":" + str(len(getattr(e, "block_hashes", []))) for e in DECODER.decode(p).events)
            for _, p in run["replay"]]
    assert done.stdout.splitlines() == ours
