"""vLLM's `compilation_config`, as far as Pagoda implements it: the batch sizes whose decode step is captured
as a CUDA graph (worker/cuda_graphs.py). Every other key is refused by name."""

import json
import os

from pagoda.errors import InvalidParam

KEYS = ("cudagraph_capture_sizes",)
MAX_DEFAULT_CAPTURE_SIZE = 512  # vLLM's default largest captured batch
# on a CPU, rehearse the graph path with a stand-in capture that replays the recorded forward (tests, the
# GPU check's dry run); a CPU gains nothing from it
STAND_IN_ENV = "PAGODA_CUDA_GRAPH_STAND_IN"


def cuda_graph_stand_in() -> bool:
    return os.environ.get(STAND_IN_ENV, "") not in ("", "0")


def parse_compilation_config(raw) -> dict:
    """A dict or its JSON text (`-O '{...}'`) -> the dict, its keys and values checked; InvalidParam names
    `compilation_config.<key>` (or `compilation_config` for a value that is no object)."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError as e:
            raise InvalidParam("compilation_config", f"compilation_config must be a JSON object; got {raw!r} "
                                                     f"({e})") from None
    if not isinstance(raw, dict):
        raise InvalidParam("compilation_config", f"compilation_config must be a JSON object / dict; got {raw!r}")
    for key in raw:
        if key not in KEYS:
            raise InvalidParam(f"compilation_config.{key}", f"compilation_config.{key} is not supported by Pagoda "
                                                            f"(it implements {', '.join(KEYS)})")
    sizes = raw.get("cudagraph_capture_sizes")
    if sizes is not None:
        if not isinstance(sizes, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1
                                                  for s in sizes):
            raise InvalidParam("compilation_config.cudagraph_capture_sizes",
                               "compilation_config.cudagraph_capture_sizes must be a list of integers >= 1; "
                               f"got {sizes!r}")
    return raw


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's ladder: 1, 2, 4, then every multiple of 8, up to max_num_seqs (at most 512), which is itself
    captured so every decode batch up to it has a graph."""
    top = min(max_num_seqs, MAX_DEFAULT_CAPTURE_SIZE)
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))
    return sorted(set(sizes) | {top})


def capture_sizes(raw, max_num_seqs: int) -> tuple[int, ...]:
    """The sizes to capture: the config's (those above max_num_seqs dropped: no batch reaches them), else the
    default ladder; ascending, without repeats."""
    config = parse_compilation_config(raw) if raw is not None else {}
    sizes = config.get("cudagraph_capture_sizes")
    if sizes is None:
        return tuple(default_capture_sizes(max_num_seqs))
    return tuple(sorted({s for s in sizes if s <= max_num_seqs}))
