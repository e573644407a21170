"""LoRA adapters: greedy tokens equal PeftModel's (float32, the same adapter files peft wrote) for batches
that mix two adapters and the base model, after an adapter is evicted and reloaded, and the prefix cache
never hands one adapter's KV blocks to another."""

import json

import pytest
from checkpoints import peft_greedy, write_lora_adapter

from pagoda import LLM, LoRARequest, SamplingParams
from pagoda.errors import InvalidParam

pytestmark = pytest.mark.model

PROMPTS = [
    "Hello, my name is",
    "The quick brown fox jumps over the lazy dog. Paged attention stores keys and values in blocks",
    "Paris is the capital of",
]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_model_factory, tmp_path_factory):
    """Per architecture: the base model, two adapters (rank 8 on every target; rank 4 on q, v and down) and
    PeftModel's greedy tokens for each prompt under None / a / b."""
    made = {}

    def get(arch):
        if arch not in made:
            base = tiny_model_factory(arch)
            root = tmp_path_factory.mktemp(f"lora-{arch}")
            a = write_lora_adapter(base, root / "a", rank=8, seed=1)
            b = write_lora_adapter(base, root / "b", rank=4, seed=2, targets=("q_proj", "v_proj", "down_proj"))
            reference = {name: peft_greedy(base, path, PROMPTS, MAX_TOKENS)
                         for name, path in (("base", None), ("a", a), ("b", b))}
            assert reference["a"] != reference["base"] and reference["b"] != reference["base"]
            made[arch] = (base, LoRARequest("a", 1, str(a)), LoRARequest("b", 2, str(b)), reference)
        return made[arch]

    return get


def lora_llm(base, **kwargs):
    kwargs.setdefault("kv_cache_memory", 0.02)
    return LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=8, **kwargs)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])  # gemma3: the Python layers, windows
def test_mixed_batch_matches_peft(adapters, arch):
    base, a, b, reference = adapters(arch)
    # every prompt under each adapter and the base model, interleaved, in one generate call
    prompts, loras, expected = [], [], []
    for i, prompt in enumerate(PROMPTS):
        for name, lora in (("a", a), ("base", None), ("b", b)):
            prompts.append(prompt)
            loras.append(lora)
            expected.append(reference[name][i])
    with lora_llm(base, max_loras=2) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
        assert [o.outputs[0].token_ids for o in outs] == expected
        llm.engine.block_manager.check_no_leaks()
        # one adapter for every prompt, chunked prefill mixing prompt chunks and decodes
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=b)
        assert [o.outputs[0].token_ids for o in outs] == reference["b"]


BLOCK_BYTES = 8192  # the tiny llama's KV block of 16 tokens, float32


@pytest.mark.parametrize("engine_kwargs", [
    dict(max_num_batched_tokens=7, speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
    dict(max_model_len=160, kv_cache_memory=10 * BLOCK_BYTES / 2**30, preemption_mode="swap",
         swap_space=64 * BLOCK_BYTES / 2**30),
    dict(max_model_len=160, kv_cache_memory=10 * BLOCK_BYTES / 2**30, preemption_mode="recompute"),
], ids=["chunked-ngram-n2", "preempt-swap", "preempt-recompute"])
def test_mixed_batch_matches_peft_under_engine_features(adapters, engine_kwargs):
    """Chunked prefill with n-gram speculation and n = 2 (forks keep their adapter), and preemption in both
    modes (a resumed sequence brings its adapter back to the runner)."""
    base, a, b, reference = adapters("llama")
    loras = [a, None, b] * len(PROMPTS)
    prompts = [p for p in PROMPTS for _ in range(3)]
    expected = [reference[name][i] for i in range(len(PROMPTS)) for name in ("a", "base", "b")]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=2)
    with lora_llm(base, max_loras=2, **engine_kwargs) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        assert [[c.token_ids for c in o.outputs] for o in outs] == [[e, e] for e in expected]
        stats = llm.engine.get_stats()
        if "preemption_mode" in engine_kwargs:
            assert stats.num_preemptions > 0
        llm.engine.block_manager.check_no_leaks()


