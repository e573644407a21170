"""The precise policy's KV-event subscriber against Pagoda's real publisher on ipc sockets, no engine: a
router that starts after the replica fills the batches it missed from the replay socket; a replica that
restarts (a new publisher, numbering from 0 again) is cleared, also when the router sees only its batches
numbered past the old ones or the next number after reconnecting; without replay a late join keeps only what
it saw."""

import asyncio

import pytest
import zmq

from pagoda.config.kv_events import KVEventsConfig
from pagoda.core.block_hash import chain_hashes
from pagoda.core.kv_events import KVEventRecorder, ZmqEventPublisher
from pagoda.router.backends import BackendPool
from pagoda.router.kv_index import KVIndex
from pagoda.router.kv_subscriber import KVEventSubscriber

pytestmark = pytest.mark.unit

URL = "http://127.0.0.1:8000"
BS = 4


def publisher(tmp_path, replay=True) -> ZmqEventPublisher:
    return ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/kv-8000",
                                            replay_endpoint=f"ipc://{tmp_path}/replay-8000" if replay else None))


def store(pub: ZmqEventPublisher, tokens: list[int]) -> list[int]:
    recorder = KVEventRecorder(BS)
    hashes = chain_hashes(tokens, BS)
    recorder.stored(hashes, None, tokens[: len(hashes) * BS], None)
    pub.publish(recorder.take())
    return hashes


async def until(condition, what: str, timeout: float = 20.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.05)


async def test_late_join_replays_and_a_restart_clears(tmp_path):
    index = KVIndex()
    pub = publisher(tmp_path)
    early = [store(pub, list(range(i * 100, i * 100 + 8))) for i in range(3)]  # before anyone listens
    await until(lambda: len(pub.buffer) == 3, "the early batches sent (to nobody)")
    subscriber = KVEventSubscriber(BackendPool([URL]), index, f"ipc://{tmp_path}/kv-{{port}}",
                                   f"ipc://{tmp_path}/replay-{{port}}")
    task = asyncio.create_task(subscriber.run())
    try:
        later = []
        # keep publishing until the subscription is live (a PUB drops what no subscriber has asked for yet)
        while index.replicas.get(URL) is None or index.replicas[URL].last_seq is None:
            later.append(store(pub, [7, len(later), 7, 7]))
            await asyncio.sleep(0.1)
        entry = index.replicas[URL]
        expected = {h for hashes in early + later for h in hashes}
        await until(lambda: entry.device == expected, f"{len(entry.device)} of {len(expected)} blocks")
        assert entry.gaps == 0 and entry.last_seq == len(early) + len(later) - 1
        # the churn counts what came live (a block a batch), not the history replayed at the join (early's 6)
        assert 1 - 0.1 <= index.churn(URL) <= len(later) + 0.1
        # the replica restarts: a new publisher numbering from 0, whose cache starts empty
        pub.shutdown()
        pub = publisher(tmp_path)
        fresh = []
        while entry.restarts == 0:
            fresh.append(store(pub, [9, len(fresh), 9, 9]))
            await asyncio.sleep(0.1)
        await until(lambda: entry.device == {h for hashes in fresh for h in hashes}, "only the new blocks")
        assert not entry.device & expected
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        pub.shutdown()


async def test_without_replay_a_late_join_keeps_what_it_saw(tmp_path):
    index = KVIndex()
    pub = publisher(tmp_path, replay=False)
    missed = store(pub, [1, 2, 3, 4])
    await until(lambda: len(pub.buffer) == 1, "the first batch sent (to nobody)")
    subscriber = KVEventSubscriber(BackendPool([URL]), index, f"ipc://{tmp_path}/kv-{{port}}")
    task = asyncio.create_task(subscriber.run())
    try:
        seen = []
        while index.replicas.get(URL) is None or index.replicas[URL].last_seq is None:
            seen.append(store(pub, [5, len(seen), 5, 5]))
            await asyncio.sleep(0.1)
        entry = index.replicas[URL]
        assert missed[0] not in entry.device and entry.last_seq >= 1
        assert index.match(URL, seen[-1]) == 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        pub.shutdown()


