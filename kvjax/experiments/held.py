"""The KV bytes a policy really holds, as the suites record and show it.

A record's `kv_held` is the share of the full cache's KV bytes its compressed prompt held
(`kvjax.Generation.held_fraction`: `kvjax.cache.held_bytes` over `kvjax.cache.full_bytes`), whatever the
policy's own ratio means. Records written before the field existed lack it: a table shows their cell blank
(`mean_held` is None), never a value recomputed or taken as zero.
"""

from __future__ import annotations

import numpy as np


def kv_held(fraction) -> float:
    """A record's `kv_held`: the share of the full cache's KV bytes its compressed prompt held
    (`kvjax.Generation.held_fraction`), rounded."""
    return round(float(fraction), 6)


def mean_held(records: list[dict]) -> float | None:
    """The mean `kv_held` of `records`; None if any lacks it (a record written before the field: shown blank,
    not recomputed)."""
    held = [r.get("kv_held") for r in records]
    return None if not held or None in held else round(float(np.mean(held)), 4)


def shown_held(value: float | None) -> str:
    """A table's "KV held" cell: four decimals, blank for None (records from before the field)."""
    return "" if value is None else f"{value:.4f}"
