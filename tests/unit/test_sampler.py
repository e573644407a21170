import pytest
import torch

from pagoda.layers import fused_cpu_ops
from pagoda.sample import sampler as sampler_module
from pagoda.sample.sampler import Sampler, SamplingTensors, apply_top_k_top_p

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True, params=["kernel", "torch"])
def draw(request, monkeypatch):
    """Every test runs on both draws: the CPU kernel (inverse distribution, one uniform a row) where the library
    builds, and the exponential race of the other devices."""
    if request.param == "kernel":
        if not fused_cpu_ops.available():
            pytest.skip("the CPU kernel library is not built here")
    else:
        monkeypatch.setattr(sampler_module.fused_cpu_ops, "usable", lambda x: False)
    return request.param


def tensors(n, vocab, **overrides):
    f = lambda v: torch.full((n,), float(v))  # noqa: E731
    base = dict(
        temperature=f(1.0), top_p=f(1.0), top_k=torch.full((n,), vocab), min_p=f(0.0),
        presence_penalty=f(0.0), frequency_penalty=f(0.0), repetition_penalty=f(1.0),
        prompt_token_ids=None, output_token_ids=None, banned_tokens=[], generators=[None] * n,
        num_logprobs=[None] * n, all_greedy=False, any_top_k=False, any_top_p=False, any_min_p=False,
        any_penalty=False)
    base.update(overrides)
    return SamplingTensors(**base)


def test_greedy_is_argmax():
    logits = torch.randn(4, 50)
    t = tensors(4, 50, temperature=torch.zeros(4), all_greedy=True)
    assert [s.token_id for s in Sampler()(logits, t)] == logits.argmax(-1).tolist()


def test_top_k_only_samples_from_the_k_best():
    torch.manual_seed(0)
    logits = torch.randn(1, 100).repeat(2000, 1)
    t = tensors(2000, 100, top_k=torch.full((2000,), 5), any_top_k=True)
    got = {s.token_id for s in Sampler(torch.Generator().manual_seed(1))(logits, t)}
    assert got == set(logits[0].topk(5).indices.tolist())


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    masked = apply_top_k_top_p(probs.log(), None, torch.tensor([0.75]))
    assert torch.isfinite(masked).tolist() == [[True, True, False, False]]
    masked = apply_top_k_top_p(probs.log(), None, torch.tensor([0.85]))
    assert torch.isfinite(masked).tolist() == [[True, True, True, False]]


def test_sampling_frequencies_follow_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    n = 20000
    t = tensors(n, 3)
    tokens = [s.token_id for s in Sampler(torch.Generator().manual_seed(0))(probs.log().repeat(n, 1), t)]
    freq = torch.bincount(torch.tensor(tokens), minlength=3).float() / n
    assert torch.allclose(freq, probs, atol=0.02)


def test_min_p_drops_tokens_below_the_scaled_max():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 3000
    t = tensors(n, 4, min_p=torch.full((n,), 0.2), any_min_p=True)
    tokens = {s.token_id for s in Sampler(torch.Generator().manual_seed(0))(probs.log().repeat(n, 1), t)}
    assert tokens == {0, 1, 2}  # 0.05 < 0.2 * 0.5


def test_per_row_seed_reproduces_regardless_of_batch():
    logits = torch.randn(1, 64)
    def draw(batch):
        gens = [torch.Generator().manual_seed(42)] + [None] * (batch - 1)
        t = tensors(batch, 64, generators=gens)
        return Sampler(torch.Generator().manual_seed(batch))(logits.repeat(batch, 1), t)[0].token_id
    assert len({draw(1), draw(3), draw(7)}) == 1


def test_penalties_and_banned_tokens():
    logits = torch.tensor([[2.0, 1.9, -1.0, 0.0]])
    prompt = torch.tensor([[4, 4]])  # padding only
    output = torch.tensor([[0, 0]])
    t = tensors(1, 4, temperature=torch.zeros(1), all_greedy=True, any_penalty=True,
                frequency_penalty=torch.tensor([0.1]), prompt_token_ids=prompt, output_token_ids=output)
    assert Sampler()(logits, t)[0].token_id == 1  # 2.0 - 2 * 0.1 < 1.9
    t = tensors(1, 4, temperature=torch.zeros(1), all_greedy=True, banned_tokens=[(0, 0)])
    assert Sampler()(logits, t)[0].token_id == 1
    t = tensors(1, 4, temperature=torch.zeros(1), all_greedy=True, any_penalty=True,
                repetition_penalty=torch.tensor([1.2]), prompt_token_ids=torch.tensor([[0]]),
                output_token_ids=torch.tensor([[4]]))
    assert Sampler()(logits, t)[0].token_id == 1  # 2.0 / 1.2 < 1.9


def test_logprobs_are_raw_log_softmax_with_rank():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    t = tensors(1, 3, temperature=torch.zeros(1), all_greedy=True, num_logprobs=[2])
    s = Sampler()(logits, t)[0]
    lp = torch.log_softmax(logits, -1)[0]
    assert s.token_id == 1 and s.rank == 1
    assert s.top_token_ids == [1, 2]
    assert s.logprob == pytest.approx(lp[1].item())
    assert s.top_logprobs == pytest.approx([lp[1].item(), lp[2].item()])


def test_temperature_scales_the_distribution_over_a_large_vocabulary():
    # a 49152-token vocabulary (many of the kernel's chunks), most of its mass on a few tokens spread through it
    vocab, n = 49152, 6000
    logits = torch.full((vocab,), -30.0)
    heavy = torch.tensor([7, 300, 20000, 49151])
    logits[heavy] = torch.tensor([2.0, 1.0, 0.5, 0.0])
    temperature = 0.7
    t = tensors(n, vocab, temperature=torch.full((n,), temperature))
    tokens = torch.tensor([s.token_id for s in Sampler(torch.Generator().manual_seed(3))(logits.repeat(n, 1), t)])
    expected = torch.softmax(logits / temperature, -1)[heavy]
    freq = torch.stack([(tokens == h).float().mean() for h in heavy])
    assert torch.allclose(freq, expected, atol=0.02), (freq, expected)
    assert set(tokens.tolist()) <= set(heavy.tolist())  # the rest has mass e^-43 each: never drawn


def test_greedy_rows_beside_sampled_ones_take_their_argmax():
    torch.manual_seed(1)
    logits = torch.randn(6, 1000)
    temperature = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    t = tensors(6, 1000, temperature=temperature)
    tokens = [s.token_id for s in Sampler(torch.Generator().manual_seed(0))(logits, t)]
    assert tokens[0::2] == logits[0::2].argmax(-1).tolist()


def test_top_k_with_min_p_and_temperature_only_draws_what_all_three_keep():
    probs = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    n = 4000
    t = tensors(n, 5, temperature=torch.full((n,), 0.9), top_k=torch.full((n,), 4), any_top_k=True,
                min_p=torch.full((n,), 0.3), any_min_p=True)
    tokens = {s.token_id for s in Sampler(torch.Generator().manual_seed(0))(probs.log().repeat(n, 1), t)}
    # top-k drops token 4; at temperature 0.9 token 3's probability is under 0.3 x the largest, token 2's is not
    assert tokens == {0, 1, 2}


def test_a_row_with_one_token_left_always_draws_it():
    logits = torch.full((3, 700), float("-inf"))
    logits[0, 0] = logits[1, 350] = logits[2, 699] = 1.0
    t = tensors(3, 700)
    for seed in range(5):
        assert [s.token_id for s in Sampler(torch.Generator().manual_seed(seed))(logits, t)] == [0, 350, 699]
