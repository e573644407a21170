"""Does a live object still carry every field the operator sets? Pure, no cluster.

The operator owns the fields its manifests set, as server-side apply's field manager does; fields
that other controllers or users add (defaults, extra annotations, extra env entries) are theirs.
So a live object needs re-applying when one of the operator's fields is missing or differs: a
`kubectl scale` of a group's StatefulSet, an edited image, label or selector. Lists whose items carry
a `name` (containers, env, ports, volumes) are matched by name, as server-side apply merges them;
other lists must match item by item."""

from __future__ import annotations

from typing import Any


def covers(live: Any, wanted: Any) -> bool:
    """True when `live` holds every field of `wanted` with the same value."""
    if isinstance(wanted, dict):
        if not wanted:
            return live is None or isinstance(live, dict)  # the API server may drop an empty object
        return isinstance(live, dict) and all(covers(live.get(k), v) for k, v in wanted.items())
    if isinstance(wanted, list):
        if not isinstance(live, list):
            return not wanted and live is None
        if wanted and all(isinstance(item, dict) and "name" in item for item in wanted):
            by_name = {item.get("name"): item for item in live if isinstance(item, dict)}
            return all(covers(by_name.get(item["name"]), item) for item in wanted)
        return len(live) == len(wanted) and all(covers(lv, wv) for lv, wv in zip(live, wanted, strict=True))
    if wanted is None:
        return live is None
    # 8 and "8" are the same quantity once the API server has stored them.
    return live is not None and str(live) == str(wanted)
