"""The precise policy's scorer on a hand-fed KV index (no replicas): a conversation follows the replica that
holds its own blocks; a new tenant (no run, a short one, or a run several replicas hold) goes to the least
churning cache within the load bound; the churn is the events' stored blocks, decayed, plus the blocks of
requests routed there and not yet stored."""

import time

import pytest

from pagoda.core.block_hash import chain_hashes
from pagoda.core.kv_events import BlockStored, KVEventBatch
from pagoda.router.backends import Backend
from pagoda.router.kv_index import CHURN_HALF_LIFE, Churn, KVIndex
from pagoda.router.policies import RoutingRequest
from pagoda.router.precise import Precise

pytestmark = pytest.mark.unit

BS = 4
A, B, C = "http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"


def stored(tokens: list[int], ts: float | None = None) -> KVEventBatch:
    hashes = chain_hashes(tokens, BS)
    return KVEventBatch(ts=time.time() if ts is None else ts, events=[BlockStored(
        block_hashes=hashes, parent_block_hash=None, token_ids=tokens[: len(hashes) * BS], block_size=BS,
        lora_id=None, medium="GPU", lora_name=None)])


def backends(*loads: int) -> list[Backend]:
    return [Backend(url, healthy=True, in_flight=load) for url, load in zip((A, B, C), loads)]


def feed(index: KVIndex, url: str, tokens: list[int]) -> None:
    entry = index.replica(url)
    seq = -1 if entry.last_seq is None else entry.last_seq
    index.apply(url, seq + 1, stored(tokens))


def request(tokens: list[int], max_tokens: int | None = None) -> RoutingRequest:
    return RoutingRequest(token_ids=tokens, body={"max_tokens": max_tokens} if max_tokens else {})


def test_churn_decays_by_its_half_life_and_stored_blocks_replace_expected_ones():
    churn = Churn()
    churn.add_expected(10, now=0.0)
    churn.add_stored(4, when=0.0)  # 4 of the 10 expected arrived
    assert churn.value(0.0) == pytest.approx(10)
    assert churn.value(CHURN_HALF_LIFE) == pytest.approx(5)
    churn.add_stored(8, when=0.0)  # a replayed batch from a half-life ago counts half
    assert churn.value(CHURN_HALF_LIFE) == pytest.approx(2 + 4)  # and replaces the 3 still expected


def test_index_counts_each_replicas_stored_device_blocks_as_churn():
    index = KVIndex()
    feed(index, A, list(range(40)))  # 10 blocks
    feed(index, B, list(range(100, 108)))  # 2 blocks
    assert index.churn(A) == pytest.approx(10, rel=0.01) and index.churn(B) == pytest.approx(2, rel=0.01)
    assert index.churn(C) == 0
    index.apply(B, 1, stored(list(range(200, 240)), ts=time.time() - CHURN_HALF_LIFE))  # replayed, a half-life old
    assert index.churn(B) == pytest.approx(2 + 5, rel=0.01)
    assert index.summary()[A]["churn"] == pytest.approx(10, abs=0.1)


def test_a_conversation_stays_on_the_replica_holding_its_own_blocks():
    index = KVIndex()
    history = list(range(1000, 1040))
    feed(index, A, history)
    feed(index, B, list(range(40)))
    feed(index, B, list(range(300, 340)))  # B churns more, but A holds the conversation
    policy = Precise(index)
    decision = policy.choose(request(history + [1, 2, 3, 4, 5]), backends(1, 0))
    assert (decision.backend.url, decision.reason, decision.matched_chars) == (A, "prefix-match", 10)


def test_a_new_conversation_goes_to_the_least_churning_cache_within_the_load_bound():
    index = KVIndex()
    system = list(range(12))  # a shared system prompt, 3 blocks, cached everywhere
    for url in (A, B, C):
        feed(index, url, system)
    feed(index, A, list(range(500, 600)))  # A computed 25 blocks of other conversations lately
    feed(index, C, list(range(700, 740)))  # C 10
    policy = Precise(index)
    # a long first turn: the system prompt is under half of it
    decision = policy.choose(request(system + list(range(2000, 2020))), backends(0, 1, 0))
    assert (decision.backend.url, decision.reason) == (B, "prefix-short-match")  # busier but least churn
    # no run at all: the same
    assert policy.choose(request(list(range(3000, 3020))), backends(0, 1, 0)).backend.url == B
    # past the bound (ceil(1.25 x 6 / 3) + 2 = 5): the next least churning replica
    decision = policy.choose(request(list(range(3000, 3020))), backends(0, 5, 0))
    assert decision.backend.url == C


def test_a_run_several_replicas_hold_is_shared_and_goes_by_churn():
    index = KVIndex()
    system = list(range(40))  # 10 blocks: most of a short first turn
    for url in (A, B):
        feed(index, url, system)
    feed(index, A, list(range(500, 600)))
    policy = Precise(index)
    decision = policy.choose(request(system + [7, 7, 7, 7, 7]), backends(0, 0))
    assert (decision.backend.url, decision.reason) == (B, "prefix-shared")


def test_routed_requests_count_until_their_events_come_so_a_burst_spreads():
    index = KVIndex()
    for url in (A, B, C):
        feed(index, url, list(range(8)))  # equal churn: 2 blocks each
    policy = Precise(index)
    chosen = []
    for i in range(3):  # three new conversations before any of their events arrive
        r = request(list(range(10_000 * (i + 1), 10_000 * (i + 1) + 40)), max_tokens=8)
        decision = policy.choose(r, backends(0, 0, 0))
        policy.routed(r, decision)
        chosen.append(decision.backend.url)
    assert sorted(chosen) == [A, B, C]
    assert index.churn(chosen[0]) == pytest.approx(2 + (40 + 8) // BS, rel=0.01)
    # the first one's blocks arrive: they replace the expected ones, not add to them
    feed(index, chosen[0], list(range(10_000, 10_040)))
    assert index.churn(chosen[0]) == pytest.approx(2 + 12, rel=0.01)


def test_a_replica_not_heard_from_counts_at_the_others_mean_churn():
    index = KVIndex()
    feed(index, A, list(range(40)))  # 10 blocks
    feed(index, B, list(range(100, 108)))  # 2 blocks; C never published
    policy = Precise(index)
    new = request(list(range(5000, 5020)))
    assert policy.choose(new, backends(0, 0, 0)).backend.url == B  # 2 < C's 6 (the mean) < 10
    feed(index, B, list(range(200, 240)))  # B: 12 blocks; C now counts at 11
    assert policy.choose(new, backends(0, 0, 0)).backend.url == A


def test_a_responses_requests_max_output_tokens_count_as_expected_blocks():
    index = KVIndex()
    feed(index, A, list(range(8)))  # 2 blocks
    policy = Precise(index)
    r = RoutingRequest(token_ids=list(range(100, 140)), body={"input": "hi", "max_output_tokens": 8})
    policy.routed(r, policy.choose(r, backends(0)))
    assert index.churn(A) == pytest.approx(2 + (40 + 8) // BS, rel=0.01)
