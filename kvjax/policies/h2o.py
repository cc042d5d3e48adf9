"""H2O (Zhang et al. 2023): heavy hitters + a recent window, evicted while decoding.

Every cached token accumulates the attention it receives, from the statistics each decode
attention returns (`probs`, summed over the query heads of the KV group: nothing recomputes
attention). When a new token arrives and the cache is full, the token with the lowest
accumulated attention outside the `recent` most recent tokens is evicted (ties: the oldest).

The prompt: `prefill_mode="stream"` applies the same rule token by token from the first token
(H2O's own setting); `"full"` (default) scores the prompt once by the attention each token got
from all prompt queries (the observed attention) and keeps the `budget - recent` best plus the
recent window, with those sums as the starting scores; `"chunked"` (`chunk = n`) reads the prompt
`n` tokens at a time and is a different method from the stream for n > 1, said here and warned once:
a chunk's `n` victims are chosen together, by the decode rule on the scores at the chunk's start
(lowest score outside the recent window of the chunk's first token, ties to the oldest), and query i of
the chunk sees every slot but the first i + 1 of them (the c keys the stream gives each token); then
the chunk's attention is added to every score and the chunk takes the victims' slots. The stream
updates the scores after every token, so its victims can differ; at `chunk=1` the two are the same.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvjax import cache as kvcache
from kvjax.cache import LayerCache
from kvjax.errors import InvalidInput
from kvjax.policies.base import (
    ChunkRule,
    LayerPolicy,
    RatioBudget,
    StepOnlyWrites,
    check_ratio,
    ratio_option,
    recent_option,
    warn_chunked_method,
)
from kvjax.policies.options import register
from kvjax.stats import RuleStats, StatsRequest


@register("h2o", paper="Zhang et al. 2023", docs="policies/h2o.md", chunked="the stream at chunk 1, other method above (warned)")
@dataclasses.dataclass(frozen=True, kw_only=True)
class H2O(RatioBudget, LayerPolicy, ChunkRule, StepOnlyWrites):
    """`budget` slots per KV head, or `ratio`: the fraction of each row's prompt removed (a row of `n`
    prompt tokens keeps `max(recent + 1, floor(n (1 - ratio)))` slots, decoding included, as
    kvpress's compression ratio and the papers' "x % KV" mean); `recent` tokens are never evicted.

    `recent=None`: half of the budget, and under a ratio half of each row's own budget (the paper's
    equal split of heavy hitters and recent tokens), so a 60-token and a 200-token prompt at ratio 0.8
    keep 6 and 20 recent tokens, not the same count."""

    cache_state = {"mass": kvcache.SLOT}  # each slot's accumulated attention, the heavy-hitter score

    budget: int | None = None
    recent: int | None = recent_option(None)
    ratio: float | None = ratio_option()

    def __post_init__(self):
        super().__post_init__()
        if self.budget is not None and self.recent is None:
            # the paper's split, said here in terms of what the caller gave (a budget of 1 is not "budget must
            # exceed recent=1": no recent was given)
            if self.budget < 2:
                raise InvalidInput(f"H2O: budget={self.budget} must be >= 2 (half of it is the recent window, the rest "
                                   "heavy hitters)")
            object.__setattr__(self, "recent", self.budget // 2)
        if self.recent is not None and self.recent < 1:
            raise InvalidInput(f"H2O: recent={self.recent} must be >= 1 (the current token)")
        check_ratio(self, self.budget)
        if self.budget is not None and self.recent is not None and self.budget <= self.recent:
            raise InvalidInput(f"H2O: budget={self.budget} must exceed recent={self.recent} (room for heavy hitters)")
        if self.budget is not None and self.recent is None and self.budget < 2:
            raise InvalidInput(f"H2O: budget={self.budget} must be >= 2 (a recent token and a heavy hitter)")
        if self.chunk is not None and self.chunk > 1:
            warn_chunked_method(self, "a chunk's victims are chosen together by the scores at its start, where the "
                                      "stream re-scores after every token.")
        room = None if self.budget is None else self.budget - self._fixed_recent()
        if self.chunk is not None and room is not None and self.chunk > room:
            raise InvalidInput(f"H2O: chunk={self.chunk} exceeds budget - recent = {room}: a "
                               "chunk's tokens replace heavy hitters, and only those outside the recent window may go")

    def _fixed_recent(self) -> int:
        return self.recent if self.recent is not None else max(1, self.budget // 2)

    def recent_of(self, cache: LayerCache):
        """The recent window, `[b, kvh, 1]` (or a count): `recent`, or half of each row's slots (its
        budget: the slots a ratio has not disabled)."""
        if self.recent is not None or self.ratio is None:
            return self._fixed_recent()
        return jnp.maximum(1, jnp.sum(cache.pos != kvcache.DISABLED, axis=-1, keepdims=True) // 2)

    def least_slots(self) -> int:
        return (self.recent or 1) + 1

    def capacity(self, layer, max_len, prompt_len=0):
        return min(self.budget, max_len) if self.ratio is None else self.ratio_capacity(max_len, prompt_len)

    def stats(self, layer):
        return RuleStats(prefill=StatsRequest(colsum=True), decode=StatsRequest(probs=True))

    def prefill(self, layer, cache: LayerCache, k, v, ctx, stats) -> LayerCache:
        pos = ctx.pos
        acc = stats.colsum.sum(axis=2)  # [b, kvh, t]: over the group's query heads
        length = (jnp.max(pos, axis=1) + 1)[:, None, None]
        p = pos[:, None, :]
        real = p >= 0
        rows = self.budget if self.ratio is None else self.prompt_rows(cache, pos)[:, None, None]
        window = self.recent if self.recent is not None else jnp.maximum(1, rows // 2)
        recent = real & (p >= length - window)
        keep = kvcache.keep_top(acc, real, recent, jnp.minimum(length, rows))
        out = kvcache.gather_prompt(cache, k, v, pos, kvcache.compact(keep, cache.capacity), {"mass": acc})
        return self.size_rows(layer, out, ctx)

    # Chunked (`chunk = n`): the stream evicts one victim per token, each chosen by the scores the tokens
    # before it left. A chunk's queries attend in one pass, so its victims are chosen at once, by the decode
    # rule on the scores at the chunk's start (lowest score outside the recent window of the chunk's first
    # token, ties to the oldest), and displaced in that order: query i sees every slot but the victims of
    # queries 0..i, i.e. the budget's c keys as in the stream. After the chunk attends, its attention is added
    # to every score, the victims leave and the chunk takes their slots. At chunk 1 this is the stream rule;
    # at chunk n > 1 only the victims' order differs from it (scores are not updated inside a chunk).
    def _victims(self, cache: LayerCache, ctx):
        """(victim rank `[b, kvh, c]`, victims needed after each chunk token `[b, kvh, n]`)."""
        pos = ctx.pos
        real = pos >= 0
        first = jnp.max(pos, axis=1) - jnp.sum(real, axis=1) + 1  # the chunk's first real position
        free = jnp.sum(cache.pos == kvcache.EMPTY, axis=-1)  # [b, kvh]
        need = jnp.maximum(jnp.cumsum(real, axis=1)[:, None, :] - free[..., None], 0)  # [b, kvh, n]
        candidate = (cache.pos >= 0) & (cache.pos <= first[:, None, None] - self.recent_of(cache))
        # Victims in `step`'s order: the lowest score, ties going to the oldest token.
        by_pos = jnp.argsort(jnp.where(candidate, cache.pos, jnp.iinfo(jnp.int32).max), axis=-1, stable=True)
        key = jnp.take_along_axis(jnp.where(candidate, cache.state["mass"], jnp.inf), by_pos, axis=-1)
        order = jnp.take_along_axis(by_pos, jnp.argsort(key, axis=-1, stable=True), axis=-1)
        rank = jnp.where(candidate, jnp.argsort(order, axis=-1), jnp.iinfo(jnp.int32).max)
        return rank, need

    def chunk_visible(self, layer, cache: LayerCache, ctx):
        rank, need = self._victims(cache, ctx)
        return rank[:, :, None, :] >= need[..., None], None  # [b, kvh, n, c]

    def absorb(self, layer, cache: LayerCache, k, v, ctx, stats) -> LayerCache:
        pos = ctx.pos
        rank, need = self._victims(cache, ctx)
        both = kvcache.chunk_slots(cache, k, v, pos)
        both = kvcache.with_state(both, mass=both.state["mass"] + stats.colsum.sum(axis=2))
        chunk = jnp.ones(both.pos.shape[:2] + (k.shape[2],), bool)
        stay = jnp.concatenate([rank >= need[..., -1:], chunk], axis=-1) & (both.pos >= 0)
        return kvcache.take_slots(both, kvcache.compact(stay, cache.capacity))

    def step(self, layer, cache: LayerCache, k, v, ctx) -> LayerCache:
        pos = ctx.pos
        candidate = (cache.pos >= 0) & (cache.pos <= pos[:, None, None] - self.recent_of(cache))
        slot = kvcache.victim_slot(cache, cache.state["mass"], candidate, evict_highest=False)  # the lightest hitter
        return kvcache.write(cache, slot, k, v, pos)  # the new token starts at 0

    def observe(self, layer, cache: LayerCache, ctx, stats) -> LayerCache:
        pos = ctx.pos
        live = (pos >= 0)[:, None, None]  # padding steps add nothing
        add = jnp.where(live & (cache.pos >= 0), stats.probs, 0.0)
        return kvcache.with_state(cache, mass=cache.state["mass"] + add)
