"""P/D over NIXL with tensor parallelism on both sides (gloo, local processes): each decode rank READs its own
shard (its KV heads) from the prefill's same rank; the greedy tokens equal a single engine's, every rank's READ
is counted (the stats sum over ranks), and both engines' blocks are back to free. A prefill of another TP size is
refused at the handshake, naming both sizes, and the decode engine computes the prompt itself."""

import logging

import pytest

pytest.importorskip("nixl_cu12")

from test_pd_disaggregation import (  # noqa: E402
    COMMON,
    CONSUMER,
    PROMPTS,
    PrefillProcess,
    _decode,
    greedy_reference,
)

from pagoda.entrypoints.llm import LLM  # noqa: E402

pytestmark = pytest.mark.distributed

TP2 = dict(tensor_parallel_size=2)


@pytest.fixture(scope="module")
def single_engine_tokens(tiny_llama_dir):
    return greedy_reference(tiny_llama_dir)


@pytest.fixture(scope="module")
def prefill_tp2(tiny_llama_dir):
    process = PrefillProcess(tiny_llama_dir, **TP2)
    yield process
    process.close()


def test_tp2_decode_pulls_each_rank_from_the_tp2_prefill(tiny_llama_dir, prefill_tp2, single_engine_tokens):
    params = prefill_tp2.ask(op="prefill", prompts=PROMPTS)
    assert all(p["tp_size"] == 2 and p["remote_block_ids"] for p in params)
    with LLM(str(tiny_llama_dir), kv_transfer_config=CONSUMER, enable_prefix_caching=False, **COMMON, **TP2) as d:
        stats = d.engine.core.kv_connector.stats
        assert _decode(d, params) == single_engine_tokens
        # every prompt's blocks came over NIXL to both ranks: one READ per rank, none recomputed
        assert stats.num_transfers == 2 * len(PROMPTS) and stats.bytes_transferred > 0
        assert stats.num_recomputed_prompts == 0 and stats.num_failed_transfers == 0
        # rank 0's own READs moved half the bytes: each rank read its own shard (its KV heads)
        assert 2 * d.engine.executor.runner.kv_connector.stats.bytes_transferred == stats.bytes_transferred
        assert d.engine.block_manager.num_free_blocks == d.engine.num_blocks
    blocks = prefill_tp2.ask(op="blocks")  # "pulled" once both ranks read: the prefill freed every block
    assert blocks["held"] == 0 and blocks["free"] == blocks["total"]


def test_a_tp1_decode_refuses_the_tp2_prefill_and_recomputes(tiny_llama_dir, prefill_tp2, single_engine_tokens,
                                                            caplog):
    params = prefill_tp2.ask(op="prefill", prompts=PROMPTS[:1])
    with caplog.at_level(logging.WARNING, logger="pagoda.kv_transfer.nixl_connector"), \
            LLM(str(tiny_llama_dir), kv_transfer_config=CONSUMER, enable_prefix_caching=False, **COMMON) as d:
        stats = d.engine.core.kv_connector.stats
        assert _decode(d, params) == single_engine_tokens[:1]
        assert stats.num_recomputed_prompts == 1 and stats.num_transfers == 0
        assert d.engine.block_manager.num_free_blocks == d.engine.num_blocks
    assert "tensor_parallel_size 2, this decode engine 1" in caplog.text
    # no one pulled: the prefill holds the blocks until its abort timeout (VLLM_NIXL_ABORT_REQUEST_TIMEOUT)
    assert prefill_tp2.ask(op="blocks")["held"] == 1


@pytest.mark.parametrize("parallel", [
    dict(pipeline_parallel_size=2),
    pytest.param(dict(tensor_parallel_size=2, pipeline_parallel_size=2), marks=pytest.mark.heavy),
], ids=["pp2", "tp2xpp2"])
def test_pipeline_decode_pulls_each_stage_from_the_same_prefill_stage(tiny_llama_dir, single_engine_tokens, parallel):
    """Pipeline parallelism: each stage's ranks READ their own layers from the prefill's same stage; the load is
    done once the last stage's READ is (the first stage's output comes down the pipeline with the schedule)."""
    ranks = parallel.get("tensor_parallel_size", 1) * parallel["pipeline_parallel_size"]
    prefill = PrefillProcess(tiny_llama_dir, **parallel)
    try:
        params = prefill.ask(op="prefill", prompts=PROMPTS)
        with LLM(str(tiny_llama_dir), kv_transfer_config=CONSUMER, enable_prefix_caching=False, **COMMON,
                 **parallel) as d:
            stats = d.engine.core.kv_connector.stats
            assert _decode(d, params) == single_engine_tokens
            assert stats.num_transfers == ranks * len(PROMPTS) and stats.num_recomputed_prompts == 0
            assert ranks * d.engine.executor.runner.kv_connector.stats.bytes_transferred == stats.bytes_transferred
            assert d.engine.block_manager.num_free_blocks == d.engine.num_blocks
        blocks = prefill.ask(op="blocks")
        assert blocks["held"] == 0 and blocks["free"] == blocks["total"]
    finally:
        prefill.close()
