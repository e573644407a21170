"""Where Pagoda keeps what it builds once: converted models and compiled kernels."""

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("PAGODA_CACHE_DIR") or Path.home() / ".cache" / "pagoda")
