"""Decode-time re-compression: a prompt compressor applied again every `every` generated tokens, so long
outputs (reasoning traces) stay within budget + every slots. In kvpress's terms it fires like a
`PrefillDecodingPress` whose prefill and decoding targets are both the scorer's budget B (compress the prompt
to B, then return to B every N tokens), not like a `DecodingPress` alone, which leaves the prompt whole.

`Recompress(SnapKV(budget=B, observation_window=W), every=N)` compresses the prompt as SnapKV does, into a cache of
`B + N` slots, then appends generated tokens; when the cache is full it re-scores every slot with the
scorer's own rule and evicts back to the scorer's keep count (B), always keeping the latest W tokens.

What "the last W queries" means while decoding: each decode attention returns its query's
probabilities over the slots (`probs`, summed over the KV group's query heads); the wrapper adds them
into each slot's `attention` state for the last W queries before the cache fills (every query for the observed
attention, whose score is all queries). Nothing is evicted between two re-compressions, so those W
queries saw exactly the slots they would in a prompt's observation window, causally. The scorer
then ranks the slots in position order (its pooling runs over neighbours in time), as it ranks a
prompt. Its group aggregation is not the scorer's: decode attention hands over each slot's probability
summed over the group's query heads, so the scorer pools that sum, where SnapKV on a prompt pools each
head's scores and then averages them. With max-pooling over heads whose peaks sit at different slots the
two rank differently. Against kvpress's `PrefillDecodingPress(prefilling_press=P(ratio),
decoding_press=DecodingPress(P, compression_interval=N, target_size=B))`, the kept positions per layer and KV
head are equal for the scorers that read keys only (KNorm, KeyDiff; `tests/test_kvpress.py`); no parity is
claimed for the attention-based scorers, whose group aggregation differs as said.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as kvcache
from kvjax.cache import LayerCache
from kvjax.errors import InvalidInput
from kvjax.policies.base import ChunkRule, Policy, check_numbers
from kvjax.policies.scored import ScoredPolicy
from kvjax.stats import AttentionStats, RuleStats, StatsRequest


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recompress(Policy, ChunkRule):
    """`scorer` compresses the prompt, then re-scores the cache and evicts back to its budget every `every`
    generated tokens (the module docstring says how, and where it differs from kvpress)."""

    scorer: ScoredPolicy
    every: int

    def __post_init__(self):
        check_numbers(self)
        if not isinstance(self.scorer, ScoredPolicy):
            raise InvalidInput(f"Recompress: scorer={self.scorer.describe()} is not a prompt compressor (SnapKV, "
                               "PyramidKV, SlimKV, TOVA, KNorm, ObservedAttention)")
        if self.scorer.budget is None:
            raise InvalidInput("Recompress: the scorer needs a token budget (budget=B), which decoding returns to; "
                               "a ratio is a share of a prompt")
        if self.every < 1:
            raise InvalidInput(f"Recompress: every={self.every} must be >= 1")
        if self.every < self.scorer.observation_window:
            raise InvalidInput(f"Recompress: every={self.every} is shorter than the scorer's observation_window="
                               f"{self.scorer.observation_window}: the scorer's last queries are the last ones "
                               "before a re-compression")

    evicts_while_decoding = True

    @property
    def cache_state(self):
        # the scorer's own state, and each slot's attention summed over the counted decode queries
        return {**self.scorer.cache_state, "attention": kvcache.SLOT}

    @property
    def prefill_mode(self):
        return self.scorer.prefill_mode

    @property
    def chunk(self):
        return self.scorer.chunk

    def describe(self) -> str:
        return f"Recompress(scorer={self.scorer.describe()}, every={self.every})"

    def position_mode(self, layer):
        return self.scorer.position_mode(layer)

    def check(self, num_layers, num_kv_heads=None):
        self.scorer.check(num_layers, num_kv_heads)

    def _kept(self, layer: int, max_len: int) -> int:
        return int(np.max(self.scorer.keep_count(layer, np.arange(1, max_len + 1))))

    def capacity(self, layer, max_len, prompt_len=0):
        return min(max_len, self._kept(layer, max_len) + self.every)

    # The prompt: the scorer's own compression (whole, or chunked), into the larger cache.
    def stats(self, layer):
        # the prompt: the scorer's request; decoding accumulates the counted queries' attention
        return RuleStats(prefill=self.scorer.stats(layer).prefill, decode=StatsRequest(probs=True))

    def prefill(self, layer, cache, k, v, ctx, stats):
        return self.scorer.prefill(layer, cache, k, v, ctx, stats)

    def absorb(self, layer, cache, k, v, ctx, stats):
        return self.scorer.absorb(layer, cache, k, v, ctx, stats)

    # Decoding: append, accumulate the counted queries' attention, re-compress when full.
    def step(self, layer, cache: LayerCache, k, v, ctx) -> LayerCache:
        pos = ctx.pos
        return kvcache.append(cache, k, v, pos)  # a re-compression always leaves `every` free slots

    def _counted_queries(self, layer) -> int | None:
        """How many decode queries before a re-compression have their attention counted (the scorer's
        observation window); None: all of them (the observed attention)."""
        wanted = self.scorer.stats(layer).prefill
        return None if wanted.colsum else self.scorer.observation_window

    def observe(self, layer, cache: LayerCache, ctx, stats) -> LayerCache:
        pos = ctx.pos
        free = jnp.sum(cache.pos == kvcache.EMPTY, axis=-1, keepdims=True)  # [b, kvh, 1], after the append
        counted = self._counted_queries(layer)
        counts = (pos >= 0)[:, None, None] & (cache.pos >= 0) & (True if counted is None else free < counted)
        cache = kvcache.with_state(cache, attention=cache.state["attention"] + jnp.where(counts, stats.probs, 0.0))
        full = (free == 0) & (pos >= 0)[:, None, None]
        # The sort runs only on the steps where some row filled up (one in `every`), not on every step.
        return jax.lax.cond(jnp.any(full), lambda c: kvcache.select(full, self._recompress(layer, c, pos), c),
                            lambda c: c, cache)

    def _recompress(self, layer, cache: LayerCache, pos) -> LayerCache:
        order = jnp.argsort(jnp.where(cache.pos >= 0, cache.pos, jnp.iinfo(jnp.int32).max), axis=-1)
        c = kvcache.take_slots(cache, order)  # position order, empty slots last
        real = c.pos >= 0
        acc = c.state["attention"][:, :, None, None, :]  # as one query head's one last query: [b, kvh, 1, 1, C]
        stats = AttentionStats(colsum=acc[:, :, :, 0], last_probs={self.scorer.observation_window: acc, 1: acc})
        score = self.scorer.score(layer, c.k, c.v, c.pos, stats)
        latest = real & (c.pos > (pos - self.scorer.observation_window)[:, None, None])  # always kept
        length = (pos + 1)[:, None, None]
        keep = kvcache.keep_top(score, real, latest, self.scorer.keep_count(layer, length))
        kept = kvcache.take_slots(c, kvcache.compact(keep, cache.capacity))
        return kvcache.with_state(kept, attention=0.0)  # the next count starts afresh
