"""Runs of layers one compiled body serves: a model scans each run instead of unrolling its layers.

A run is `(start, stop)`, the layers `start .. stop - 1`. Two neighbouring layers are in one run when everything that
decides their computation is equal: the model's structure (its parameters' shapes, attention window, RoPE; the
model's business) and what the step does with them (their sized plans up to the layer index, and what their rules
read of the index, `Rule.layer_key`; `kvjax.step.Step.layer_runs`). A model joins the two with `split`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

Runs = tuple[tuple[int, int], ...]


def runs_of(keys: Sequence[Hashable]) -> Runs:
    """The runs of equal neighbouring `keys` (one per layer)."""
    out, start = [], 0
    for i in range(1, len(keys) + 1):
        if i == len(keys) or keys[i] != keys[start]:
            out.append((start, i))
            start = i
    return tuple(out)


def split(*runs: Runs) -> Runs:
    """The coarsest runs inside every one of `runs` (each over the same layers): a run ends wherever one of them
    ends."""
    stops = sorted({stop for r in runs for _, stop in r})
    return tuple(zip([0, *stops[:-1]], stops))


def every_layer(num_layers: int) -> Runs:
    """Each layer its own run (an unrolled forward)."""
    return tuple((i, i + 1) for i in range(num_layers))


__all__ = ["Runs", "every_layer", "runs_of", "split"]
