"""Every rank's fast-path plan, as the engine reports it, and where the ranks differ.

Each rank decides its plan on its own node (`model/fast_paths.py`): on one machine the ranks
decide alike, on a Ray cluster of unlike nodes they may not. The executor collects every
rank's `FastPaths.summary()` from its ready message and passes it through as it is (plain
data, keys this module does not interpret); `rank_plans` makes the engine's view of them:

    {"ranks": [rank 0's summary, rank 1's, ...],
     "ranks_differ": false,
     "differences": [{"key": "paths.int4_kernels.enabled", "values": [true, false]}, ...]}

`GET /v1/models` (`fast_paths`), the `otel_engine_fast_path_info` metric (a `rank` label)
and the crash dump's `engine_config.fast_paths` all show it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

logger = logging.getLogger(__name__)

_MISSING = object()


def rank_plans(summaries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The engine's fast paths: each rank's summary (by rank) and the keys where they differ."""
    found = differences(summaries)
    return {
        "ranks": [dict(summary) for summary in summaries],
        "ranks_differ": bool(found),
        "differences": found,
    }


def differences(summaries: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each key whose value is not the same on every rank, dotted down to the first value
    that is not a mapping (`cpu_isa`, `paths.amx_tiles.reason`), with each rank's value
    (None where a rank has no such key); in the order rank 0 lists its keys."""
    keys = list(dict.fromkeys(key for summary in summaries for key in _leaf_keys(summary)))
    found = []
    for key in keys:
        values = [_lookup(summary, key) for summary in summaries]
        if any(value != values[0] for value in values[1:]):
            shown = [None if value is _MISSING else value for value in values]
            found.append({"key": ".".join(key), "values": shown})
    return found


def collect(summaries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """`rank_plans` of the ranks that just reported ready; when they differ, says so once
    (`kernels.ranks_differ`): the engine then runs a different plan on some rank."""
    plans = rank_plans(summaries)
    if plans["ranks_differ"]:
        logger.warning(
            "kernels.ranks_differ",
            extra={
                "num_ranks": len(summaries),
                "keys": [d["key"] for d in plans["differences"]],
                "differences": plans["differences"],
            },
        )
    return plans


def runs_kernels(plans: Mapping[str, Any] | None) -> bool:
    """Whether rank 0 (whose view of a step a crash dump shows) runs the compiled kernels."""
    ranks = (plans or {}).get("ranks") or [{}]
    paths = ranks[0].get("paths") or {}
    return bool((paths.get("compiled_kernels") or {}).get("enabled"))


def _leaf_keys(value: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for name, item in value.items():
        key = (*prefix, str(name))
        if isinstance(item, Mapping) and item:
            yield from _leaf_keys(item, key)
        else:
            yield key


def _lookup(value: Any, key: tuple[str, ...]) -> Any:
    for name in key:
        if not isinstance(value, Mapping) or name not in value:
            return _MISSING
        value = value[name]
    return value
