"""Stream a model's weights and build it (finding its directory and checking its config are
config/model_files.py's)."""

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from tqdm.auto import tqdm

from pagoda.config.quantization import QuantizationConfig
from pagoda.layers.quantization import kv_scales, methods

logger = logging.getLogger(__name__)

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
