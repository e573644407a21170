"""The fused-MoE grouped GEMM (kernels.fused_moe) against a per-token torch reference, and the grouped CPU path
of layers.moe against the same reference: routing, top-k, renormalisation, experts held by another rank."""

import pytest
import torch
import torch.nn.functional as F
from paged_batch import TOLERANCES

from pagoda.kernels.fused_moe import BLOCK_M, align_by_expert, fused_experts
from pagoda.layers.activation import silu_and_mul
from pagoda.layers.moe import MoEOptions, SparseMoE, route

pytestmark = pytest.mark.kernels


def per_token_reference(x, w13, w2, ids, weights, first_expert=0):
    """Each token, each choice, one expert at a time: the definition, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t].tolist(), weights[t].tolist()):
            local = e - first_expert
            if not 0 <= local < w13.shape[0]:
                continue
            gate, up = (w13[local].double() @ x[t].double()).chunk(2)
            out[t] += w * (w2[local].double() @ (F.silu(gate) * up))
    return out


def test_align_by_expert_groups_and_pads_every_expert():
    ids = torch.tensor([[3, 0], [0, 3], [1, 3], [3, 2], [-1, 5]])  # -1 and 5: experts another rank holds
    a = align_by_expert(ids, 4, block_m=4)
    assert a.tokens_per_expert.tolist() == [2, 1, 1, 4]
    assert a.block_experts.tolist() == [0, 1, 2, 3]
    pairs = a.sorted_pairs.view(4, 4)
    assert pairs[0].tolist() == [1, 2, 10, 10] and pairs[3].tolist() == [0, 3, 5, 6]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_tokens", [1, 5, 37])
def test_fused_experts_match_per_token_reference(device, dtype, num_tokens):
    g = torch.Generator().manual_seed(num_tokens)
    experts, hidden, inter, top_k = 6, 48, 40, 2  # sizes that are not tile multiples
    x = torch.randn(num_tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    weights, ids = route(torch.randn(num_tokens, experts, generator=g), MoEOptions(experts, top_k, inter, True))
    expected = per_token_reference(x.to(dtype), w13.to(dtype), w2.to(dtype), ids, weights)
    got = fused_experts(x.to(dtype).to(device), w13.to(dtype).to(device), w2.to(dtype).to(device),
                        ids.to(device), weights.to(device), silu_and_mul)
    torch.testing.assert_close(got.double().cpu(), expected, **TOLERANCES[dtype])


def test_fused_experts_skip_experts_another_rank_holds(device):
    """Expert parallelism: this rank holds experts 2 and 3 of 4 (local ids 0, 1); the other choices add nothing."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * BLOCK_M + 3, 32, generator=g)
    w13, w2 = torch.randn(2, 64, 32, generator=g) / 6, torch.randn(2, 32, 32, generator=g) / 6
    weights, ids = route(torch.randn(x.shape[0], 4, generator=g), MoEOptions(4, 2, 32, False))
    got = fused_experts(x.to(device), w13.to(device), w2.to(device), (ids - 2).to(device), weights.to(device),
                        silu_and_mul)
    torch.testing.assert_close(got.double().cpu(), per_token_reference(x, w13, w2, ids, weights, 2),
                               **TOLERANCES[torch.float32])


def test_routing_follows_the_config():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    probs = logits.softmax(-1)[0]
    weights, ids = route(logits, MoEOptions(4, 2, 8, norm_topk_prob=False))
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(weights[0], probs[:2])  # no renormalisation where the model has none
    weights, _ = route(logits, MoEOptions(4, 2, 8, norm_topk_prob=True))
    torch.testing.assert_close(weights[0], probs[:2] / probs[:2].sum())
    weights, _ = route(logits, MoEOptions(4, 2, 8, norm_topk_prob=False, scoring="sigmoid"))
    torch.testing.assert_close(weights[0], logits[0, :2].sigmoid())


def test_grouped_cpu_path_matches_per_token_reference():
    g = torch.Generator().manual_seed(2)
    options = MoEOptions(5, 3, 24, norm_topk_prob=False)
    moe = SparseMoE(16, options, "silu")
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / 4)
    x = torch.randn(11, 16, generator=g)
    weights, ids = route(moe.gate(x), options)
    w13 = torch.stack([e.gate_up_proj.weight for e in moe.experts])
    w2 = torch.stack([e.down_proj.weight for e in moe.experts])
    torch.testing.assert_close(moe(x).double(), per_token_reference(x, w13, w2, ids, weights), atol=1e-5, rtol=1e-5)
    assert moe.load.take() == torch.bincount(ids.flatten(), minlength=5).tolist()


def test_engine_with_triton_kernels_equals_torch_on_qwen2_moe(tiny_model_factory, device):
    """The fused-MoE kernel inside the engine (attention_backend triton: the interpreter on CPU) gives the
    grouped path's greedy tokens, shared expert and a dense layer included."""
    from pagoda import LLM, SamplingParams

    path = tiny_model_factory("qwen2-moe")
    prompts = ["Continuous batching lets new requests join between steps.", "Hello, my name is"]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens = []
    for backend in ("torch", "triton"):
        llm = LLM(str(path), dtype="float32", attention_backend=backend, device=device, kv_cache_memory=0.01)
        tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert tokens[0] == tokens[1]
