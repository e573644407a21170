"""Sliding-window and soft-capped attention (Mistral, Gemma 2/3): the torch backend against a dense reference
written here, and the Triton kernels (mixed batch, split-K decode) against the torch backend."""

import pytest
import torch
from paged_batch import assert_close, make_batch

from pagoda.attention import torch_backend
from pagoda.kernels.flash_decode import flash_decode
from pagoda.kernels.paged_attention import paged_attention

pytestmark = pytest.mark.kernels

# decodes far past the window, a prefill chunk straddling it, a prompt shorter than it, one token
PAIRS = [(1, 300), (40, 150), (9, 9), (1, 1)]


def dense_reference(batch, window, softcap):
    """Every sequence's whole context gathered, an explicit causal (and window) mask, float64."""
    md, (key_cache, value_cache) = batch.metadata, batch.kv_cache.double()
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    out, start = [], 0
    for i, (q_len, s_len) in enumerate(zip(md.query_lens_cpu, md.seq_lens_cpu)):
        blocks = md.block_tables[i, : -(-s_len // block_size)].long()
        k = key_cache[blocks].flatten(0, 1)[:s_len]  # [S, H_kv, D]
        v = value_cache[blocks].flatten(0, 1)[:s_len]
        q = batch.query[start : start + q_len].double()  # [q, H, D]
        group = q.shape[1] // num_kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * batch.scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(s_len - q_len, s_len)[:, None]
        k_pos = torch.arange(s_len)[None, :]
        visible = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
        scores = scores.masked_fill(~visible, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        start += q_len
    return torch.cat(out)


@pytest.mark.parametrize("window,softcap", [(64, None), (None, 5.0), (17, 2.0), (1, None)])
def test_torch_backend_against_dense_reference(window, softcap):
    batch = make_batch(PAIRS, 4, 2, 32, 16, seed=3)
    got = torch_backend.paged_attention(batch.query, batch.kv_cache, batch.metadata, batch.scale,
                                        sliding_window=window, logit_softcap=softcap)
    torch.testing.assert_close(got.double(), dense_reference(batch, window, softcap), atol=1e-5, rtol=1e-5)


def test_window_longer_than_every_context_is_full_attention():
    batch = make_batch(PAIRS, 4, 2, 32, 16, seed=4)
    full = torch_backend.paged_attention_in_torch(batch.query, batch.kv_cache, batch.metadata, batch.scale)
    windowed = torch_backend.paged_attention(batch.query, batch.kv_cache, batch.metadata, batch.scale,
                                             sliding_window=4096)
    torch.testing.assert_close(windowed, full, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("window,softcap", [(64, None), (None, 5.0), (17, 2.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mixed_batch_kernel(device, window, softcap, dtype):
    batch = make_batch(PAIRS, 4, 2, 32, 16, dtype=dtype, device=device, seed=5)
    md = batch.metadata
    got = paged_attention(batch.query, batch.kv_cache[0], batch.kv_cache[1], md.block_tables, md.query_start_loc,
                          md.seq_lens, md.max_query_len, batch.scale, sliding_window=window, logit_softcap=softcap)
    expected = torch_backend.windowed_attention(batch.query.float(), batch.kv_cache.float(), md, batch.scale,
                                                window, softcap)
    assert_close(got, expected, dtype)


@pytest.mark.parametrize("window,softcap", [(100, None), (None, 5.0), (70, 2.0)])
def test_split_k_decode(device, window, softcap):
    # 300 positions in partitions of 64: with a window of 70 or 100 the first partitions hold nothing visible
    batch = make_batch([(1, 300), (1, 130), (1, 7)], 4, 2, 32, 16, device=device, seed=6)
    md = batch.metadata
    got = flash_decode(batch.query, batch.kv_cache[0], batch.kv_cache[1], md.block_tables, md.seq_lens,
                       md.max_seq_len, batch.scale, partition_size=64, sliding_window=window, logit_softcap=softcap)
    expected = torch_backend.windowed_attention(batch.query, batch.kv_cache, md, batch.scale, window, softcap)
    assert_close(got, expected, torch.float32)


def test_bad_window_is_refused(device):
    batch = make_batch([(1, 5)], 4, 2, 32, 16, device=device)
    md = batch.metadata
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention(batch.query, batch.kv_cache[0], batch.kv_cache[1], md.block_tables, md.query_start_loc,
                        md.seq_lens, md.max_query_len, batch.scale, sliding_window=0)


def test_engine_with_triton_kernels_equals_torch_on_gemma2(tiny_model_factory, device):
    """Gemma 2's local (16-token window) and global layers, soft-capped, through the Triton backend: the same
    greedy tokens as the torch backend, prompts chunked past the window."""
    from pagoda import LLM, SamplingParams

    path = tiny_model_factory("gemma2")
    prompts = ["Continuous batching lets new requests join between steps. " * 2, "Hello, my name is"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = []
    for backend in ("torch", "triton"):
        llm = LLM(str(path), dtype="float32", attention_backend=backend, device=device, kv_cache_memory=0.01,
                  max_num_batched_tokens=16)
        tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert tokens[0] == tokens[1]


def test_engine_with_triton_kernels_equals_torch_while_blocks_behind_the_window_are_freed(
        tiny_model_factory, device, monkeypatch):
    """Every layer of mistral-window slides (16 tokens): 6 KV blocks serve a prompt of about 150 tokens, so
    blocks behind the window are freed and reused while sequences run and their table entries are null.
    Triton's mixed-batch and split-K decode kernels read only the window: the torch backend's tokens."""
    from pagoda import LLM, SamplingParams
    from pagoda.attention import triton_backend

    monkeypatch.setattr(triton_backend, "SPLIT_K_PARTITION_SIZE", 64)
    monkeypatch.setattr(triton_backend, "SPLIT_K_PROGRAMS_PER_SM", 10**6)
    monkeypatch.setattr(triton_backend, "ONE_PASS_PROGRAMS_PER_SM", 10**6)
    split_k_calls = []
    real = triton_backend._flash_decode.flash_decode
    monkeypatch.setattr(triton_backend._flash_decode, "flash_decode",
                        lambda *a, **kw: split_k_calls.append(kw) or real(*a, **kw))
    path = tiny_model_factory("mistral-window")
    prompts = ["Continuous batching lets new requests join between steps. " * 4, "Hello, my name is"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = []
    for backend in ("torch", "triton"):
        llm = LLM(str(path), dtype="float32", attention_backend=backend, device=device, max_model_len=256,
                  kv_cache_memory=6 * 8192 / 2**30, max_num_batched_tokens=16)
        assert llm.engine.num_blocks == 6
        assert len(llm.get_tokenizer()(prompts[0]).input_ids) > 6 * 16
        tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        llm.engine.block_manager.check_no_leaks()
    assert tokens[0] == tokens[1]
    assert split_k_calls and split_k_calls[0]["sliding_window"] == 16
