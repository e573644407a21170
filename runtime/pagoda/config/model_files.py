"""A model's files and what its config.json says: the directory of a model argument (the default model, a
local directory, a .gguf file converted once, a Hub id downloaded once) and its config, checked to be one
Pagoda runs exactly. Torch-free: the configuration resolves a model with it before anything loads."""

from pathlib import Path

from pagoda.config.architectures import (
    ACTIVATIONS,
    MOE_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    rope_parameters,
    unsupported_architecture_message,
)
from pagoda.config.quantization import checkpoint_quantization
from pagoda.errors import InvalidParam

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")


def resolve_model_path(model: str | None, revision: str | None = None) -> str:
    """The local directory of a model argument: the default model, a directory, a .gguf file (converted
    once), or a Hub id `ORG/NAME` (downloaded once into the Hub cache, see pagoda.config.hub)."""
    from pagoda.config import hub
    from pagoda.config.default_model import default_model_path, ensure_converted

    if model is None:
        if revision is not None:
            raise InvalidParam("revision", "revision needs a Hub model id (ORG/NAME), not the default model")
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        if hub.is_repo_id(model):
            return hub.download_model(model, revision, check_config=load_hf_config)
        raise InvalidParam("model", f"model path {model!r} does not exist (Pagoda loads local Hugging Face "
                                    "directories, .gguf files, or Hub ids ORG/NAME)")
    if revision is not None:
        raise InvalidParam("revision",
                           f"revision {revision!r} applies to Hub model ids, but {model!r} is a local path")
    if path.is_file() and path.suffix == ".gguf":
        return str(ensure_converted(path, path.stem))
    if not (path / "config.json").is_file():
        raise InvalidParam("model",
                           f"model path {model!r} has no config.json: not a Hugging Face model directory")
    return str(path)


def load_hf_config(path: str, trust_remote_code: bool = False):
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers raises many kinds for a bad config
        raise InvalidParam("model", f"cannot read {path}/config.json: {e}") from e
    check_supported(config)
    return config


def check_supported(config) -> None:
    archs = getattr(config, "architectures", None) or []
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise InvalidParam("model", unsupported_architecture_message(archs))
    for layer_type in sorted(set(getattr(config, "layer_types", None) or [None])):
        rope_type = rope_parameters(config, layer_type)["rope_type"]
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise InvalidParam("model", f"unsupported rope scaling {rope_type!r}: Pagoda supports "
                                        f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise InvalidParam("model", f"unsupported hidden_act {act!r}: Pagoda supports {', '.join(ACTIVATIONS)}")
    if getattr(config, "mlp_bias", False):
        raise InvalidParam("model", "unsupported option mlp_bias=true")
    checkpoint = checkpoint_quantization(config)  # raises for a quantized format Pagoda cannot run
    if checkpoint is not None and checkpoint.method in ("gptq", "awq") and archs[0] in MOE_ARCHITECTURES:
        raise InvalidParam("model", f"{checkpoint.method.upper()} checkpoints of mixture-of-experts models "
                                    f"({archs[0]}) are not supported yet: Pagoda reads {checkpoint.method.upper()} "
                                    "tensors of dense layers, not experts'. Serve the unquantized checkpoint with "
                                    "quantization='int8' or 'int4' (online, experts included): see "
                                    "docs/models.md#supported-architectures")
    partial = getattr(config, "partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise InvalidParam("model", f"unsupported partial_rotary_factor {partial}: Pagoda supports 1.0")
