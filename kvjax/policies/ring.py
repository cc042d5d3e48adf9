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
from kvjax.policies.base import (
    AppendsWhileDecoding,
    ChunkRule,
    KeepsEveryToken,
    LayerPolicy,
    RatioBudget,
    StepOnlyWrites,
    check_ratio,
    ratio_option,
    sinks_option,
)
from kvjax.policies.options import given, register


def ring_slot(pos: Int[Array, "..."], sinks: int, capacity: int) -> Int[Array, "..."]:
    """Slot of position `pos` in a sinks + ring layout of `capacity` slots."""
    window = capacity - sinks
    return jnp.where(pos < sinks, pos, sinks + (pos - sinks) % window)


def ring_holder(length: Int[Array, "b"], sinks: int, capacity, slots: int | None = None) -> Int[Array, "b c"]:
    """Position held by each slot after positions `0..length-1` were written, -1 if none.

    The closed form of writing a prompt token by token with `ring_slot`: a
    window slot holds the latest position that maps to it. `capacity` may be a
    per-row array `[b]` (ratio budgets) within an array of `slots` slots; slots at or
    past a row's capacity hold nothing.
    """
    slots = capacity if slots is None else slots
    capacity = jnp.asarray(capacity)[..., None] if jnp.ndim(capacity) else capacity
    window = capacity - sinks
    j = jnp.arange(slots)[None, :]
    length = length[:, None]
    sink_pos = jnp.where(j < length, j, -1)
    last = length - 1 - sinks  # offset of the newest token inside the window sequence
    q = last - jnp.mod(last - (j - sinks), window)
    win_pos = jnp.where((last >= 0) & (q >= 0) & (j < capacity), sinks + q, -1)
    return jnp.where(j < sinks, sink_pos, win_pos).astype(jnp.int32)


class RingPolicy(RatioBudget, LayerPolicy, ChunkRule, StepOnlyWrites):
    """Shared prefill/step for sinks + ring layouts; subclasses define `_layout`.

    With a `ratio` (`RatioBudget`) a row whose prompt has `n` tokens keeps `max(1, floor(n * (1 - ratio)))`
    slots (at least sinks + 1), and the ring of each row wraps at its own count."""

    def _layout(self, max_len: int) -> tuple[int, int]:
        """(sinks, capacity) for sequences of at most `max_len` tokens."""
        raise NotImplementedError

    def least_slots(self) -> int:
        return self._sinks() + 1

    def capacity(self, layer: int, max_len: int, prompt_len: int = 0) -> int:
        return self._layout(max_len)[1] if self.ratio is None else self.ratio_capacity(max_len, prompt_len)

    def prefill(self, layer, cache: LayerCache, k, v, ctx, stats) -> LayerCache:
        pos = ctx.pos
        sinks, cap = self._layout_for(cache)
        t = k.shape[2]
        length = jnp.max(pos, axis=1) + 1  # real tokens per row; prompts are left padded
        rows = cap if self.ratio is None else self.prompt_rows(cache, pos)
        held = ring_holder(length, sinks, rows, cap)  # [b, c] positions
        src = jnp.where(held >= 0, held + (t - length)[:, None], -1)  # time index of that position
        src = jnp.broadcast_to(src[:, None, :], (k.shape[0], k.shape[1], cap))
        return self.size_rows(layer, kvcache.gather_prompt(cache, k, v, pos, src), ctx)

    def step(self, layer, cache: LayerCache, k, v, ctx) -> LayerCache:
        pos = ctx.pos
        sinks, cap = self._layout_for(cache)
        # each row's own slot count: the array's, less the slots its prompt's ratio left unused
        rows = cap - jnp.sum(cache.pos == kvcache.DISABLED, axis=-1)  # [b, kvh]
        slot = ring_slot(pos[:, None], sinks, rows)
        return kvcache.write(cache, slot, k, v, pos)

    # -- chunked prefill: exactly the stream, whatever the chunk size ---------------------------
    def chunk_visible(self, layer, cache: LayerCache, ctx):
        pos = ctx.pos
        # Token p, streamed, sees the sinks and the window p - w + 1 .. p: the ring has overwritten the rest.
        sinks, cap = self._layout_for(cache)
        w = cap - sinks
        seen = lambda key, query: (key < sinks) | (key > query - w)  # noqa: E731
        return (seen(cache.pos[:, :, None, :], pos[:, None, :, None]), seen(pos[:, None, :], pos[:, :, None]))

    def rolling_sinks(self, layer, capacity):
        return self._layout_for_capacity(capacity)[0]

    def absorb(self, layer, cache: LayerCache, k, v, ctx, stats) -> LayerCache:
        pos = ctx.pos
        sinks, cap = self._layout_for(cache)
        n = k.shape[2]
        length = jnp.maximum(jnp.max(pos, axis=1), jnp.max(cache.pos, axis=(1, 2))) + 1  # [b]
        held = ring_holder(length, sinks, cap)[:, None, :]  # [b, 1, c]: the stream's ring after the chunk
        first = pos[:, -1] - (n - 1)  # the chunk's positions are first .. first + n - 1 (-1 where padded)
        idx = jnp.clip(held - first[:, None, None], 0, n - 1)
        new = (held >= 0) & (jnp.take_along_axis(pos[:, None, :], idx, axis=2) == held)  # held by a chunk token
        take = lambda x: jnp.take_along_axis(x, jnp.broadcast_to(idx, x.shape[:2] + idx.shape[2:])[..., None], 2)  # noqa: E731
        return dataclasses.replace(
            cache,
            k=jnp.where(new[..., None], take(k), cache.k).astype(cache.k.dtype),
            v=jnp.where(new[..., None], take(v), cache.v).astype(cache.v.dtype),
            pos=jnp.where(new, held, cache.pos).astype(jnp.int32),
            log_w=jnp.where(new, 0.0, cache.log_w).astype(cache.log_w.dtype),
        )

    def _layout_for(self, cache: LayerCache) -> tuple[int, int]:
        return self._layout_for_capacity(cache.capacity)

    def _layout_for_capacity(self, capacity: int) -> tuple[int, int]:
        # The capacity was fixed by `capacity(layer, max_len)`; sinks never exceed it.
        sinks = min(self._sinks(), capacity - 1) if capacity > 1 else 0
        return sinks, capacity

    def _sinks(self) -> int:
        return 0


