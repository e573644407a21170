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


# Each folder is a tier: its tests carry the tier's marker whatever the file says, so no file can fall out of
# `make test-fast` (-m unit) or any other tier by forgetting its pytestmark.
TIER_OF_FOLDER = {"unit": "unit", "model": "model", "kernels": "kernels", "distributed": "distributed",
                  "server": "server", "operator": "operator", "hub": "server", "router": "server",
                  "e2e": "e2e", "gpu": "gpu"}


def pytest_collection_modifyitems(config, items):
    tests_dir = Path(__file__).parent
    for item in items:
        relative = Path(item.fspath).relative_to(tests_dir)
        if len(relative.parts) < 2:
            continue  # tests/test_lint.py and the like mark themselves
        tier = TIER_OF_FOLDER.get(relative.parts[0])
        if tier is None:
            raise pytest.UsageError(f"tests/{relative.parts[0]}/ is not a tier: add it to TIER_OF_FOLDER in "
                                    "tests/conftest.py")
        item.add_marker(getattr(pytest.mark, tier))