def test_evicted_adapter_reloads_and_still_matches(adapters):
    base, a, b, reference = adapters("llama")
    with lora_llm(base, max_loras=1, max_cpu_loras=1) as llm:
        # one slot: the scheduler runs one adapter's sequences at a time, evicting the other between them
        loras = [a, b, None, a, b]
        outs = llm.generate([PROMPTS[0]] * 5, GREEDY, use_tqdm=False, lora_request=loras)
        names = {None: "base", a: "a", b: "b"}
        assert [o.outputs[0].token_ids for o in outs] == [reference[names[x]][0] for x in loras]
        for lora in (a, b, a):  # each call evicts the other adapter from the slot and the host cache
            outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=lora)
            assert [o.outputs[0].token_ids for o in outs] == reference[names[lora]]
        manager = llm.engine.executor.runner.lora
        assert manager.num_loads >= 4  # read from disk again after each eviction
        assert len(manager.host) == 1 and len(manager.slot_of) == 1


def test_prefix_cache_is_keyed_by_adapter(adapters):
    base, a, b, reference = adapters("llama")
    prompt = PROMPTS[1]  # several blocks of 16 tokens
    with lora_llm(base, max_loras=2, block_size=8) as llm:
        def hits():
            return llm.engine.get_stats().prefix_cache_hits

        assert llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=a)[0].outputs[0].token_ids == \
            reference["a"][1]
        before = hits()
        # the same tokens under another adapter and the base model: no block is shared
        assert llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=b)[0].outputs[0].token_ids == \
            reference["b"][1]
        assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == reference["base"][1]
        assert hits() == before
        # the same adapter again: its blocks are reused
        assert llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=b)[0].outputs[0].token_ids == \
            reference["b"][1]
        assert hits() > before


