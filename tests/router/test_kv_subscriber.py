"""The precise policy's KV-event subscriber against Pagoda's real publisher on ipc sockets, no engine: a
router that starts after the replica fills the batches it missed from the replay socket; a replica that
restarts (a new publisher, numbering from 0 again) is cleared; without replay a late join keeps only what it
saw."""

import asyncio

import pytest

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
