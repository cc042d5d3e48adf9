"""Policies whose slot is a pure function of position: sinks + a ring-buffer window.

FullCache, LocalWindow and StreamingLLM are one layout with different
parameters: the first `s` positions live in slots `0..s-1` forever, and
position `p >= s` lives in slot `s + (p - s) % w` of a `w`-slot ring
(recurrentgemma's ring buffer, with StreamingLLM's attention sinks in front).
No scores, no sorting: a decode step is one scatter.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, Int

from kvjax import cache as kvcache
from kvjax.cache import LayerCache
from kvjax.errors import InvalidInput
from kvjax.policies.base import LayerPolicy


def ring_slot(pos: Int[Array, "..."], sinks: int, capacity: int) -> Int[Array, "..."]:
    """Slot of position `pos` in a sinks + ring layout of `capacity` slots."""
    window = capacity - sinks
    return jnp.where(pos < sinks, pos, sinks + (pos - sinks) % window)


def ring_holder(length: Int[Array, "b"], sinks: int, capacity: int) -> Int[Array, "b c"]:
    """Position held by each slot after positions `0..length-1` were written, -1 if none.

    The closed form of writing a prompt token by token with `ring_slot`: a
    window slot holds the latest position that maps to it.
    """
    window = capacity - sinks
    j = jnp.arange(capacity)[None, :]
    length = length[:, None]
    sink_pos = jnp.where(j < length, j, -1)
    last = length - 1 - sinks  # offset of the newest token inside the window sequence
    q = last - jnp.mod(last - (j - sinks), window)
    win_pos = jnp.where((last >= 0) & (q >= 0), sinks + q, -1)
    return jnp.where(j < sinks, sink_pos, win_pos).astype(jnp.int32)


class RingPolicy(LayerPolicy):
    """Shared prefill/step for sinks + ring layouts; subclasses define `_layout`."""

    def _layout(self, max_len: int) -> tuple[int, int]:
        """(sinks, capacity) for sequences of at most `max_len` tokens."""
        raise NotImplementedError

    def capacity(self, layer: int, max_len: int, prompt_len: int = 0) -> int:
        return self._layout(max_len)[1]

    def prefill(self, layer, cache: LayerCache, k, v, pos, stats) -> LayerCache:
        sinks, cap = self._layout_for(cache)
        t = k.shape[2]
        length = jnp.max(pos, axis=1) + 1  # real tokens per row; prompts are left padded
        held = ring_holder(length, sinks, cap)  # [b, c] positions
        src = jnp.where(held >= 0, held + (t - length)[:, None], -1)  # time index of that position
        src = jnp.broadcast_to(src[:, None, :], (k.shape[0], k.shape[1], cap))
        return kvcache.gather_prompt(cache, k, v, pos, src)

    def step(self, layer, cache: LayerCache, k, v, pos) -> LayerCache:
        sinks, cap = self._layout_for(cache)
        slot = jnp.broadcast_to(ring_slot(pos, sinks, cap)[:, None], k.shape[:2])
        return kvcache.write(cache, slot, k, v, pos)

    def _layout_for(self, cache: LayerCache) -> tuple[int, int]:
        # The capacity was fixed by `capacity(layer, max_len)`; sinks never exceed it.
        sinks = min(self._sinks(), cache.capacity - 1) if cache.capacity > 1 else 0
        return sinks, cache.capacity

    def _sinks(self) -> int:
        return 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class FullCache(RingPolicy):
    """Keeps every token: capacity = the longest sequence, slot = position."""

    def _layout(self, max_len):
        return 0, max_len

    def with_window(self, window):
        # Everything a sliding-window model can still attend to: a `window`-slot ring buffer.
        return LocalWindow(window=window, positions=self.positions, prefill_mode=self.prefill_mode)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LocalWindow(RingPolicy):
    """Keeps the `window` most recent tokens (the current one included)."""

    window: int = 256

    def __post_init__(self):
        super().__post_init__()
        if self.window < 1:
            raise InvalidInput(f"LocalWindow: window={self.window} must be >= 1")

    def _layout(self, max_len):
        return 0, min(self.window, max_len)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamingLLM(RingPolicy):
    """StreamingLLM (Xiao et al. 2024): `sinks` initial tokens + the `budget - sinks` most recent.

    Use `positions="rolling"` for the paper's setting beyond the training
    window: keys are cached unrotated and rotated by their rank in the cache.
    """

    budget: int = 256
    sinks: int = 4

    def __post_init__(self):
        super().__post_init__()
        if self.sinks < 0:
            raise InvalidInput(f"StreamingLLM: sinks={self.sinks} must be >= 0")
        if self.budget < self.sinks + 1:
            raise InvalidInput(
                f"StreamingLLM: budget={self.budget} is smaller than sinks + 1 = {self.sinks + 1} "
                "(the window must hold at least the current token)"
            )

    def _sinks(self):
        return self.sinks

    def _layout(self, max_len):
        # A budget larger than the sequence never evicts: don't allocate the unused slots.
        return self.sinks, min(self.budget, max_len)
