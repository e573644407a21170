"""The throughput bench's FLOPs per decode step (its MFU's numerator): a mixture of experts counts the experts a
token is routed to, not all of them."""

import pytest
from transformers import AutoConfig

from pagoda.bench.throughput import decode_flops

pytestmark = pytest.mark.unit

SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, vocab_size=100,
             num_hidden_layers=2)
ATTENTION = 64 * (4 + 2 * 2) * 16 + 4 * 16 * 64  # q, k, v and o weights of a layer


def test_a_dense_model_counts_every_weight():
    llama = AutoConfig.for_model("llama", architectures=["LlamaForCausalLM"], **SHAPE)
    params = 2 * (ATTENTION + 3 * 64 * 96) + 100 * 64
    assert decode_flops(llama, [10]) == 2 * params + 4 * 2 * 4 * 16 * 10


@pytest.mark.parametrize("num_experts", [4, 8])
def test_a_mixture_of_experts_counts_the_router_and_top_k_experts(num_experts):
    mixtral = AutoConfig.for_model("mixtral", architectures=["MixtralForCausalLM"], num_local_experts=num_experts,
                                   num_experts_per_tok=2, sliding_window=None, **SHAPE)
    params = 2 * (ATTENTION + 64 * num_experts + 2 * 3 * 64 * 96) + 100 * 64
    assert decode_flops(mixtral, [10, 20]) == 2 * 2 * params + 4 * 2 * 4 * 16 * 30


def test_qwen2_moe_counts_its_shared_expert_and_its_dense_layers():
    qwen = AutoConfig.for_model("qwen2_moe", architectures=["Qwen2MoeForCausalLM"], num_experts=8,
                                num_experts_per_tok=4, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                mlp_only_layers=[1], **SHAPE)
    sparse = 64 * 8 + 4 * 3 * 64 * 32 + 3 * 64 * 48 + 64
    params = 2 * ATTENTION + sparse + 3 * 64 * 96 + 100 * 64
    assert decode_flops(qwen, [1]) == 2 * params + 4 * 2 * 4 * 16 * 1
