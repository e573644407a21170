"""bfloat16 on CPU: matmul weights packed for our AVX512_BF16 kernel or for oneDNN give what the plain weights
give, use no extra memory, and a tied LM head keeps the embedding's plain weight."""

import pytest
import torch
import torch.nn.functional as F

from pagoda import LLM, SamplingParams, platform
from pagoda.layers import bf16_matmul_cpu, packed_weights
from pagoda.layers.linear import ColumnParallelLinear, RowParallelLinear

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(not packed_weights.packing_supported(torch.device("cpu"), torch.bfloat16),
                       reason="oneDNN bfloat16 matmuls are not available on this CPU"),
]


# oneDNN's layout only where oneDNN has bfloat16 matmuls (AVX-512 and up): on an AVX2 CPU such as Zen 3 the
# kernel's VNNI layout is the only packing, and a weight it cannot take stays plain.
ONEDNN_BF16 = platform.onednn_bf16_supported()
LAYOUTS = [packed_weights.ONEDNN] * ONEDNN_BF16 + [packed_weights.VNNI] * bf16_matmul_cpu.available()


@pytest.fixture(params=LAYOUTS)
def layout(request, monkeypatch):
    if request.param == packed_weights.ONEDNN:
        monkeypatch.setattr(bf16_matmul_cpu, "available", lambda: False)
    return request.param


@pytest.mark.parametrize("rows", [1, 5, 9, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("in_features, out_features", [(96, 160), (64, 100)])  # 100: a part-filled last block
def test_packed_layer_matches_plain_matmul(layout, rows, bias, in_features, out_features):
    torch.manual_seed(0)
    layer = ColumnParallelLinear(in_features, out_features, bias=bias).to(torch.bfloat16)
    torch.nn.init.normal_(layer.weight)
    if bias:
        torch.nn.init.normal_(layer.bias)
    weight = layer.weight.detach().clone()
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    expected = F.linear(x, weight, layer.bias)

    packed_weights.pack_weights(layer)

    assert layer.weight is None and layer.packed_weight.layout == layout
    assert layer.packed_weight.data.numel() <= weight.numel() + 31 * in_features  # no more than a padded block
    torch.testing.assert_close(layer(x), expected, atol=0.1, rtol=1.6e-2)
    strided = torch.randn(rows, 2 * in_features, dtype=torch.bfloat16)[:, :in_features]  # rows not contiguous
    torch.testing.assert_close(layer(strided), F.linear(strided, weight, layer.bias), atol=0.1, rtol=1.6e-2)


@pytest.mark.parametrize("rows", [1, 9, 70])
def test_float32_out_gives_the_sums_before_rounding(layout, rows):
    torch.manual_seed(0)
    layer = ColumnParallelLinear(64, 100).to(torch.bfloat16)
    torch.nn.init.normal_(layer.weight)
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    exact = x.float() @ layer.weight.detach().float().t()
    packed_weights.pack_weights(layer)

    wide = packed_weights.linear(x, layer, float32_out=True)

    assert wide.dtype == torch.float32 and wide.shape == (rows, 100)
    if layout == packed_weights.VNNI:  # the kernel's float32 sums: far closer than bfloat16's 8 bits
        torch.testing.assert_close(wide, exact, atol=1e-4, rtol=1e-5)
        assert torch.equal(wide.bfloat16(), layer(x))  # and rounded, exactly the bfloat16 result
    else:  # oneDNN's bfloat16 result, widened
        assert torch.equal(wide, layer(x).float())


@pytest.mark.skipif(not ONEDNN_BF16, reason="oneDNN has no bfloat16 matmul on this CPU")
def test_an_odd_input_size_packs_for_onednn():
    layer = ColumnParallelLinear(97, 64).to(torch.bfloat16)
    torch.nn.init.normal_(layer.weight)
    weight = layer.weight.detach().clone()
    packed_weights.pack_weights(layer)
    x = torch.randn(3, 97, dtype=torch.bfloat16)
    assert layer.packed_weight.layout == packed_weights.ONEDNN
    torch.testing.assert_close(layer(x), F.linear(x, weight), atol=0.1, rtol=1.6e-2)


def top_logprobs(llm: LLM) -> list[dict[int, float]]:
    prompts = [{"prompt_token_ids": ids} for ids in ([5, 9, 14, 3], [7] * 30, list(range(3, 60)))]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, logprobs=5, ignore_eos=True),
                        use_tqdm=False)
    return [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outs]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # untied LM head; tied, with attention bias
def test_engine_packs_its_weights_and_gives_the_plain_logprobs(tiny_model_factory, monkeypatch, layout, arch):
    path = str(tiny_model_factory(arch))
    packed = LLM(path, dtype="bfloat16", kv_cache_memory=0.05)
    model = packed.engine.executor.runner.model
    monkeypatch.setattr("pagoda.layers.packed_weights.packing_supported", lambda device, dtype: False)
    plain = LLM(path, dtype="bfloat16", kv_cache_memory=0.05)
    assert getattr(plain.engine.executor.runner.model.lm_head, "packed_weight", None) is None  # the patch took

    expected, actual = top_logprobs(plain), top_logprobs(packed)

    for want, got in zip(expected, actual):
        shared = want.keys() & got.keys()
        assert len(shared) >= 4, (want, got)
        for token in shared:
            assert got[token] == pytest.approx(want[token], abs=0.05)
    assert all(m.weight is None for m in model.modules() if isinstance(m, RowParallelLinear))
    assert model.lm_head.packed_weight.layout == layout
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == (arch == "qwen2")


@pytest.mark.skipif(not bf16_matmul_cpu.available(), reason="needs the AVX512_BF16 kernel")
def test_the_lm_head_gives_logits_not_rounded_to_bfloat16(tiny_model_factory):
    llm = LLM(str(tiny_model_factory("qwen2")), dtype="bfloat16", kv_cache_memory=0.05)
    model = llm.engine.executor.runner.model
    hidden = torch.randn(3, 64, dtype=torch.bfloat16)

    logits = model.compute_logits(hidden)

    assert logits.dtype == torch.float32
    assert not torch.equal(logits, logits.bfloat16().float())  # bfloat16 logits would tie 1/16 apart
    embedding = model.lm_head.weight  # tied: the plain weight stays for lookups
    torch.testing.assert_close(logits, hidden.float() @ embedding.float().t(), atol=1e-4, rtol=1e-5)