def test_bad_adapters_are_refused_by_name(adapters, tmp_path):
    base, a, b, _ = adapters("llama")
    big = write_lora_adapter(base, tmp_path / "r16", rank=16, seed=3, targets=("q_proj",))
    saved = write_lora_adapter(base, tmp_path / "saved", rank=4, seed=3, targets=("q_proj",),
                               modules_to_save=["lm_head"])
    embed = write_lora_adapter(base, tmp_path / "embed", rank=4, seed=3, targets=("q_proj", "embed_tokens"))
    with lora_llm(base) as llm:
        assert llm.generate(PROMPTS[0], GREEDY, use_tqdm=False, lora_request=a)[0].outputs[0].token_ids

        def refused(lora) -> str:
            with pytest.raises(InvalidParam) as info:
                llm.generate(PROMPTS[0], GREEDY, use_tqdm=False, lora_request=lora)
            assert info.value.param == "lora_request"
            return str(info.value)

        assert "rank 16, above max_lora_rank=8" in refused(LoRARequest("big", 3, str(big)))
        assert "modules_to_save" in refused(LoRARequest("saved", 4, str(saved)))
        assert "embed_tokens" in refused(LoRARequest("embed", 5, str(embed)))
        assert "neither a directory nor a Hub id" in refused(LoRARequest("gone", 6, str(tmp_path / "x" / "y" / "z")))
        assert "already names adapter 'a'" in refused(LoRARequest("other", 1, str(b.lora_path)))
        config = json.loads((big / "adapter_config.json").read_text())
        (tmp_path / "dora").mkdir()
        (tmp_path / "dora" / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
        assert "DoRA" in refused(LoRARequest("dora", 7, str(tmp_path / "dora")))
        # the engine goes on
        assert llm.generate(PROMPTS[0], GREEDY, use_tqdm=False, lora_request=b)[0].outputs[0].token_ids
    with LLM(str(base), dtype="float32", kv_cache_memory=0.02) as plain:
        with pytest.raises(InvalidParam, match="enable_lora=True"):
            plain.generate(PROMPTS[0], GREEDY, use_tqdm=False, lora_request=a)


def test_async_engine_generates_with_adapters(adapters):
    import asyncio

    from pagoda import AsyncEngineArgs, AsyncLLMEngine

    base, a, b, reference = adapters("llama")

    async def run():
        args = AsyncEngineArgs(model=str(base), dtype="float32", kv_cache_memory=0.02, enable_lora=True,
                               max_loras=2, max_lora_rank=8)
        async with AsyncLLMEngine.from_engine_args(args) as engine:
            async def collect(request_id, prompt, lora):
                last = None
                async for out in engine.generate(prompt, GREEDY, request_id, lora_request=lora):
                    last = out
                return last.outputs[0].token_ids

            got = await asyncio.gather(*(collect(f"{name}-{i}", prompt, lora)
                                         for i, prompt in enumerate(PROMPTS)
                                         for name, lora in (("a", a), ("base", None), ("b", b))))
            expected = [reference[name][i] for i in range(len(PROMPTS)) for name in ("a", "base", "b")]
            assert got == expected
            with pytest.raises(InvalidParam, match="neither a directory nor a Hub id"):
                await collect("bad", PROMPTS[0], LoRARequest("bad", 9, "/no/such/adapter"))
            assert engine.is_running

    asyncio.run(asyncio.wait_for(run(), timeout=300))


DECODE_ROWS = [0, -1, 2, 2, 1, -1, 0, 0, 0]
# prefill-sized groups: past AVX2's float32-x threshold (24 rows) and one task's 64 rows, not one run each
PREFILL_ROWS = [0] * 70 + [-1] * 5 + [1] * 30 + [0] * 3 + [1] * 20 + [2]


@pytest.mark.parametrize("row_slots", [DECODE_ROWS, PREFILL_ROWS], ids=["decode", "prefill"])
@pytest.mark.parametrize("max_rank", [8, 5])
def test_packed_bf16_cpu_path_equals_the_torch_path(row_slots, max_rank):
    """bfloat16 on a CPU with bf16_matmul_cpu: every adapter group's shrink and expand in the kernel library's
    lora_add_ (each sub-output's B packed apart, sizes that are not whole 32-column blocks, an odd max rank
    padded to an even one); its deltas equal the float32 torch path's within bfloat16 rounding, base rows and
    the kept rows' path too."""
    import torch

    from pagoda.distributed.parallel_state import single_process_state
    from pagoda.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from pagoda.lora.layers import attach
    from pagoda.lora.ops import RowGroups, add_lora_torch

    class Tiny(torch.nn.Module):
        packed_modules = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

        def __init__(self):
            super().__init__()
            self.model = torch.nn.Module()
            self.model.layers = torch.nn.ModuleList([torch.nn.Module()])
            layer = self.model.layers[0]
            layer.qkv_proj = QKVParallelLinear(64, 16, 4, 2)
            layer.o_proj = RowParallelLinear(64, 64)
            layer.gate_up_proj = MergedColumnParallelLinear(64, [80, 80])
            layer.down_proj = RowParallelLinear(80, 64)

    torch.manual_seed(0)
    with single_process_state():
        rows, layers = attach(Tiny(), 3, max_rank, torch.bfloat16, torch.device("cpu"))
    if any(layer.packed_a is None for layer in layers.values()):
        pytest.skip("bf16_matmul_cpu's kernel does not run on this CPU")
    kept = [i for i in range(len(row_slots)) if i % 3 != 1]  # the last layer's rows past attention
    rows.all = RowGroups.from_row_slots(row_slots, torch.device("cpu"), with_segments=False)
    rows.kept = RowGroups.from_row_slots([row_slots[i] for i in kept], torch.device("cpu"), with_segments=False)
    rows.row_slots = torch.tensor(row_slots, dtype=torch.int32)
    rows.kept_row_slots = torch.tensor([row_slots[i] for i in kept], dtype=torch.int32)
    for layer in layers.values():
        for slot in range(3):
            rank = max(max_rank - 2 * slot, 1)
            weights = {sub.target: (torch.randn(rank, layer.a.shape[2]) * 0.3,
                                    torch.randn(sub.size, rank) * 0.3) for sub in layer.subs}
            layer.set_slot(slot, weights)
        for groups, slots in ((rows.all, row_slots), (rows.kept, [row_slots[i] for i in kept])):
            x = torch.randn(len(slots), layer.a.shape[2]).bfloat16()
            y = torch.randn(len(slots), layer.b.shape[1]).bfloat16()
            expected = add_lora_torch(x.float(), y.float(), layer.a.float(), layer.b.float(), layer.rank,
                                      layer.sub_outputs, groups)
            got = layer.add_delta(x, y.clone())
            torch.testing.assert_close(got.float(), expected, atol=0.15, rtol=0.05)
            base_rows = [i for i, s in enumerate(slots) if s < 0]
            assert torch.equal(got[base_rows], y[base_rows])


def test_lora_add_refuses_what_does_not_fit_with_a_message():
    import torch

    from pagoda.layers import bf16_matmul_cpu
    from pagoda.lora.ops import pack_b

    if not bf16_matmul_cpu.available():
        pytest.skip("no CPU kernel library here")
    a = torch.stack([bf16_matmul_cpu.pack(torch.randn(16, 64).bfloat16())])  # two sub-outputs of rank 8
    b = torch.stack([pack_b(torch.randn(96, 8).bfloat16(), [64, 32])])
    x, y = torch.randn(4, 64).bfloat16(), torch.zeros(4, 96).bfloat16()
    slots = torch.tensor([0, -1, 0, 0], dtype=torch.int32)
    torch.ops.pagoda_cpu.lora_add_(y, x, slots, a, b, [64, 32])
    assert y[1].abs().sum() == 0 and y[0].abs().sum() > 0
    with pytest.raises(RuntimeError, match="sub-outputs' sizes add up to 64"):
        torch.ops.pagoda_cpu.lora_add_(y, x, slots, a, b, [32, 32])
    with pytest.raises(RuntimeError, match="slot 1 past the 1 slots"):
        torch.ops.pagoda_cpu.lora_add_(y, x, torch.tensor([0, 1, -1, -1], dtype=torch.int32), a, b, [64, 32])
    with pytest.raises(RuntimeError, match="4 row slots for 3 rows"):
        torch.ops.pagoda_cpu.lora_add_(y[:3], x[:3], slots, a, b, [64, 32])


def test_an_adapter_that_fails_to_load_fails_its_request_alone(adapters, tmp_path):
    import shutil

    base, a, b, reference = adapters("llama")
    gone = shutil.copytree(a.lora_path, tmp_path / "gone")
    with lora_llm(base, max_loras=2) as llm:
        engine = llm.engine
        engine.add_request("doomed", PROMPTS[0], GREEDY, lora_request=LoRARequest("gone", 7, str(gone)))
        engine.add_request("fine", PROMPTS[0], GREEDY, lora_request=b)
        engine.add_request("base", PROMPTS[0], GREEDY)
        (gone / "adapter_model.safetensors").unlink()  # after the engine's check, before any worker reads it
        finished = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
        assert "could not be loaded" in finished["doomed"].error
        assert finished["fine"].outputs[0].token_ids == reference["b"][0]
        assert finished["base"].outputs[0].token_ids == reference["base"][0]
        engine.block_manager.check_no_leaks()


def test_mixture_of_experts_attention_and_dense_layers_match_peft_experts_refused(tiny_model_factory, tmp_path):
    """Qwen2-MoE (layer 0: experts and a shared expert; layer 1: a dense MLP): an adapter on the attention
    projections and the dense layer's MLP runs == PeftModel; one on an expert's MLP is refused by name."""
    from safetensors.torch import load_file, save_file

    base = tiny_model_factory("qwen2-moe")
    # full module names, not a regex or a bare "gate_proj": peft >= 0.22 reads those as every gate_proj's leaf name,
    # the fused experts' gate_up_proj included
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"] + [f"model.layers.1.mlp.{m}_proj" for m in ("gate", "up", "down")]
    good = write_lora_adapter(base, tmp_path / "good", rank=8, seed=4, targets=targets)
    expected = peft_greedy(base, good, PROMPTS, MAX_TOKENS)
    assert expected != peft_greedy(base, None, PROMPTS, MAX_TOKENS)
    shared = write_lora_adapter(base, tmp_path / "shared", rank=4, seed=5,
                                targets=("q_proj", "model.layers.0.mlp.shared_expert.gate_proj"))
    # the dense layer's MLP deltas renamed onto layer 0, whose MLP is experts (shapes fit the dense MLP)
    (tmp_path / "sparse").mkdir()
    (tmp_path / "sparse" / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    tensors = load_file(str(good / "adapter_model.safetensors"))
    save_file({k.replace("layers.1.mlp", "layers.0.mlp"): v for k, v in tensors.items()},
              str(tmp_path / "sparse" / "adapter_model.safetensors"))
    with lora_llm(base, max_loras=2) as llm:
        adapter = LoRARequest("good", 1, str(good))
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=adapter)
        assert [o.outputs[0].token_ids for o in outs] == expected
        with pytest.raises(InvalidParam, match=r"shared_expert.*mixture of experts"):
            llm.generate(PROMPTS[0], GREEDY, use_tqdm=False, lora_request=LoRARequest("shared", 2, str(shared)))
        with pytest.raises(InvalidParam, match=r"model\.layers\.0\.mlp\.\w+_proj.*layer 0's MLP is a mixture"):
            llm.generate(PROMPTS[0], GREEDY, use_tqdm=False, lora_request=LoRARequest("sparse", 3,
                                                                                        str(tmp_path / "sparse")))
        # the experts never carry a LoRA hook: they see only the rows routed to them
        runner = llm.engine.executor.runner
        assert not [name for name in runner.lora.layers if ".experts." in name or ".shared_expert." in name]


# ----- structured outputs, prompt logprobs and embeddings with adapters, against PeftModel -----

LOGPROB_TOLERANCE = 1e-4  # float32 on both sides; the engine's paged attention sums in another order


@pytest.fixture(scope="module")
def peft_llama(adapters):
    """PeftModel with both llama adapters loaded: (name, token ids) -> its log-softmax at every position, or
    its final hidden states (after the last norm); name "base" runs with the adapters disabled."""
    import contextlib

    import torch
    from checkpoints import load_hf_reference
    from peft import PeftModel

    base, a, b, _ = adapters("llama")
    model = PeftModel.from_pretrained(load_hf_reference(base), a.lora_path, adapter_name="a")
    model.load_adapter(b.lora_path, adapter_name="b")
    model.eval()

    def run(name: str, ids: list[int], hidden: bool = False):
        scope = model.disable_adapter() if name == "base" else contextlib.nullcontext(model.set_adapter(name))
        with torch.no_grad(), scope:
            if hidden:
                return model.base_model.model.model(torch.tensor([ids])).last_hidden_state[0]
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return run


@pytest.fixture(scope="module")
def feature_llm(adapters):
    """One LoRA engine for the tests below: a 16-token step budget, so long prompts prefill in chunks."""
    base, *_ = adapters("llama")
    with lora_llm(base, max_loras=2, max_num_batched_tokens=16, block_size=8) as llm:
        yield llm


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"},
                                           "kind": {"enum": ["cat", "dog", "fox"]}},
          "required": ["name", "ok", "kind"], "additionalProperties": False}
