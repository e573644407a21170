"""The default pipeline partition balances compute: the last stage runs the LM head too."""

import pytest

from pagoda.distributed.parallel_state import default_layer_partition

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("num_layers,pp_size,lm_head_layers,expected", [
    (30, 1, 8.0, [30]),
    (30, 4, 0.0, [7, 7, 8, 8]),  # no LM head cost: even, the remainder to the later stages
    (31, 2, 0.0, [15, 16]),
    (30, 2, 8.0, [19, 11]),  # a head with 8 layers' weights, run on every row
    (30, 2, 2.7, [16, 14]),  # SmolLM2-135M's: 8 layers' weights, on about a third of the rows
    (30, 4, 8.0, [9, 9, 10, 2]),
    (80, 2, 1.2, [41, 39]),  # Llama-3-70B: the LM head is about one layer
    (2, 2, 0.5, [1, 1]),
    (3, 3, 50.0, [1, 1, 1]),  # every stage keeps a layer, however large the head
])
def test_default_partition(num_layers, pp_size, lm_head_layers, expected):
    counts = default_layer_partition(num_layers, pp_size, lm_head_layers)
    assert counts == expected and sum(counts) == num_layers


def test_smollm2_head_is_counted_at_the_rows_it_multiplies():
    """The head runs on one row per sequence, the layers on every token: SmolLM2-135M's 49k x 576 head
    has about 8 layers' weights but costs about 2.7 layers a step, so PP=2 splits 16/14, not 19/11."""
    from types import SimpleNamespace

    from pagoda.models.llama import lm_head_cost_in_layers

    smollm2 = SimpleNamespace(hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                              intermediate_size=1536, vocab_size=49152)
    cost = lm_head_cost_in_layers(smollm2)
    assert 2.5 < cost < 3.0
    assert default_layer_partition(30, 2, cost) == [16, 14]