def replayed(tmp_path, start: int) -> list[tuple[int, bytes]]:
    import zmq

    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(f"ipc://{tmp_path}/replay-8000")
    dealer.send_multipart((b"", start.to_bytes(8, "big")))
    got = []
    while True:
        assert dealer.poll(10_000)
        _, seq, payload = dealer.recv_multipart()
        seq = int.from_bytes(seq, "big", signed=True)
        if seq == -1:
            break
        got.append((seq, payload))
    dealer.close(linger=0)
    context.term()
    return got


async def test_a_gap_is_filled_from_replay_or_clears_the_entry(tmp_path):
    pub = publisher(tmp_path)
    try:
        chains = [store(pub, [3, i, 3, 3]) for i in range(5)]
        batches = []
        while len(batches) < 5:  # (the publisher thread sends them in the background)
            batches = replayed(tmp_path, 0)
        with_replay = KVIndex()
        subscriber = KVEventSubscriber(BackendPool([URL]), with_replay, f"ipc://{tmp_path}/kv-{{port}}",
                                       f"ipc://{tmp_path}/replay-{{port}}")
        await subscriber.receive(URL, *batches[0])
        await subscriber.receive(URL, *batches[3])  # 1 and 2 were missed
        entry = with_replay.replicas[URL]
        assert entry.gaps == 1 and entry.last_seq == 3
        assert entry.device == {h for c in chains[:4] for h in c}
        without = KVIndex()
        subscriber = KVEventSubscriber(BackendPool([URL]), without, f"ipc://{tmp_path}/kv-{{port}}")
        await subscriber.receive(URL, *batches[0])
        await subscriber.receive(URL, *batches[3])
        entry = without.replicas[URL]  # what it knew may be stale: it starts over from batch 3
        assert entry.gaps == 1 and entry.clears == 1 and entry.device == set(chains[3])
        subscriber.context.destroy(linger=0)
    finally:
        pub.shutdown()


async def test_a_restart_numbered_past_the_old_publisher_is_not_a_gap_to_fill(tmp_path):
    """The replica restarts and its new publisher's numbers go past the old one's before the router hears it:
    a gap that the new publisher's replay would "fill" with its own batches, leaving the old blocks. The replay
    no longer holds the last batch applied as it was: the entry starts over from the new history."""
    old = publisher(tmp_path)
    try:
        old_chains = [store(old, [4, i, 4, 4]) for i in range(2)]
        old_batches = []
        while len(old_batches) < 2:
            old_batches = replayed(tmp_path, 0)
    finally:
        old.shutdown()
    index = KVIndex()
    subscriber = KVEventSubscriber(BackendPool([URL]), index, f"ipc://{tmp_path}/kv-{{port}}",
                                   f"ipc://{tmp_path}/replay-{{port}}")
    for batch in old_batches:
        await subscriber.receive(URL, *batch)
    entry = index.replicas[URL]
    assert entry.device == {h for c in old_chains for h in c}
    new = publisher(tmp_path)
    try:
        new_chains = [store(new, [6, i, 6, 6]) for i in range(5)]
        new_batches = []
        while len(new_batches) < 5:
            new_batches = replayed(tmp_path, 0)
        await subscriber.receive(URL, *new_batches[4])  # 2 and 3 look missed; 0 and 1 reuse the old numbers
        assert entry.device == {h for c in new_chains for h in c}
        assert entry.last_seq == 4 and entry.gaps == 1 and entry.clears == 1
    finally:
        subscriber.context.destroy(linger=0)
        new.shutdown()


