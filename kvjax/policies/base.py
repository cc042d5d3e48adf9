"""The cache-policy interface.

A policy is a frozen (hence hashable) dataclass, passed to `jax.jit` as a static
argument. Its methods are pure functions of arrays; `layer` is a Python int, so
a policy may behave differently per layer (MAT's shallow/deep split, PyramidKV's
per-layer budgets) and still trace to static shapes.

The model calls, per layer:

* prefill: full attention over the prompt, then
  `cache = policy.prefill(layer, empty_cache, k, v, pos, stats)`;
* decode: `cache = policy.step(layer, cache, k, v, pos)` inserts the new token
  (evicting if needed), attention runs over the cache (the new token included),
  then `cache = policy.observe(layer, cache, stats)` lets the policy update its
  per-slot statistics from what attention returned (nothing is recomputed).

`stats_needed(layer)` names the statistics attention must return; the base
policy needs none, so attention computes none.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Literal

from jaxtyping import Array, Float, Int

from kvjax.cache import LayerCache

PositionMode = Literal["absolute", "rolling"]
POSITION_MODES = ("absolute", "rolling")


@dataclasses.dataclass(frozen=True)
class Policy(abc.ABC):
    """Base class: subclasses are frozen dataclasses with a `positions` field."""

    positions: PositionMode = "absolute"

    def __post_init__(self):
        if self.positions not in POSITION_MODES:
            raise ValueError(f"positions={self.positions!r}; expected one of {POSITION_MODES}")

    @abc.abstractmethod
    def capacity(self, layer: int, max_len: int) -> int:
        """Static slot count of `layer` for sequences of at most `max_len` tokens."""

    @abc.abstractmethod
    def prefill(
        self,
        layer: int,
        cache: LayerCache,
        k: Float[Array, "b kvh t d"],
        v: Float[Array, "b kvh t d"],
        pos: Int[Array, "b t"],
        stats: dict[str, Array],
    ) -> LayerCache:
        """Compresses a whole (left-padded, pos = -1 on padding) prompt into `cache`."""

    @abc.abstractmethod
    def step(
        self,
        layer: int,
        cache: LayerCache,
        k: Float[Array, "b kvh d"],
        v: Float[Array, "b kvh d"],
        pos: Int[Array, "b"],
    ) -> LayerCache:
        """Inserts one token per row, evicting if full. Rows with pos < 0 are unchanged."""

    def observe(self, layer: int, cache: LayerCache, stats: dict[str, Array]) -> LayerCache:
        """Updates per-slot statistics after the decode attention (default: nothing)."""
        del layer, stats
        return cache

    def stats_needed(self, layer: int) -> frozenset[str]:
        del layer
        return frozenset()

    def describe(self) -> str:
        fields = ", ".join(
            f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self) if f.repr
        )
        return f"{type(self).__name__}({fields})"