REGEX = r"[a-z]{2,5}-[0-9]{1,3}"
CHOICES = ["Paris", "San Francisco", "Kubernetes"]


def test_structured_outputs_with_adapters_are_valid_and_scored_by_each_adapter(adapters, feature_llm, peft_llama):
    """Guided JSON, regex and choice under adapter a, adapter b and the base model in one batch: every output
    is valid, and each sampled token's logprob (the model's, before the grammar's mask) equals PeftModel's
    under that request's adapter, and differs from the base model's: the adapter ran under the grammar."""
    import re

    import jsonschema

    from pagoda.sampling_params import StructuredOutputsParams

    base, a, b, _ = adapters("llama")
    specs = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=REGEX),
             StructuredOutputsParams(choice=CHOICES)]
    requests = [(spec, name, lora) for spec in specs for name, lora in (("a", a), ("b", b), ("base", None))]
    outs = feature_llm.generate(
        [PROMPTS[0]] * len(requests),
        [SamplingParams(structured_outputs=spec, temperature=0.0, max_tokens=120, logprobs=0) for spec, *_ in requests],
        use_tqdm=False, lora_request=[lora for *_, lora in requests])
    for (spec, name, _), out in zip(requests, outs):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (name, completion)
        if spec.json is not None:
            jsonschema.validate(json.loads(completion.text), SCHEMA)
        elif spec.regex is not None:
            assert re.fullmatch(REGEX, completion.text), completion.text
        else:
            assert completion.text in CHOICES
        ids = out.prompt_token_ids + completion.token_ids
        reference, plain = peft_llama(name, ids), peft_llama("base", ids)
        start = len(out.prompt_token_ids) - 1  # the logits at position p predict token p + 1
        for j, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            assert entry[token].logprob == pytest.approx(float(reference[start + j, token]), abs=LOGPROB_TOLERANCE)
        if name != "base":
            assert (reference[start:-1] - plain[start:-1]).abs().max() > 0.01
    feature_llm.engine.block_manager.check_no_leaks()