@register("full", paper="—", docs="policies/ring.md", chunked="exact", kvpress="no press (the reference)", budget=False)
@dataclasses.dataclass(frozen=True, kw_only=True)
class FullCache(RingPolicy, KeepsEveryToken, AppendsWhileDecoding):
    """Keeps every token: capacity = the longest sequence, slot = position (free until that token is written)."""

    def _layout(self, max_len):
        return 0, max_len

    def on_sliding_window(self, window):
        # Everything a sliding-window model can still attend to: a `window`-slot ring buffer.
        return LocalWindow(size=window, positions=self.positions, prefill_mode=self.prefill_mode, chunk=self.chunk)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LocalWindow(RingPolicy):
    """Keeps the `size` most recent tokens (the current one included)."""

    size: int | None = 256
    ratio: float | None = ratio_option()

    def __post_init__(self):
        super().__post_init__()
        check_ratio(self, self.size, "size")
        if self.size is not None and self.size < 1:
            raise InvalidInput(f"LocalWindow: size={self.size} must be >= 1")

    def _layout(self, max_len):
        return 0, min(self.size, max_len)


@register("streaming", paper="Xiao et al. 2024", docs="policies/ring.md", chunked="exact")
@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamingLLM(RingPolicy):
    """StreamingLLM (Xiao et al. 2024): `sinks` initial tokens + the `budget - sinks` most recent.

    Use `positions="rolling"` for the paper's setting beyond the training
    window: keys are cached unrotated and rotated by their rank in the cache.
    """

    budget: int | None = 256
    sinks: int = sinks_option(4)
    ratio: float | None = ratio_option()

    def __post_init__(self):
        super().__post_init__()
        check_ratio(self, self.budget)
        if self.sinks < 0:
            raise InvalidInput(f"StreamingLLM: sinks={self.sinks} must be >= 0")
        if self.budget is not None and self.budget < self.sinks + 1:
            raise InvalidInput(
                f"StreamingLLM: budget={self.budget} is smaller than sinks + 1 = {self.sinks + 1} "
                "(the window must hold at least the current token)"
            )

    def _sinks(self):
        return self.sinks

    def _layout(self, max_len):
        # A budget larger than the sequence never evicts: don't allocate the unused slots.
        return self.sinks, min(self.budget, max_len)


def _local(budget, ratio=None, positions=None, prefill_mode=None, chunk=None) -> LocalWindow:
    # --ratio replaces the window's size: each row keeps floor(n * (1 - ratio)) of its n prompt tokens
    return LocalWindow(**given(size=None if ratio is not None else budget, ratio=ratio, positions=positions,
                               prefill_mode=prefill_mode, chunk=chunk))


register("local", build=_local, classes=(LocalWindow,), paper="—", docs="policies/ring.md", chunked="exact")
