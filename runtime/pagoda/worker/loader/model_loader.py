"""Find a model directory, check its config is one we run exactly, and stream its weights."""

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from tqdm.auto import tqdm

from pagoda.config.quantization import QuantizationConfig, checkpoint_quantization
from pagoda.layers.quantization import kv_scales, methods
from pagoda.models.family import ACTIVATIONS, moe_config, rope_parameters
from pagoda.models.registry import SUPPORTED_ARCHITECTURES, unsupported_architecture_message

logger = logging.getLogger(__name__)

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")


def resolve_model_path(model: str | None, revision: str | None = None) -> str:
    """The local directory of a model argument: the default model, a directory, a .gguf file (converted
    once), or a Hub id `ORG/NAME` (downloaded once into the Hub cache, see pagoda.worker.loader.hub)."""
    from pagoda.worker.loader import hub
    from pagoda.worker.loader.default_model import default_model_path, ensure_converted

    if model is None:
        if revision is not None:
            raise ValueError("revision needs a Hub model id (ORG/NAME), not the default model")
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        if hub.is_repo_id(model):
            return hub.download_model(model, revision, check_config=load_hf_config)
        raise ValueError(f"model path {model!r} does not exist (Pagoda loads local Hugging Face "
                         "directories, .gguf files, or Hub ids ORG/NAME)")
    if revision is not None:
        raise ValueError(f"revision {revision!r} applies to Hub model ids, but {model!r} is a local path")
    if path.is_file() and path.suffix == ".gguf":
        return str(ensure_converted(path, path.stem))
    if not (path / "config.json").is_file():
        raise ValueError(f"model path {model!r} has no config.json: not a Hugging Face model directory")
    return str(path)


def load_hf_config(path: str, trust_remote_code: bool = False):
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers raises many kinds for a bad config
        raise ValueError(f"cannot read {path}/config.json: {e}") from e
    check_supported(config)
    return config