def test_prompt_logprobs_with_adapters_equal_peft_log_softmax(adapters, feature_llm, peft_llama):
    """prompt_logprobs=3 for a prompt prefilled in chunks, under a, b and the base model in one batch (and a
    again once its blocks are in the prefix cache): every position's token and top 3 equal PeftModel's
    log-softmax within LOGPROB_TOLERANCE, and the ranks agree."""
    base, a, b, _ = adapters("llama")
    prompt = PROMPTS[1]
    names = [("a", a), ("base", None), ("b", b)]
    params = SamplingParams(max_tokens=1, prompt_logprobs=3)
    outs = feature_llm.generate([prompt] * 3, params, use_tqdm=False, lora_request=[lora for _, lora in names])
    outs += feature_llm.generate(prompt, params, use_tqdm=False, lora_request=a)
    names.append(("a", a))
    assert len(outs[0].prompt_token_ids) > 16  # more than one prefill chunk
    for (name, _), out in zip(names, outs):
        ids = out.prompt_token_ids
        reference = peft_llama(name, ids)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        for position in range(1, len(ids)):
            entry, expected = out.prompt_logprobs[position], reference[position - 1]
            token = ids[position]
            assert entry[token].logprob == pytest.approx(float(expected[token]), abs=LOGPROB_TOLERANCE), (name, position)
            assert entry[token].rank == int((expected > expected[token]).sum()) + 1
            for tid in expected.topk(3).indices.tolist():
                assert entry[tid].logprob == pytest.approx(float(expected[tid]), abs=LOGPROB_TOLERANCE)
    assert outs[0].prompt_logprobs != outs[1].prompt_logprobs != outs[2].prompt_logprobs
    feature_llm.engine.block_manager.check_no_leaks()


