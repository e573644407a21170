"""PEFT LoRA adapters on disk: a directory with adapter_config.json and adapter_model.safetensors (or .bin).

check_adapter (the engine, before a request is queued) reads the config and the tensors' names and shapes
and refuses what the engine cannot apply, naming it; load_adapter (a worker, when a step needs the adapter)
reads the tensors into {module: (A, B * scaling)}."""

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from pagoda.errors import InvalidParam
from pagoda.models.family import moe_config

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# the checkpoint's projections an adapter may target, by their PEFT (Hugging Face) names
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>A|B)(?:\.[^.]+)?\.weight$")
_MODULE = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?P<block>self_attn|mlp)\.(?P<target>[a-z_]+)$")
# a mixture of experts' modules (Mixtral's block_sparse_moe, the others' mlp.experts / mlp.shared_expert, the router)
_EXPERT_MODULE = re.compile(r"\.(block_sparse_moe|experts|shared_expert|shared_expert_gate)\.|\.mlp\.gate$")


def _bad(message: str) -> InvalidParam:
    return InvalidParam("lora_request", message)


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    alpha: float
    use_rslora: bool = False
    rank_pattern: dict = field(default_factory=dict)
    alpha_pattern: dict = field(default_factory=dict)

    def scaling(self, module: str, rank: int) -> float:
        """PEFT's scaling of a module's delta: alpha / r (alpha / sqrt(r) with rsLoRA), patterns first."""
        alpha = _pattern_value(self.alpha_pattern, module, self.alpha)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def _pattern_value(patterns: dict, module: str, default):
    for key, value in patterns.items():  # PEFT's match: the pattern ends the module's name
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_config(path: str) -> AdapterConfig:
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise _bad(f"{path}: no {CONFIG_FILE}; a LoRA adapter is a PEFT directory ({CONFIG_FILE} and "
                   f"{' or '.join(WEIGHT_FILES)})")
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise _bad(f"{file}: not readable JSON: {e}") from None
    if raw.get("peft_type", "LORA") != "LORA":
        raise _bad(f"{path}: peft_type {raw.get('peft_type')!r} is not supported; only LORA adapters are")
    if raw.get("modules_to_save"):
        raise _bad(f"{path}: modules_to_save {raw['modules_to_save']!r} is not supported (the adapter replaces "
                   "whole modules); only LoRA deltas on " + ", ".join(SUPPORTED_TARGETS) + " are")
    for key, what in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out (Conv1D layers)"),
                      ("lora_bias", "lora_bias"), ("layer_replication", "layer_replication")):
        if raw.get(key):
            raise _bad(f"{path}: {what} is not supported")
    if raw.get("bias", "none") != "none":
        raise _bad(f"{path}: bias {raw['bias']!r} is not supported; only bias 'none' is")
    rank, alpha = raw.get("r"), raw.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float):
        raise _bad(f"{path}: {CONFIG_FILE} needs an integer r >= 1 and a number lora_alpha; got r={rank!r}, "
                   f"lora_alpha={alpha!r}")
    return AdapterConfig(rank, float(alpha), bool(raw.get("use_rslora")), dict(raw.get("rank_pattern") or {}),
                         dict(raw.get("alpha_pattern") or {}))


def weight_file(path: str) -> Path:
    for name in WEIGHT_FILES:
        if (Path(path) / name).is_file():
            return Path(path) / name
    raise _bad(f"{path}: no adapter weights ({' or '.join(WEIGHT_FILES)})")


def _tensor_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    if file.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(file), framework="pt") as f:
            return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118
    return {key: tuple(t.shape) for key, t in _read_bin(file).items()}


def _read_bin(file: Path) -> dict:
    import torch

    return torch.load(str(file), map_location="cpu", weights_only=True)