def check_supported(config) -> None:
    archs = getattr(config, "architectures", None) or []
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(unsupported_architecture_message(archs))
    for layer_type in sorted(set(getattr(config, "layer_types", None) or [None])):
        rope_type = rope_parameters(config, layer_type)["rope_type"]
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope scaling {rope_type!r}: Pagoda supports {', '.join(SUPPORTED_ROPE_TYPES)}")
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise ValueError(f"unsupported hidden_act {act!r}: Pagoda supports {', '.join(ACTIVATIONS)}")
    if getattr(config, "mlp_bias", False):
        raise ValueError("unsupported option mlp_bias=true")
    checkpoint = checkpoint_quantization(config)  # raises for a quantized format Pagoda cannot run
    if checkpoint is not None and checkpoint.method in ("gptq", "awq") and moe_config(config) is not None:
        raise ValueError(f"{checkpoint.method.upper()} checkpoints of mixture-of-experts models ({archs[0]}) are not "
                         f"supported yet: Pagoda reads {checkpoint.method.upper()} tensors of dense layers, not "
                         "experts'. Serve the unquantized checkpoint with quantization='int8' or 'int4' (online, "
                         "experts included): see docs/models.md#supported-architectures")
    partial = getattr(config, "partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ValueError(f"unsupported partial_rotary_factor {partial}: Pagoda supports 1.0")


def safetensors_files(path: str) -> list[str]:
    index = Path(path) / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise ValueError(f"corrupt {index}: {e}") from e
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (Path(path) / f).exists()]
        if missing:
            raise ValueError(f"{index} names files that are missing: {', '.join(missing)}")
        return [os.path.join(path, f) for f in files]
    files = sorted(str(p) for p in Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {path}")
    return files


def iterate_weights(path: str, desc: str = "Loading weights") -> Iterator[tuple[str, object]]:
    """(name, lazy slice) for every tensor; layers read only the rows or columns they own."""
    from safetensors import SafetensorError, safe_open

    files = safetensors_files(path)
    total = 0
    handles = []
    for file in files:
        try:
            handle = safe_open(file, framework="pt")
        except (SafetensorError, OSError) as e:
            raise ValueError(f"cannot read weights file {file}: {e}") from e
        handles.append((file, handle))
        total += len(handle.keys())
    with tqdm(total=total, desc=desc, unit="tensor", disable=total < 2 or None) as bar:
        for file, handle in handles:
            for name in handle.keys():
                try:
                    yield name, handle.get_slice(name)
                except (SafetensorError, OSError) as e:
                    raise ValueError(f"cannot read tensor {name} from {file}: {e}") from e
                bar.update(1)


def load_weights(model, path: str, quantization: QuantizationConfig | None = None) -> None:
    """Copy every checkpoint tensor into the parameter (shard) that owns it; fail on gaps and extras.
    With ``quantization``, the linear layers take the scheme's tensors and are quantized once loaded."""
    method = methods.attach(model, quantization) if quantization else None
    convert = getattr(method, "convert_checkpoint_tensor", None)
    params = dict(model.named_parameters())
    shards_expected = {name: 3 if "qkv_proj" in name else 2 if "gate_up_proj" in name else 1
                       for name in params}
    shards_loaded: dict[str, int] = dict.fromkeys(params, 0)
    found_kv_scales: dict[str, dict[str, float]] = {}  # attention module -> {"k" | "v" | "kv": scale}
    tensors = iterate_weights(path)
    if hasattr(model, "checkpoint_tensors"):  # a family whose checkpoint layout differs (gpt-oss's experts)
        tensors = model.checkpoint_tensors(tensors)
    for ckpt_name, tensor in tensors:
        kv_scale = kv_scales.checkpoint_kv_scale(ckpt_name)
        if kv_scale is not None:  # an fp8 KV cache's scales (used only when kv_cache_dtype is fp8)
            found_kv_scales.setdefault(kv_scale[0], {})[kv_scale[1]] = kv_scales.scale_value(tensor)
            continue
        mapped = model.checkpoint_to_param(ckpt_name)
        if mapped is None:
            continue
        name, shard = mapped
        if convert is not None:  # into the layer's layout; None: nothing to load (checked, e.g. g_idx)
            converted = convert(ckpt_name, tensor)
            if converted is None:
                continue
            tensor = converted[1]
        param = params.get(name)
        gptq = quantization is not None and quantization.method == "gptq"
        if param is None and gptq and name.endswith(".bias") and not tensor[:].any():
            continue  # GPTQ writers save a zero bias for every layer, also where the model has none
        if param is None:
            raise ValueError(f"checkpoint tensor {ckpt_name} matches no parameter of "
                             f"{model.config.architectures[0]} with this config.json")
        try:
            param.weight_loader(param, tensor, shard)
        except ValueError as e:
            raise ValueError(f"{ckpt_name}: {e}") from None
        shards_loaded[name] += len(shard) if isinstance(shard, tuple) else 1  # a fused tensor holds several
    missing = [n for n, want in shards_expected.items() if shards_loaded[n] < want]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"checkpoint in {path} is missing weights for {len(missing)} parameters: {shown}")
    if found_kv_scales:
        logger.info("KV-cache scales from the checkpoint for %d attention layers",
                    kv_scales.assign_checkpoint_scales(model, found_kv_scales))
    if method is not None:
        methods.process_after_loading(model)


def build_model(hf_config, path: str, quantization, dtype, device, pp_layer_partition=None,
                expert_parallel: bool = False):
    """The model of `hf_config` on `device` in `dtype`, with the checkpoint at `path` loaded (and its
    weights packed for the CPU kernels where they apply), in eval mode."""
    import torch

    from pagoda.layers.packed_weights import pack_weights, packing_supported
    from pagoda.models import get_model_class

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model_class = get_model_class(hf_config.architectures[0])
            model = model_class(hf_config, pp_layer_partition, expert_parallel=expert_parallel)
    finally:
        torch.set_default_dtype(previous)
    load_weights(model, path, quantization)
    model.eval()
    if packing_supported(device, dtype):
        pack_weights(model)
    return model
