"""The model runner's pooling of embedding requests: last token or mean over chunked prefills, a resumed
(recomputed) prompt not counted twice, normalization, and state dropped when the sequence finishes."""

import pytest
import torch

from pagoda.core.scheduler_output import ScheduledSeq, SchedulerOutput
from pagoda.pooling_params import PoolingParams
from pagoda.sample.pooler import Pooler

pytestmark = pytest.mark.unit

HIDDEN = torch.randn(10, 6, generator=torch.Generator().manual_seed(0))  # one prompt's final hidden states


def chunk(start: int, end: int, last: bool, reset: bool = False, pooling: PoolingParams | None = None,
          seq_id: int = 7) -> ScheduledSeq:
    return ScheduledSeq(seq_id=seq_id, num_new_tokens=end - start, num_computed_tokens=start, new_token_ids=[],
                        block_ids_start=0, block_ids=[], num_samples=1 if last else 0, reset=reset,
                        request_params=pooling)


def run(pooler: Pooler, chunks: list[tuple[int, int]], params: PoolingParams, other_rows: int = 0) -> list[float]:
    """Feed the prompt chunk by chunk, each batched after `other_rows` rows of another (generating) seq."""
    result = {}
    for i, (start, end) in enumerate(chunks):
        other = ScheduledSeq(seq_id=1, num_new_tokens=other_rows, num_computed_tokens=0, new_token_ids=[],
                             block_ids_start=0, block_ids=[], num_samples=1)
        out = SchedulerOutput(scheduled=[other, chunk(start, end, end == len(HIDDEN), reset=i == 0,
                                                      pooling=params if i == 0 else None)])
        pooler.update(out)
        hidden = torch.cat([torch.zeros(other_rows, HIDDEN.shape[1]), HIDDEN[start:end]])
        result = pooler.pool(out, hidden)
        if end < len(HIDDEN):
            assert result == {}
    return result[7]


@pytest.mark.parametrize("chunks", [[(0, 10)], [(0, 4), (4, 10)], [(0, 3), (3, 6), (6, 9), (9, 10)]])
def test_last_and_mean_pooling_over_chunks(chunks):
    last = run(Pooler(), chunks, PoolingParams("last", normalize=False), other_rows=2)
    assert torch.allclose(torch.tensor(last), HIDDEN[-1])
    mean = run(Pooler(), chunks, PoolingParams("mean", normalize=False), other_rows=3)
    assert torch.allclose(torch.tensor(mean), HIDDEN.mean(0), atol=1e-6)
    unit = run(Pooler(), chunks, PoolingParams("mean"))
    assert torch.allclose(torch.tensor(unit), torch.nn.functional.normalize(HIDDEN.mean(0), dim=0), atol=1e-6)


def test_a_recomputed_prompt_is_not_summed_twice():
    pooler = Pooler()
    params = PoolingParams("mean", normalize=False)
    first = SchedulerOutput(scheduled=[chunk(0, 4, False, reset=True, pooling=params)])
    pooler.update(first)
    pooler.pool(first, HIDDEN[0:4])
    # preempted (recompute): the runner is reset and the prompt runs again from position 0
    again = SchedulerOutput(scheduled=[chunk(0, 10, True, reset=True, pooling=params)])
    pooler.update(again)
    vector = pooler.pool(again, HIDDEN)[7]
    assert torch.allclose(torch.tensor(vector), HIDDEN.mean(0), atol=1e-6)
    pooler.update(SchedulerOutput(finished_seq_ids=[7]))
    assert not pooler.is_pooling(7)


def test_pooling_params_are_checked():
    with pytest.raises(ValueError, match="pooling_type"):
        PoolingParams("max")
