"""The default pipeline partition balances compute: the last stage runs the LM head too."""

import pytest

from pagoda.distributed.parallel_state import default_layer_partition

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("num_layers,pp_size,lm_head_layers,expected", [
    (30, 1, 8.0, [30]),
    (30, 4, 0.0, [7, 7, 8, 8]),  # no LM head cost: even, the remainder to the later stages
    (31, 2, 0.0, [15, 16]),
    (30, 2, 8.0, [19, 11]),  # SmolLM2-135M: a 49k x 576 LM head costs about 8 of its layers
    (30, 4, 8.0, [9, 9, 10, 2]),
    (80, 2, 1.2, [41, 39]),  # Llama-3-70B: the LM head is about one layer
    (2, 2, 0.5, [1, 1]),
    (3, 3, 50.0, [1, 1, 1]),  # every stage keeps a layer, however large the head
])
def test_default_partition(num_layers, pp_size, lm_head_layers, expected):
    counts = default_layer_partition(num_layers, pp_size, lm_head_layers)
    assert counts == expected and sum(counts) == num_layers
