"""AnLLM's anchor-based inference (Algorithm 1): keep the anchors and the current sequence.

REDUCTION(C) keeps `{c in C | index(c) >= j or c is anchor}`, `j` the last anchor:
after the prompt and whenever an anchor is generated, every non-anchor token of
the finished sequences is dropped. The prompt is attended with eq. 4
(`prompt_mask`), and a generated anchor attends only its own sequence, so the
cache never drops anything the mask did not already hide.

Static layout per layer: `anchor_slots` slots for anchor tokens (oldest overwritten
when full), `sequence` slots for the current sequence (oldest non-anchor dropped
when full), and `span` slots for the "keep source" mode (paper §6.2: one span of
the prompt, e.g. the source sentence, kept whole and visible to every later token).
The cache's per-slot state `anchor` marks the newest token of the sequence region as an anchor (1.0)
between `step` and `observe`.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvjax import cache as kvcache
from kvjax.anllm_anchors import anchor_flags, anchor_mask
from kvjax.cache import LayerCache
from kvjax.errors import InvalidInput
from kvjax.policies.base import ChunkRule, LayerPolicy, PromptMasking, ReadsTokens

_HIDE = -1e30  # log_w of slots an anchor query must not see (earlier anchors)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AnchorReduction(LayerPolicy, ChunkRule, PromptMasking, ReadsTokens):
    """Algorithm 1 with capacities: `anchor_slots` anchor slots, `sequence` current-sequence slots and
    (keep source) the positions `span = (start, end)` of the prompt kept whole."""

    anchor_ids: tuple[int, ...]
    anchor_slots: int = 256
    sequence: int = 256
    span: tuple[int, int] | None = None

    cache_state = {"anchor": kvcache.SLOT}  # 1.0 on a just-written anchor token, until `observe` moves it

    def __post_init__(self):
        super().__post_init__()
        if not self.anchor_ids:
            raise InvalidInput("AnchorReduction: anchor_ids is empty")
        if self.anchor_slots < 1 or self.sequence < 1:
            raise InvalidInput(f"AnchorReduction: anchor_slots={self.anchor_slots} and sequence={self.sequence} must be >= 1")
        if self.span is not None and not 0 <= self.span[0] < self.span[1]:
            raise InvalidInput(f"AnchorReduction: span={self.span} must be (start, end) with 0 <= start < end")
        if self.positions != "absolute":
            raise InvalidInput("AnchorReduction: positions must be 'absolute' (eq. 4 keeps true positions)")
        if self.chunk is not None and self.chunk > self.sequence:
            raise InvalidInput(f"AnchorReduction: chunk={self.chunk} exceeds sequence={self.sequence}: a chunk's "
                               "tokens pass through the current-sequence slots")

    def _span_len(self) -> int:
        return 0 if self.span is None else self.span[1] - self.span[0]

    def capacity(self, layer, max_len, prompt_len=0):
        return self.anchor_slots + self.sequence + self._span_len()

    def _in_span(self, pos):
        if self.span is None:
            return jnp.zeros(pos.shape, bool)
        return (pos >= self.span[0]) & (pos < self.span[1])

    def prompt_mask(self, ctx):
        tokens, pos = ctx.tokens, ctx.pos
        valid = pos >= 0
        return anchor_mask(anchor_flags(tokens, self.anchor_ids), valid, self._in_span(pos) & valid)

    def prefix_visible(self, layer, cache: LayerCache, anchor_mask):
        """Eq. 4 across the cache/chunk boundary. Chunk tokens before the chunk's first anchor
        (segment 0) continue the cache's current sequence and see it; later ones see only the
        cached anchors. An anchor never sees earlier anchors; the kept span is seen by all."""
        slots = jnp.arange(cache.capacity)
        anchor_slot = slots < self.anchor_slots
        span_slot = slots >= self.anchor_slots + self.sequence
        seen = jnp.where(anchor_slot, ~anchor_mask.anchor[:, :, None], anchor_mask.segment[:, :, None] == 0) | span_slot
        b, t, c = seen.shape
        return jnp.broadcast_to(seen[:, None], (b, cache.k.shape[1], t, c))

    def prefill(self, layer, cache: LayerCache, k, v, ctx, stats) -> LayerCache:
        pos, tokens = ctx.pos, ctx.tokens
        b, kvh, t, _ = k.shape
        valid = pos >= 0
        anchor = anchor_flags(tokens, self.anchor_ids) & valid
        span = self._in_span(pos) & valid  # anchors inside the span live there: visible to every query
        idx = jnp.arange(t)
        last = jnp.max(jnp.where(anchor, idx, -1), axis=1)  # last anchor's time index, -1 if none
        current = valid & ~anchor & ~span & (idx[None] > last[:, None])
        anchor = anchor & ~span
        # REDUCTION: each region takes its newest tokens if it overflows.
        src = jnp.concatenate(
            [_newest(anchor, self.anchor_slots), _newest(current, self.sequence), _newest(span, self._span_len())], axis=1
        )
        return kvcache.gather_prompt(cache, k, v, pos, jnp.broadcast_to(src[:, None], (b, kvh, src.shape[1])))

    # Chunked: the chunk follows eq. 4 within itself and against the cache (`prefix_visible`, as
    # `kvjax.drive.extend`), after the oldest current-sequence tokens it displaces are dropped (as `step`
    # drops one before a token attends); then REDUCTION runs over cache ∪ chunk. At chunk 1 this is
    # `step` + `observe` exactly.
    def chunk_visible(self, layer, cache: LayerCache, ctx):
        mask = self.prompt_mask(ctx)
        return self.prefix_visible(layer, cache, mask), mask.visible()

    def make_room(self, layer, cache: LayerCache, ctx) -> LayerCache:
        pos = ctx.pos
        a, s = self.anchor_slots, self.sequence
        slots = jnp.arange(cache.capacity)
        seq = (slots >= a) & (slots < a + s) & (cache.pos >= 0)
        arriving = jnp.sum((pos >= 0) & ~self._in_span(pos), axis=1)[:, None, None]  # through the sequence slots
        need = arriving - (s - jnp.sum(seq, axis=-1, keepdims=True))
        rank = jnp.argsort(jnp.argsort(jnp.where(seq, cache.pos, jnp.iinfo(jnp.int32).max), axis=-1), axis=-1)
        drop = seq & (rank < need)  # the oldest of the current sequence
        return kvcache.take_slots(cache, jnp.where(drop, -1, slots))

    def absorb(self, layer, cache: LayerCache, k, v, ctx, stats) -> LayerCache:
        pos, tokens = ctx.pos, ctx.tokens
        a, s = self.anchor_slots, self.sequence
        n = k.shape[2]
        both = kvcache.chunk_slots(cache, k, v, pos)
        slots = jnp.arange(cache.capacity)
        valid = pos >= 0
        span = self._in_span(pos) & valid
        anchor = anchor_flags(tokens, self.anchor_ids) & valid & ~span
        last = jnp.max(jnp.where(anchor, jnp.arange(n), -1), axis=1)[:, None]  # the chunk's last anchor, -1 if none
        cached = lambda region: jnp.broadcast_to(region & (cache.pos >= 0), cache.pos.shape)  # noqa: E731
        joined = lambda in_cache, in_chunk: jnp.concatenate(  # noqa: E731
            [in_cache, jnp.broadcast_to(in_chunk[:, None], both.pos.shape[:2] + (n,))], axis=-1)
        anchors = joined(cached(slots < a), anchor)
        current = joined(cached((slots >= a) & (slots < a + s)) & (last < 0)[:, :, None],
                         valid & ~anchor & ~span & (jnp.arange(n) > last))
        kept_span = joined(cached(slots >= a + s), span)
        src = jnp.concatenate([_newest(anchors, a), _newest(current, s), _newest(kept_span, self._span_len())], axis=-1)
        out = kvcache.take_slots(both, src)
        return kvcache.with_state(dataclasses.replace(out, log_w=jnp.zeros_like(out.log_w)), anchor=0.0)

    def step(self, layer, cache: LayerCache, k, v, ctx) -> LayerCache:
        pos, tokens = ctx.pos, ctx.tokens
        a, s = self.anchor_slots, self.sequence
        slots = jnp.arange(cache.capacity)
        seq = (slots >= a) & (slots < a + s)
        seq_pos = jnp.where(seq, cache.pos, jnp.iinfo(jnp.int32).max)
        empty = seq & (cache.pos < 0)
        slot = jnp.where(jnp.any(empty, -1), jnp.argmax(empty, -1), jnp.argmin(seq_pos, -1))
        is_anchor = anchor_flags(tokens, self.anchor_ids)  # [b]
        cache = kvcache.write(cache, slot, k, v, pos, {"anchor": jnp.where(is_anchor, 1.0, 0.0)[:, None]})
        # An anchor attends only its own sequence (eq. 4): hide the anchor slots for this query.
        hide = is_anchor[:, None, None] & (slots < a)
        return dataclasses.replace(cache, log_w=jnp.where(hide, _HIDE, 0.0).astype(cache.log_w.dtype))

    def observe(self, layer, cache: LayerCache, ctx, stats) -> LayerCache:
        """After an anchor was processed, REDUCTION: it moves to the anchor slots, the sequence empties."""
        pos = ctx.pos
        a, s = self.anchor_slots, self.sequence
        slots = jnp.arange(cache.capacity)
        seq = (slots >= a) & (slots < a + s)
        newest = jnp.argmax(jnp.where(seq, cache.pos, -1), axis=-1)  # [b, kvh]
        take = lambda x: jnp.take_along_axis(x, newest[..., None] if x.ndim == 3 else newest[..., None, None], axis=2)
        reduce = (take(cache.state["anchor"])[..., 0] > 0) & (pos[:, None] >= 0)  # [b, kvh]
        anchor_slots = slots < a
        anchor_pos = jnp.where(anchor_slots, cache.pos, -1)
        empty = anchor_slots & (cache.pos < 0)
        oldest = jnp.argmin(jnp.where(anchor_pos < 0, jnp.iinfo(jnp.int32).max, anchor_pos), axis=-1)
        dest = jnp.where(jnp.any(empty, -1), jnp.argmax(empty, -1), oldest)
        moved = kvcache.write(cache, dest, take(cache.k)[:, :, 0], take(cache.v)[:, :, 0],
                              jnp.where(jnp.any(reduce, -1), pos, -1))
        cleared = kvcache.with_state(dataclasses.replace(moved, pos=jnp.where(seq, kvcache.EMPTY, moved.pos)),
                                     anchor=jnp.where(seq, 0.0, moved.state["anchor"]))
        out = kvcache.select(reduce[..., None], cleared, cache)
        return kvcache.with_state(dataclasses.replace(out, log_w=jnp.zeros_like(out.log_w)), anchor=0.0)


def _newest(mask, n: int):
    """Indices `[..., n]` of the `n` newest (last) True entries of `mask` `[..., t]`, in order, -1 padded."""
    if n == 0:
        return jnp.zeros(mask.shape[:-1] + (0,), jnp.int32)
    # Rank from the end so an overflow drops the oldest; compact keeps the order.
    from_end = jnp.cumsum(mask[..., ::-1], axis=-1)[..., ::-1]
    keep = mask & (from_end <= n)
    return kvcache.compact(keep.reshape(keep.shape[0], -1, keep.shape[-1]), n).reshape(mask.shape[:-1] + (n,))
