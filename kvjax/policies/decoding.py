"""Decode-time compression by any scorer: kvpress's `DecodingPress` and `PrefillDecodingPress`, holding real bytes.

`Decoding(scorer=KNorm(budget=B), every=N)` leaves the prompt whole (kvpress's `DecodingPress`), appends the
generated tokens, and every `N` decode steps ranks every slot the cache holds (the prompt's and the generated ones)
by the scorer's rule and keeps the scorer's budget `B` (`target_size`). `prompt=SnapKV(budget=P)` compresses the
prompt first (kvpress's `PrefillDecodingPress(prefilling_press=..., decoding_press=DecodingPress(...))`);
`prompt=scorer` is the scorer returning to its own budget on the prompt and every `N` tokens after it
(`recompress(scorer, every)`, `--recompress-every N`).

When it fires (`when`): `"interval"`, after every `N` decode steps counted per row since the last compression (the
current token included, after its attention: kvpress's `compression_interval`); `"full"`, when the cache holds
`B + N` tokens (TriAttention's slack trigger, R-KV's buffer). Either way the cache is `max(prompt held, B) + N`
slots (`"full"`: `max(prompt held + 1, B + N)`), never the growing sequence: that is the memory it holds.

What "the last W queries" means while decoding (the scorer's `observation_window`, W): each decode attention hands
over its query's probabilities over the slots, summed over the KV group's query heads (`probs`); the last W queries
before a compression add them into each slot's `attention` state (every query of the interval for the observed
attention, whose score is all queries), weighted as the scorer says (`ScoredPolicy.count_query`: as they are, or
R-KV's softmax over the slots older than the window). Nothing is evicted between two compressions, so those W queries
saw exactly the slots they would in a prompt's observation window, causally. The scorer then ranks the slots in
position order (its pooling runs over neighbours in time) and the latest W tokens are always kept. Its group
aggregation is not the scorer's own: decode attention hands over the group's sum, where SnapKV on a prompt pools
each head's scores and then averages them, so with max-pooling and heads peaking at different slots the two rank
differently. Against kvpress 0.5.5 the kept positions per layer and KV head are equal for the scorers that read keys
only (KNorm, KeyDiff; `tests/test_kvpress.py`, prompt whole and prompt compressed); no parity is claimed for the
attention-based scorers, whose group aggregation differs as said.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as kvcache
from kvjax import values
from kvjax.cache import LayerCache
from kvjax.errors import InvalidInput
from kvjax.policies.base import ChunkRule, Policy, check_numbers
from kvjax.policies.options import Option
from kvjax.policies.scored import ScoredPolicy
from kvjax.stats import AttentionStats, RuleStats, StatsRequest

WHEN = ("interval", "full", "length")
DECODE_SLOTS = Option(help="decode slots beyond the budget: the cache holds at most budget + this many tokens and is "
                           "compressed back to the budget as it reaches them (R-KV's and TriAttention's "
                           "divide_length)",
                      type=values.positive_int)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Decoding(Policy, ChunkRule):
    """`scorer` ranks the cache and keeps its budget B; `prompt` compresses the prompt first (None: kept whole).
    `every` is N in `when`'s trigger: `"interval"`, every N decode steps since the last compression (kvpress);
    `"full"`, when the cache holds B + N tokens (N is slack in slots, TriAttention's); `"length"`, when the sequence
    length is a multiple of N and the cache holds at least B (R-KV's reference). The module docstring says how, and
    where it differs from kvpress."""

    scorer: ScoredPolicy
    every: int
    prompt: ScoredPolicy | None = None
    when: str = "interval"

    def __post_init__(self):
        check_numbers(self)
        for role, p in (("scorer", self.scorer), ("prompt", self.prompt)):
            if p is not None and not isinstance(p, ScoredPolicy):
                raise InvalidInput(f"Decoding: {role}={p.describe()} is not a prompt compressor (SnapKV, PyramidKV, "
                                   "SlimKV, TOVA, KNorm, KeyDiff, ObservedAttention, R-KV, TriAttention)")
        if self.scorer.budget is None:
            raise InvalidInput("Decoding: the scorer needs a token budget (budget=B), which decoding returns to; "
                               "a ratio is a share of a prompt")
        if self.when not in WHEN:
            raise InvalidInput(f"Decoding: when={self.when!r}; expected one of {WHEN}")
        if self.every < 1:
            raise InvalidInput(f"Decoding: every={self.every} must be >= 1")
        wanted = self.scorer.stats(0).prefill
        if wanted.query_moments or wanted.out_norms or wanted.hidden:
            raise InvalidInput(f"Decoding: scorer={self.scorer.describe()} reads statistics of a whole prompt (its "
                               "queries' moments, output norms or hidden states) that decoding does not hand over")
        if self.every < self.scorer.observation_window:
            raise InvalidInput(f"Decoding: every={self.every} is shorter than the scorer's observation_window="
                               f"{self.scorer.observation_window}: the scorer's last queries are the last ones "
                               "before a compression")
        if self.scorer.prefill_mode != "full" and self.prompt != self.scorer:
            raise InvalidInput("Decoding: the scorer ranks a cache, not a prompt read in chunks; give the chunked "
                               "prefill to `prompt`")
        if self.prompt is not None and self.prompt.positions != self.scorer.positions:
            raise InvalidInput(f"Decoding: the prompt's positions={self.prompt.positions!r} and the scorer's "
                               f"{self.scorer.positions!r} differ; one cache holds both")

    evicts_while_decoding = True

    def target(self, layer: int, max_len: int) -> int:
        """The most slots a compression keeps in `layer` (the scorer's budget; PyramidKV's per layer)."""
        return int(np.max(self.scorer.keep_count(layer, np.arange(1, max_len + 1))))

    @property
    def cache_state(self):
        # the rules' own state, each slot's attention from the counted decode queries, the steps since a compression
        return {**(self.prompt.cache_state if self.prompt else {}), **self.scorer.cache_state,
                "attention": kvcache.SLOT, "steps": kvcache.HEAD}

    @property
    def prefill_mode(self):
        return self.prompt.prefill_mode if self.prompt is not None else "full"

    @property
    def chunk(self):
        return self.prompt.chunk if self.prompt is not None else None

    def describe(self) -> str:
        prompt = "whole" if self.prompt is None else ("scorer" if self.prompt == self.scorer else
                                                      self.prompt.describe())
        return f"Decoding(scorer={self.scorer.describe()}, every={self.every}, prompt={prompt}, when={self.when!r})"

    def position_mode(self, layer):
        return self.scorer.position_mode(layer)

    def check(self, num_layers, num_kv_heads=None):
        self.scorer.check(num_layers, num_kv_heads)
        if self.prompt is not None:
            self.prompt.check(num_layers, num_kv_heads)

    def capacity(self, layer, max_len, prompt_len=0):
        if self.prompt is None:
            held = prompt_len
        else:
            held = int(np.max(self.prompt.keep_count(layer, np.arange(1, prompt_len + 1)))) if prompt_len else 0
        target = self.target(layer, max_len)
        if self.when == "full":
            return min(max_len, max(held + 1, target + self.every))
        return min(max_len, max(held, target) + self.every)

    # The prompt: kept whole, or the prompt policy's compression (whole, or chunked), into the larger cache.
    def stats(self, layer):
        prefill = self.prompt.stats(layer).prefill if self.prompt is not None else StatsRequest()
        return RuleStats(prefill=prefill, decode=StatsRequest(probs=True))

    def prefill(self, layer, cache, k, v, ctx, stats):
        room = 1 if self.when == "full" else self.every
        if self.prompt is None and k.shape[2] + room > cache.capacity:  # a plan sized for a shorter prompt
            raise InvalidInput(f"Decoding: a prompt of {k.shape[2]} tokens (padded) in {cache.capacity} slots; it is "
                               f"kept whole, so the plan must be sized for it (Plan.sized(max_len, prompt_len))")
        if self.prompt is not None:
            return self.prompt.prefill(layer, cache, k, v, ctx, stats)
        real = jnp.broadcast_to(ctx.pos[:, None, :] >= 0, k.shape[:3])
        return kvcache.gather_prompt(cache, k, v, ctx.pos, kvcache.compact(real, cache.capacity))

    def absorb(self, layer, cache, k, v, ctx, stats):
        return self.prompt.absorb(layer, cache, k, v, ctx, stats)  # chunked: only with a prompt policy

    # Decoding: append, count the step and the counted queries' attention, compress when due.
    def step(self, layer, cache: LayerCache, k, v, ctx) -> LayerCache:
        cache = kvcache.append(cache, k, v, ctx.pos)  # a compression always leaves `every` free slots
        return kvcache.with_state(cache, steps=cache.state["steps"] + (ctx.pos >= 0)[:, None])

    def _left(self, layer, cache: LayerCache, pos):
        """`[b, kvh, 1]`: decode steps left before the next compression, this one's token appended."""
        if self.when == "full":
            held = jnp.sum(cache.pos >= 0, axis=-1, keepdims=True)
            return jnp.maximum(self._keeps(layer, pos) + self.every - held, 0)
        if self.when == "length":
            return (-pos[:, None, None]) % self.every  # the current token's position is a multiple of N
        return jnp.maximum(self.every - cache.state["steps"][..., None].astype(jnp.int32), 0)

    def _keeps(self, layer, pos):
        """`[b, 1, 1]`: what a compression keeps now (the scorer's budget; PyramidKV's per layer and length)."""
        return self.scorer.keep_count(layer, (pos + 1)[:, None, None])

    def _counted(self, layer) -> int | None:
        """How many decode queries before a compression have their attention counted (the scorer's observation
        window); None: all of them (the observed attention)."""
        return None if self.scorer.stats(layer).prefill.colsum else self.scorer.observation_window

    def observe(self, layer, cache: LayerCache, ctx, stats) -> LayerCache:
        pos = ctx.pos
        left = self._left(layer, cache, pos)
        live = (pos >= 0)[:, None, None]
        counted = self._counted(layer)
        at = (pos[:, None, None] + left)  # the position the next compression happens at
        past = (cache.pos >= 0) & (cache.pos <= at - self.scorer.observation_window)  # what the window will not hold
        add = self.scorer.count_query(stats.probs, cache.pos >= 0, past)
        counts = live & (cache.pos >= 0) & (True if counted is None else left < counted)
        cache = kvcache.with_state(cache, attention=cache.state["attention"] + jnp.where(counts, add, 0.0))
        due = (left == 0) & live
        if self.when == "length":  # the reference compresses a cache that holds at least its budget
            due &= jnp.sum(cache.pos >= 0, axis=-1, keepdims=True) >= self._keeps(layer, pos)
        # The ranking runs only on the steps where some row is due (one in `every`), not on every step.
        return jax.lax.cond(jnp.any(due), lambda c: kvcache.select(due, self._compress(layer, c, pos), c),
                            lambda c: c, cache)

    def _compress(self, layer, cache: LayerCache, pos) -> LayerCache:
        order = jnp.argsort(jnp.where(cache.pos >= 0, cache.pos, jnp.iinfo(jnp.int32).max), axis=-1)
        c = kvcache.take_slots(cache, order)  # position order, empty slots last
        real = c.pos >= 0
        w = self.scorer.observation_window
        acc = c.state["attention"][:, :, None, None, :]  # as one query head's one last query: [b, kvh, 1, 1, C]
        stats = AttentionStats(colsum=acc[:, :, :, 0], last_probs={w: acc, 1: acc} if w else {1: acc})
        score = self.scorer.score(layer, c.k, c.v, c.pos, stats)
        latest = real & (c.pos > (pos - w)[:, None, None])  # always kept
        keep = kvcache.keep_top(score, real, latest, self._keeps(layer, pos))
        kept = kvcache.take_slots(c, kvcache.compact(keep, cache.capacity))
        return kvcache.with_state(kept, attention=0.0, steps=0.0)  # the next count starts afresh


def recompress(scorer: ScoredPolicy, every: int) -> Decoding:
    """The scorer compressing the prompt to its budget and returning to it every `every` decode steps (kvpress's
    `PrefillDecodingPress` with both targets at the budget; `--recompress-every N`)."""
    return Decoding(scorer=scorer, every=every, prompt=scorer)