@pytest.mark.parametrize("pooling_type", ["last", "mean"])
def test_embeddings_with_adapters_equal_peft_hidden_states(adapters, feature_llm, peft_llama, pooling_type):
    """LLM.embed(lora_request=...): the pooled final hidden states are the adapter's, as PeftModel's, for a
    batch mixing a, b and the base model (the long prompt prefills in chunks)."""
    import torch

    from pagoda import PoolingParams

    base, a, b, _ = adapters("llama")
    names = [(name, lora, prompt) for prompt in PROMPTS[:2] for name, lora in (("a", a), ("base", None), ("b", b))]
    outs = feature_llm.embed([p for *_, p in names], PoolingParams(pooling_type), use_tqdm=False,
                             lora_request=[lora for _, lora, _ in names])
    for (name, _, prompt), out in zip(names, outs):
        hidden = peft_llama(name, out.prompt_token_ids, hidden=True)
        want = torch.nn.functional.normalize(hidden[-1] if pooling_type == "last" else hidden.mean(0), dim=0)
        assert torch.allclose(torch.tensor(out.outputs.embedding), want, atol=1e-5), (name, prompt)
    assert outs[0].outputs.embedding != outs[1].outputs.embedding != outs[2].outputs.embedding
    feature_llm.engine.block_manager.check_no_leaks()
