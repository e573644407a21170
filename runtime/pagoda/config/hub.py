"""Models named by Hugging Face Hub id (`ORG/NAME`): downloaded through `huggingface_hub`, as vLLM does.

Only the files the engine reads are fetched: config, generation config, tokenizer files, chat template,
and the safetensors weights (the shards an index names, when there is an index, so a repository that
also ships `consolidated.safetensors` is not downloaded twice). Files sit at the repository's top level;
subfolders (`original/`, `onnx/`, ...) are never fetched.

`huggingface_hub` honours `HF_TOKEN`, `HF_ENDPOINT`, `HF_HOME` / `HF_HUB_CACHE` and `HF_HUB_OFFLINE`
itself; offline, a model is served from the cache or refused with a message saying so. Every failure
becomes a `ValueError` naming the model and revision, so the CLI prints one line and `LLM()` raises.
"""

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
# What `pagoda.worker.loader.model_loader` and transformers' tokenizer / generation-config loaders read.
METADATA_FILES = [
    "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "vocab.json", "merges.txt",
    "chat_template.jinja", "chat_template.json",
    INDEX_FILE,
]
_SUBFOLDERS = ["*/*"]  # fnmatch's `*` crosses `/`: this pattern is every file below the top level


def is_repo_id(model: str) -> bool:
    """`ORG/NAME` or `NAME` as the Hub spells ids; anything path-like (`/x`, `./x`, `~/x`, `a/b/c`) is not."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if model.startswith(("/", ".", "~")) or model.endswith("/"):
        return False
    try:
        validate_repo_id(model)
    except HFValidationError:
        return False
    return True


def download_model(repo_id: str, revision: str | None = None, local_dir: str | None = None,
                   check_config: Callable[[str], object] | None = None) -> str:
    """Fetch the engine's files of `repo_id` at `revision` (default: the main branch) and return the
    local directory: a snapshot in the Hub cache, or `local_dir`. Files already there are not fetched
    again, and a transfer cut mid-file resumes with an HTTP Range request. `check_config(directory)`
    runs once the config is there, before the weights: it refuses a model the engine cannot run
    without downloading gigabytes first."""
    from huggingface_hub import snapshot_download

    def fetch(patterns: list[str]) -> str:
        with _clear_errors(repo_id, revision):
            return snapshot_download(repo_id, revision=revision, local_dir=local_dir,
                                     allow_patterns=patterns, ignore_patterns=_SUBFOLDERS)

    logger.info("model %s: a Hub id, fetching what %s lacks", _named(repo_id, revision), local_dir or "the Hub cache")
    directory = Path(fetch(METADATA_FILES))  # small files first: the index says which shards to get
    if not (directory / "config.json").is_file():
        raise ValueError(f"model {_named(repo_id, revision)} on the Hub has no config.json: "
                         "not a Hugging Face transformers model")
    if check_config is not None:
        try:
            check_config(str(directory))
        except ValueError as e:
            raise ValueError(f"model {_named(repo_id, revision)}: {e}") from None
    directory = Path(fetch(METADATA_FILES + _weight_patterns(directory)))
    if not any(directory.glob("*.safetensors")):
        raise ValueError(f"model {_named(repo_id, revision)} on the Hub has no .safetensors weights "
                         "(Pagoda does not load .bin or .pt checkpoints)")
    return str(directory)


def _weight_patterns(directory: Path) -> list[str]:
    index = directory / INDEX_FILE
    if not index.is_file():
        return ["*.safetensors"]
    try:
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, AttributeError) as e:
        raise ValueError(f"corrupt {INDEX_FILE} in {directory}: {e}") from None


def _named(repo_id: str, revision: str | None) -> str:
    return f"{repo_id!r}" + (f" (revision {revision!r})" if revision else "")


@contextmanager
def _clear_errors(repo_id: str, revision: str | None) -> Iterator[None]:
    """Turns huggingface_hub's exceptions into one-line ValueErrors that say what to do."""
    try:
        yield
    except Exception as error:
        message = _explain(error, repo_id, revision)
        if message is None:
            raise
        raise ValueError(message) from None


def _explain(error: Exception, repo_id: str, revision: str | None) -> str | None:
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    name, hub = _named(repo_id, revision), constants.ENDPOINT
    if isinstance(error, RevisionNotFoundError):
        return f"revision {revision or 'main'!r} of model {repo_id!r} not found on the Hub ({hub})"
    if isinstance(error, GatedRepoError):
        return (f"model {repo_id!r} is gated on the Hub ({hub}): accept its terms there and set HF_TOKEN "
                "to a token of that account")
    if isinstance(error, RepositoryNotFoundError):
        return (f"model {repo_id!r} is neither a local directory nor a model on the Hub ({hub}); "
                "if it is private, set HF_TOKEN")
    if isinstance(error, LocalEntryNotFoundError):
        why = "offline mode is on (HF_HUB_OFFLINE)" if constants.HF_HUB_OFFLINE else f"the Hub ({hub}) cannot be reached"
        return f"model {name} is not (completely) in the local Hub cache and {why}"
    if isinstance(error, HfHubHTTPError):
        return f"downloading model {name} from the Hub ({hub}) failed: {str(error).splitlines()[0]}"
    if isinstance(error, OSError) or type(error).__module__.split(".")[0] in ("httpx", "httpx2"):
        # disk full, or the network failing mid-transfer after huggingface_hub's own retries
        return f"downloading model {name} failed: {type(error).__name__}: {error}"
    return None


ADAPTER_FILES = ["adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"]


def download_adapter(repo_id: str, revision: str | None = None) -> str:
    """A PEFT adapter's files (config and weights) from the Hub -> its local directory in the Hub cache."""
    from huggingface_hub import snapshot_download

    with _clear_errors(repo_id, revision):
        return snapshot_download(repo_id, revision=revision, allow_patterns=ADAPTER_FILES,
                                 ignore_patterns=_SUBFOLDERS)
