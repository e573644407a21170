"""P/D with TP/PP > 1, without NIXL: the side channel serves each rank's handshake by its number, a peer of
another TP or PP size is refused at the first handshake naming both sizes (the decode side recomputes the
prompt), and one step's loads merge over the ranks (done when done on every rank)."""

from types import SimpleNamespace

import pytest

pytest.importorskip("zmq")

from pagoda.config.kv_transfer import KVTransferConfig, parse_kv_transfer_params  # noqa: E402
from pagoda.kv_transfer.base import KVConnectorOutput, TransferRecord  # noqa: E402
from pagoda.kv_transfer.nixl_connector import NixlConnectorScheduler  # noqa: E402

BLOCK = 16


def rank_metadata(rank: int) -> dict:
    # [base address, planes, blocks, bytes per block, device] per layer: one layer of rank's shard
    return {"agent_name": f"agent-{rank}", "agent_metadata": bytes([rank]) * 4, "layers": [[4096 * rank, 2, 8, 512, 0]],
            "mem_type": "DRAM"}


def connector(role: str, tp: int, pp: int = 1) -> NixlConnectorScheduler:
    config = KVTransferConfig("NixlConnector", role, {"side_channel_host": "127.0.0.1", "side_channel_port": 0},
                              engine_id=f"{role}-tp{tp}-pp{pp}")
    scheduler = NixlConnectorScheduler(config, BLOCK, tp, pp)
    scheduler.set_handshake_metadata([rank_metadata(r) for r in range(tp * pp)])
    return scheduler


def held_prompt(prefill: NixlConnectorScheduler, tokens: int = 40):
    """A prompt the prefill finished and holds for a pull; a decode sequence carrying its params."""
    params = parse_kv_transfer_params({"do_remote_decode": True})
    done = SimpleNamespace(seq_id=1, request_id="r1", finish_reason="length",
                           params=SimpleNamespace(kv_transfer_params=params))
    held, remote = prefill.request_finished(done, [5, 6, 7])
    assert held
    return SimpleNamespace(seq_id=2, request_id="r2", num_prompt_tokens=tokens,
                           params=SimpleNamespace(kv_transfer_params=parse_kv_transfer_params(remote)))


@pytest.fixture
def pairs():
    made = []

    def make(prefill_shape, decode_shape):
        pair = connector("kv_producer", *prefill_shape), connector("kv_consumer", *decode_shape)
        made.extend(pair)
        return pair
    yield make
    for c in made:
        c.shutdown()


@pytest.mark.parametrize("shape", [(2, 1), (1, 2), (2, 2)])
def test_the_same_layout_pulls_every_rank_from_its_peer_rank(pairs, shape):
    prefill, decode = pairs(shape, shape)
    seq = held_prompt(prefill)
    assert decode.get_num_new_matched_tokens(seq, 0) == (39, False)  # all but the last prompt token
    decode.update_state_after_alloc(seq, [10, 11, 12], 39)
    spec = decode.build_connector_meta(None).loads[0]
    ranks = shape[0] * shape[1]
    assert [h["agent_name"] for h in spec.rank_handshakes] == [f"agent-{r}" for r in range(ranks)]
    assert [h["agent_metadata"] for h in spec.rank_handshakes] == [bytes([r]) * 4 for r in range(ranks)]
    assert spec.handshake is spec.rank_handshakes[0] and spec.remote_block_ids == [5, 6, 7]
    assert decode.stats.num_recomputed_prompts == 0


def test_one_rank_engines_keep_a_single_handshake(pairs):
    prefill, decode = pairs((1, 1), (1, 1))
    seq = held_prompt(prefill)
    decode.get_num_new_matched_tokens(seq, 0)
    decode.update_state_after_alloc(seq, [10, 11, 12], 39)
    spec = decode.build_connector_meta(None).loads[0]
    assert spec.rank_handshakes == [] and spec.handshake["agent_name"] == "agent-0"


@pytest.mark.parametrize("prefill_shape, decode_shape, message", [
    ((2, 1), (1, 1), "tensor_parallel_size 2, this decode engine 1"),
    ((1, 1), (2, 1), "tensor_parallel_size 1, this decode engine 2"),
    ((1, 2), (1, 1), "pipeline_parallel_size 2, this decode engine 1"),
])
def test_another_layout_is_refused_at_the_handshake_and_recomputed(pairs, caplog, prefill_shape, decode_shape,
                                                                     message):
    prefill, decode = pairs(prefill_shape, decode_shape)
    seq = held_prompt(prefill)
    assert decode.get_num_new_matched_tokens(seq, 0) == (0, False)  # the prompt is computed here
    assert decode.stats.num_recomputed_prompts == 1 and decode.stats.num_failed_transfers == 1
    assert message in caplog.text
    assert prefill.num_held == 1  # the prefill's timeout frees it: no one pulls


def test_the_side_channel_refuses_a_rank_it_does_not_have(pairs):
    from pagoda.kv_transfer.nixl_connector import SideChannelError, side_channel_request

    prefill, _ = pairs((2, 1), (2, 1))
    assert side_channel_request("127.0.0.1", prefill.port, {"op": "handshake", "rank": 1})["agent_name"] == "agent-1"
    with pytest.raises(SideChannelError, match="ranks 0..1; asked for rank 2"):
        side_channel_request("127.0.0.1", prefill.port, {"op": "handshake", "rank": 2})


def test_a_load_is_done_when_every_rank_read_it():
    record = TransferRecord(0.1, 0.01, 1024, 4)
    rank0 = KVConnectorOutput(finished_recving=[1, 2], transfers=[record, record])
    rank1 = KVConnectorOutput(finished_recving=[1], failed_recving={2: "READ failed"}, transfers=[record])
    merged = KVConnectorOutput.merge([rank0, rank1, None])
    assert merged.finished_recving == [1] and merged.failed_recving == {2: "READ failed"}
    assert len(merged.transfers) == 3  # every rank's READ is measured: stats sum over ranks
    assert not KVConnectorOutput.merge([None, KVConnectorOutput()])