def expected_shapes(hf_config) -> dict[str, tuple[int, int]]:
    """Each target's [out, in] in the base checkpoint."""
    hidden, heads, kv_heads = hf_config.hidden_size, hf_config.num_attention_heads, hf_config.num_key_value_heads
    head_size = getattr(hf_config, "head_dim", None) or hidden // heads
    inter = hf_config.intermediate_size
    return {"q_proj": (heads * head_size, hidden), "k_proj": (kv_heads * head_size, hidden),
            "v_proj": (kv_heads * head_size, hidden), "o_proj": (hidden, heads * head_size),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}


@dataclass(frozen=True)
class AdapterInfo:
    path: str
    max_rank: int
    modules: tuple[str, ...]  # e.g. model.layers.0.self_attn.q_proj


def check_adapter(path: str, hf_config, max_lora_rank: int) -> AdapterInfo:
    """Everything the engine checks of an adapter before its first request runs; InvalidParam naming what."""
    read_config(path)
    shapes = _tensor_shapes(weight_file(path))
    expected = expected_shapes(hf_config)
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    for key, shape in shapes.items():
        match = _KEY.match(key)
        if match is None:
            raise _bad(f"{path}: tensor {key!r} is not a LoRA A/B weight of a supported module (supported: "
                       f"{', '.join(SUPPORTED_TARGETS)})")
        pairs.setdefault(match["module"], {})[match["ab"]] = shape
    if not pairs:
        raise _bad(f"{path}: the adapter holds no LoRA weights")
    max_rank = 0
    moe = moe_config(hf_config)
    for module, ab in pairs.items():
        if _EXPERT_MODULE.search(module):
            raise _bad(f"{path}: target module {module!r} is part of a mixture of experts; LoRA on experts is not "
                       "supported (adapters may target q/k/v/o_proj, and gate/up/down_proj of dense MLP layers)")
        m = _MODULE.match(module)
        if m is None or m["target"] not in SUPPORTED_TARGETS:
            raise _bad(f"{path}: target module {module!r} is not supported; LoRA applies to "
                       f"{', '.join(SUPPORTED_TARGETS)} of the decoder layers")
        if int(m["layer"]) >= hf_config.num_hidden_layers:
            raise _bad(f"{path}: {module}: the model has {hf_config.num_hidden_layers} layers")
        if m["block"] == "mlp" and moe is not None and moe.sparse_layers[int(m["layer"])]:
            raise _bad(f"{path}: target module {module!r}: layer {m['layer']}'s MLP is a mixture of experts; LoRA "
                       "on experts is not supported (adapters may target q/k/v/o_proj there)")
        if set(ab) != {"A", "B"}:
            raise _bad(f"{path}: {module} has lora_{'A' if 'A' in ab else 'B'} without its pair")
        out, inp = expected[m["target"]]
        rank = ab["A"][0]
        if len(ab["A"]) != 2 or len(ab["B"]) != 2 or ab["A"][1] != inp or ab["B"][0] != out or ab["B"][1] != rank:
            raise _bad(f"{path}: {module}: lora_A {list(ab['A'])} and lora_B {list(ab['B'])} do not fit the "
                       f"base model's [{out}, {inp}] projection")
        if rank > max_lora_rank:
            raise _bad(f"{path}: {module} has rank {rank}, above max_lora_rank={max_lora_rank}; raise "
                       "max_lora_rank (--max-lora-rank)")
        max_rank = max(max_rank, rank)
    return AdapterInfo(str(path), max_rank, tuple(sorted(pairs)))


def load_adapter(path: str) -> dict[str, tuple]:
    """{module (e.g. model.layers.0.self_attn.q_proj): (A [r, in], B [out, r] * scaling)} in float32, on the
    host. The adapter passed check_adapter in the engine."""
    import torch

    config = read_config(path)
    file = weight_file(path)
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        tensors = load_file(str(file))
    else:
        tensors = _read_bin(file)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise _bad(f"{path}: tensor {key!r} is not a LoRA A/B weight")
        pairs.setdefault(match["module"], {})[match["ab"]] = tensor.float()
    out = {}
    for module, ab in pairs.items():
        a, b = ab["A"], ab["B"]
        out[module] = (a.contiguous(), (b * config.scaling(module, a.shape[0])).contiguous())
    return out