@pytest.mark.parametrize("replay", [True, False])
async def test_a_restart_seen_first_at_the_next_number_is_caught_by_the_reconnection(tmp_path, replay):
    """The router saw batch 0 of the old publisher; the replica restarts, and the new publisher's batch 0 goes
    out before the subscription reconnects: batch 1 is the next number. The reconnection (the SUB socket's
    monitor) makes it prove it continues; it cannot, so the old blocks go (with replay, the new publisher's
    batch 0 comes back from it)."""
    index = KVIndex()
    pub = publisher(tmp_path, replay)
    subscriber = KVEventSubscriber(BackendPool([URL]), index, f"ipc://{tmp_path}/kv-{{port}}",
                                   f"ipc://{tmp_path}/replay-{{port}}" if replay else None)
    subscriber.context.setsockopt(zmq.RECONNECT_IVL, 1000)  # a new publisher's first batch goes to nobody
    task = asyncio.create_task(subscriber.run())
    try:
        await asyncio.sleep(0.5)  # subscribed (the PUB drops what is sent before)
        store(pub, [8, 0, 8, 8])
        await until(lambda: URL in index.replicas and index.replicas[URL].last_seq == 0, "batch 0 seen")
        entry = index.replicas[URL]
        for _ in range(3):  # until the new publisher's batch 0 is missed (the reconnection comes after it)
            old = set(entry.device)
            restarts = entry.restarts
            pub.shutdown()
            pub = publisher(tmp_path, replay)
            new = store(pub, [2, 0, 2, 2])
            await asyncio.sleep(0.3)
            if entry.restarts == restarts:
                break
        assert entry.restarts == restarts and entry.last_seq == 0, "the new batch 0 was not missed"
        await asyncio.sleep(1.5)  # reconnected: batch 1 is the next number, not a gap
        while entry.last_seq == 0:
            new += store(pub, [3, len(new), 3, 3])
            await asyncio.sleep(0.5)
        assert old and not entry.device & old
        assert entry.device == set(new) if replay else entry.device < set(new)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        pub.shutdown()


async def test_a_data_parallel_replica_is_followed_on_every_engines_stream(tmp_path):
    """A DP replica publishes one stream per engine, rank r on the endpoint + r (_dp<r> for ipc, as vLLM); the
    subscriber follows the engines the replica's /metrics labels, each its own entry, and the replica holds
    a prefix when any of its ranks does (its own balancer sends the request there)."""
    base = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/kv-8000")
    pubs = [ZmqEventPublisher(base.for_data_parallel_rank(rank), rank) for rank in (0, 1)]
    pool = BackendPool([URL])
    (backend,) = pool.all()
    backend.engines = (0, 1)  # what the health monitor reads from engine="0" and engine="1"
    index = KVIndex()
    subscriber = KVEventSubscriber(pool, index, f"ipc://{tmp_path}/kv-{{port}}")
    task = asyncio.create_task(subscriber.run())
    rank1 = URL + "#engine=1"
    try:
        ones, deadline = [], asyncio.get_running_loop().time() + 20
        while index.replicas.get(rank1) is None or index.replicas.get(URL) is None:
            assert asyncio.get_running_loop().time() < deadline, f"streams followed: {sorted(index.replicas)}"
            ones.append(store(pubs[1], [5, len(ones), 5, 5, 5, 5, 5, 5]))
            store(pubs[0], [6, len(ones), 6, 6])
            await asyncio.sleep(0.1)
        assert index.replicas[rank1].device >= set(ones[-1]) and not index.replicas[URL].device & set(ones[-1])
        assert index.match(URL, ones[-1]) == 2  # held by rank 1 only
        # a replica that turns out to run only rank 1 (a --data-parallel-rank 1 server): rank 0's entry goes
        backend.engines = (1,)
        await until(lambda: URL not in index.replicas, "engine 0's stream dropped")
        assert rank1 in index.replicas and index.match(URL, ones[-1]) == 2
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for pub in pubs:
            pub.shutdown()
