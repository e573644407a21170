import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from checkpoints import write_tiny_model  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    made: dict[tuple, Path] = {}

    def make(arch: str = "llama", **kwargs) -> Path:
        key = (arch, tuple(sorted(kwargs.items())))
        if key not in made:
            name = "-".join([arch] + [f"{k}{v}" for k, v in sorted(kwargs.items())])
            made[key] = write_tiny_model(tmp_path_factory.mktemp(name), arch, **kwargs)
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")
