"""R-KV (Cai et al. 2025, arXiv:2505.24133): redundancy-aware eviction while decoding, for reasoning traces.

Each key's score is `lambda * importance - (1 - lambda) * redundancy` (the reference code's `R1KV`, read at
Zefan-Cai/R-KV `rkv/compression/r1_kv.py` and `rkv/utils.py`):

* importance: the last `observation_window` (w) queries' attention over the keys older than the window, a softmax
  over those keys alone, averaged over the w queries and max-pooled over `kernel` neighbouring positions (edges
  see only the neighbours that exist);
* redundancy: the cosine similarity of every pair of the cache's keys (the window's included), the diagonal zeroed;
  for each key i, its similarity to the latest key j with similarity above `threshold` (0.5) is zeroed too (to the
  first key when none is: the reference's index 0), so the latest of near-duplicates is the least redundant; each
  key's redundancy is its column's mean over the L keys, then a softmax over the L keys.

The w latest tokens are always kept, then the `budget - w` best scores per KV head. The prompt is compressed the same
way when it is longer than the budget; while decoding, the cache is compressed back to the budget whenever the
sequence's length is a multiple of `decode_slots` (the reference's `divide_length`, 128) and it holds at least the
budget (`Decoding(when="length")`: the reference's `modeling.py` with `divide_method="step_length"`), so it never
holds more than `budget + decode_slots` tokens. `mix_lambda` is 0.07, the reference's `R1KV` default (its newer
serving scripts pass 0.1).

Where kvjax differs from the reference: the KV group's query heads. The reference takes the max of the group's
logits before the softmax; kvjax's attention hands a rule each query's probabilities summed over the group (the
decode statistic every method shares), so importance is that sum's softmax over the older keys. For one query head
per KV head (MHA) the two are the same (`tests/test_rkv.py` checks a transcription of the reference's formula).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax import values
from kvjax.errors import InvalidInput
from kvjax.policies.base import observation_window_option
from kvjax.policies.decoding import DECODE_SLOTS, Decoding
from kvjax.policies.options import class_builder, given, option, register
from kvjax.policies.scored import ScoredPolicy, pool1d
from kvjax.stats import RuleStats, StatsRequest


@dataclasses.dataclass(frozen=True, kw_only=True)
class RKV(ScoredPolicy):
    """R-KV's score (the module docstring): importance from the last `observation_window` queries, redundancy from
    the keys' cosine similarities, mixed by `mix_lambda`. `rkv(budget)` runs it while decoding."""

    observation_window: int = observation_window_option(8)
    kernel: int = option(7, type=values.odd_positive_int, help="pooling kernel over positions, odd (kvpress: 5)")
    mix_lambda: float = option(0.07, type=values.probability,
                               help="R-KV: the weight of importance against redundancy (the reference's mix_lambda)")
    threshold: float = 0.5  # the reference's similarity above which a later key is a key's duplicate (hard-coded)
    chunk_refusal = "its redundancy compares every pair of the cache's keys, a whole prompt's"

    def __post_init__(self):
        if self.prefill_mode == "chunked":
            raise InvalidInput(f"RKV cannot run prefill_mode='chunked': {self.chunk_refusal}")
        if self.positions != "absolute":
            raise InvalidInput("RKV: positions must be 'absolute': its similarities are of keys after RoPE, as cached")
        super().__post_init__()

    def stats(self, layer):
        return RuleStats(prefill=StatsRequest.last(self.observation_window))

    def count_query(self, probs, real, past):
        # a decode query's softmax over the keys older than the window, as the reference's importance reads it
        x = jnp.where(past, probs, 0.0)
        return x / jnp.maximum(jnp.sum(x, axis=-1, keepdims=True), 1e-30)

    def score(self, layer, k, v, pos, stats):
        p = pos if pos.ndim == 3 else jnp.broadcast_to(pos[:, None, :], k.shape[:3])
        real = p >= 0
        past = real & (p <= jnp.max(p, axis=-1, keepdims=True) - self.observation_window)
        return self.mix_lambda * self.importance(stats, past) - (1 - self.mix_lambda) * self.redundancy(k, real)

    def importance(self, stats, past):
        """`[b, kvh, t]`: each query's probabilities (summed over the group) renormalised over the older keys, their
        mean over the queries, max-pooled over positions among the older keys."""
        probs = stats.last(self.observation_window).sum(axis=2)  # [b, kvh, w, t]
        x = jnp.where(past[:, :, None], probs, 0.0)
        total = jnp.sum(x, axis=-1, keepdims=True)
        asked = total > 0  # a query row that saw an older key (a padded row sees none)
        x = jnp.where(asked, x / jnp.where(asked, total, 1.0), 0.0)
        mean = jnp.sum(x, axis=2) / jnp.maximum(jnp.sum(asked, axis=2), 1)
        return jnp.where(past, pool1d(jnp.where(past, mean, -jnp.inf), self.kernel, "max"), 0.0)

    def redundancy(self, k, real):
        """`[b, kvh, t]`: each key's mean cosine similarity to the others (its latest duplicate's removed), a
        softmax over the real keys."""
        k = k.astype(jnp.float32)
        unit = k / (jnp.linalg.norm(k, axis=-1, keepdims=True) + 1e-8)
        sim = jnp.einsum("bhid,bhjd->bhij", unit, unit, precision=jax.lax.Precision.HIGHEST)
        t = k.shape[2]
        pair = real[..., :, None] & real[..., None, :] & ~jnp.eye(t, dtype=bool)
        sim = jnp.where(pair, sim, 0.0)
        index = jnp.arange(t)
        first = jnp.argmax(real, axis=-1)[..., None]  # the reference's index 0: the row's first real key
        latest = jnp.max(jnp.where(sim > self.threshold, index, -1), axis=-1)  # [b, kvh, t]
        latest = jnp.where(latest < 0, first, latest)
        sim = jnp.where(index == latest[..., None], 0.0, sim)
        n = jnp.maximum(jnp.sum(real, axis=-1, keepdims=True), 1)
        red = jnp.sum(sim, axis=-2) / n
        return jax.nn.softmax(jnp.where(real, red, -jnp.inf), axis=-1)


def rkv(budget, observation_window=None, kernel=None, mix_lambda=None, decode_slots=128) -> Decoding:
    """R-KV as its reference runs it: the prompt compressed to `budget` when longer, then the cache compressed back to
    the budget whenever the length is a multiple of `decode_slots` (at most `budget + decode_slots` slots)."""
    scorer = class_builder(RKV)(budget, **given(observation_window=observation_window, kernel=kernel,
                                                mix_lambda=mix_lambda))
    return Decoding(scorer=scorer, every=decode_slots, prompt=scorer, when="length")


register("rkv", build=rkv, classes=(RKV,), options={"decode_slots": DECODE_SLOTS}, paper="Cai et al. 2025 (R-KV)",
         docs="policies/decoding.md#r-kv", chunked="refused",
         memory="real (budget + decode_slots slots while decoding)")

__all__ = ["RKV", "rkv"]
