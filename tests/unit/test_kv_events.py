"""KV events from the block manager, no model: every change of the prefix cache is told, in order, so a
consumer replaying the events holds exactly the block manager's cached hashes (device) and the hashed blocks
in swap (host), through evictions, swaps, frees and resets; the hashes are computable from token ids."""

import random
from collections import Counter

import msgspec
import pytest

from pagoda.config.kv_events import KVEventsConfig
from pagoda.core.block_hash import chain_hashes, lora_root
from pagoda.core.block_manager import BlockManager
from pagoda.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventRecorder,
)
from pagoda.core.sequence import Sequence
from pagoda.errors import InvalidParam
from pagoda.lora.request import LoRARequest
from pagoda.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

BS = 4


class Replica:
    """What a consumer knows from the events alone."""

    def __init__(self):
        self.gpu: set[int] = set()
        self.cpu: Counter = Counter()

    def apply(self, events):
        for e in events:
            if isinstance(e, AllBlocksCleared):
                self.gpu.clear()
                self.cpu.clear()
            elif isinstance(e, BlockStored):
                assert len(e.token_ids) == BS * len(e.block_hashes)
                if e.medium == "GPU":
                    assert not self.gpu & set(e.block_hashes), "a block stored twice without a removal"
                    self.gpu.update(e.block_hashes)
                else:
                    self.cpu.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                if e.medium == "GPU":
                    assert set(e.block_hashes) <= self.gpu, "a removal of a block never stored"
                    self.gpu.difference_update(e.block_hashes)
                else:
                    self.cpu.subtract(e.block_hashes)
                    self.cpu = +self.cpu


def managed(num_blocks=12, num_swap_blocks=16):
    bm = BlockManager(num_blocks, BS, True, num_swap_blocks)
    bm.events = KVEventRecorder(BS)
    return bm


def check(bm, replica):
    # encode and decode through the wire schema, as a subscriber would
    batch = EventBatch(ts=0.0, events=bm.events.take(), data_parallel_rank=0)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(batch), type=EventBatch)
    replica.apply(msgspec.convert(decoded.events, list[BlockStored | BlockRemoved | AllBlocksCleared]))
    assert replica.gpu == set(bm.cached_blocks)
    assert replica.cpu == Counter(h for hashes in bm.swap_hashes.values() for h in hashes)


def test_stored_hashes_are_the_chain_a_router_computes():
    bm, replica = managed(), Replica()
    tokens = list(range(100, 111))  # 2 full blocks and a partial one
    s = Sequence("r", tokens, SamplingParams(max_tokens=4))
    assert bm.allocate(s, len(tokens)) == []
    events = bm.events.take()
    assert len(events) == 1 and events[0].block_hashes == chain_hashes(tokens, BS)
    assert events[0].parent_block_hash is None and events[0].token_ids == tokens[:8]
    assert events[0].lora_name is None and events[0].medium == "GPU" and events[0].block_size == BS
    replica.apply(events)
    # the adapter's chain starts at its name's root, and the event names the adapter
    adapter = LoRARequest("sql", 3, "/nowhere")
    s2 = Sequence("r2", tokens, SamplingParams(max_tokens=4))
    s2.lora_request = adapter
    bm.allocate(s2, len(tokens))
    (event,) = bm.events.take()
    assert event.block_hashes == chain_hashes(tokens, BS, lora_root("sql"))
    assert (event.lora_name, event.lora_id) == ("sql", 3)


def test_a_random_run_with_evictions_swaps_and_resets_is_accounted_for():
    rng = random.Random(7)
    bm, replica = managed(), Replica()
    prefixes = [[rng.randrange(1000) for _ in range(BS * 2)] for _ in range(3)]
    live, swapped, evicted, swaps, resets = [], [], 0, 0, 0
    for step in range(400):
        op = rng.random()
        if op < 0.45:  # a new sequence sharing a prefix (a hit when still cached)
            tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 9))]
            s = Sequence(f"r{step}", tokens, SamplingParams(max_tokens=8))
            cached = bm.find_cached_prefix(s)
            if bm.allocate(s, len(tokens) - len(cached) * BS, cached) is not None:
                s.num_computed_tokens = len(tokens)
                live.append(s)
        elif op < 0.65 and live:  # a decode step of one sequence: fills blocks one token at a time
            s = rng.choice(live)
            s.append_token(rng.randrange(1000))
            if bm.allocate(s, 1) is not None:
                s.num_computed_tokens = s.num_tokens
        elif op < 0.8 and live:
            s = live.pop(rng.randrange(len(live)))
            if rng.random() < 0.5 and bm.can_swap_out(s):
                bm.swap_out(s)
                swaps += 1
                s.num_computed_tokens = s.num_tokens
                swapped.append(s)
            else:
                bm.free(s)
        elif op < 0.9 and swapped:
            s = swapped.pop(0)
            if rng.random() < 0.3:
                bm.free(s)  # finished (aborted) while swapped out
            elif bm.swap_in(s, 0) is not None:
                live.append(s)
            else:
                swapped.insert(0, s)
        elif op < 0.92:  # every sequence ends, then the cache is reset
            for s in live + swapped:
                bm.free(s)
            live.clear()
            swapped.clear()
            assert bm.reset_prefix_cache()
            resets += 1
        evicted += sum(len(e.block_hashes) for e in bm.events.pending
                       if isinstance(e, BlockRemoved) and e.medium == "GPU")
        check(bm, replica)
    assert evicted > 20 and swaps > 5 and resets > 0  # the run did evict, swap and reset
    assert bm.num_evicted_blocks == evicted  # pagoda:prefix_cache_evicted_blocks_total counts what the events say
    for s in live + swapped:
        bm.free(s)
    check(bm, replica)
    bm.check_no_leaks()


def test_reset_refused_while_blocks_are_held():
    bm = managed()
    s = Sequence("r", list(range(8)), SamplingParams(max_tokens=4))
    bm.allocate(s, 8)
    bm.events.take()
    assert not bm.reset_prefix_cache() and bm.events.take() == []
    bm.free(s)
    assert bm.reset_prefix_cache() and isinstance(bm.events.take()[0], AllBlocksCleared)
    assert not bm.cached_blocks


def test_config_keys_are_vllms_and_bad_ones_are_named():
    c = KVEventsConfig.parse('{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000", "topic": "kv"}')
    assert c.enabled and c.resolved_publisher == "zmq" and c.buffer_steps == 10_000 and c.hwm == 100_000
    assert not KVEventsConfig.parse({"enable_kv_cache_events": True, "publisher": "null"}).enabled
    assert not KVEventsConfig.parse({}).enabled
    for raw, words in [('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher"),
                       ('{"enable_kv_events": true}', "unknown key 'enable_kv_events'"),
                       ('{"buffer_steps": 0}', "buffer_steps"), ("[1]", "JSON object"), ("{", "not JSON")]:
        with pytest.raises(InvalidParam, match=words):
            KVEventsConfig.parse(raw)
