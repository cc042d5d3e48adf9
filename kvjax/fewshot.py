"""Few-shot multiple choice over a cached prefix: AnLLM's Acc, L_kv, C⇓ and T⇑ (its Table 1).

The demonstrations are prefilled once under a cache policy; each test item
(query + one option per row) then extends that cache in one parallel pass
(`kvjax.drive.extend`), as in Wang et al. (2023a), whose protocol the paper follows.
The non-caching baseline recomputes demonstrations + query + option with a full
forward for every item. An option's score is the sum of its tokens' log-probs
and the prediction the highest-scoring option (lm-evaluation-harness's `acc`).

* `L_kv`: cache slots holding a demonstration token after the prefill.
* `C⇓ = 1 - L_kv / L_d`, `L_d` the demonstrations' length.
* `T⇑ = t(non-caching) / t(caching)` over the same items, the caching time including
  the one prefill of the demonstrations.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from kvjax import cache as kvcache
from kvjax import drive, engine
from kvjax.cache import Cache
from kvjax.engine import compiled
from kvjax.errors import InvalidInput, require_finite
from kvjax.generate import (
    bucket_length,
    check_policy,
    check_positions,
    pad_left,
    token_ids,
)
from kvjax.model import CachedLM
from kvjax.policies.base import Policy


@dataclasses.dataclass(frozen=True)
class Item:
    """One test input: `query` token ids, candidate continuations `options`, index of the right one."""

    query: tuple[int, ...]
    options: tuple[tuple[int, ...], ...]
    answer: int

    def __post_init__(self):
        if not self.query:
            raise InvalidInput("Item.query is empty: the first option token needs a query token to be scored from")
        if len(self.options) < 2 or any(len(o) == 0 for o in self.options):
            raise InvalidInput(f"Item needs >= 2 non-empty options, got lengths {[len(o) for o in self.options]}")
        if not 0 <= self.answer < len(self.options):
            raise InvalidInput(f"Item.answer={self.answer} is not an index into {len(self.options)} options")


def _rows(item: Item, start: int, length: int, prefix: Sequence[int] = ()):
    """Right-padded rows `prefix + query + option` (one per option), their positions from `start`
    (-1 on padding) and a mask of the option tokens."""
    n = len(item.options)
    tokens = np.zeros((n, length), np.int32)
    positions = np.full((n, length), -1, np.int32)
    scored = np.zeros((n, length), bool)
    for r, opt in enumerate(item.options):
        row = [*prefix, *item.query, *opt]
        tokens[r, : len(row)] = row
        positions[r, : len(row)] = start + np.arange(len(row))
        scored[r, len(row) - len(opt) : len(row)] = True
    return tokens, positions, scored


def _option_logprob(logits: Float[Array, "n t V"], tokens: Int[Array, "n t"], scored) -> Float[Array, "n"]:
    """Sum over the option tokens of `log p(token | everything before it)`."""
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    tok = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return jnp.sum(jnp.where(scored[:, 1:], tok, 0.0), axis=-1)


@compiled(static=("plan",))
def _cached_scores(model, cache, tokens, positions, scored, *, plan):
    rows = jax.tree.map(lambda x: jnp.repeat(x, tokens.shape[0], axis=0), cache)
    return _option_logprob(drive.extend(model, tokens, positions, rows, plan), tokens, scored)


@compiled()
def _full_scores(model, tokens, positions, scored):
    logits = drive.logits(model, tokens, positions)  # padding: position -1, never seen
    return _option_logprob(logits, tokens, scored)


def room_for(items: Sequence[Item]) -> int:
    """Cache slots an extension by any of `items` (query + longest option) needs."""
    return max(len(it.query) + max(map(len, it.options)) for it in items)


def prefix_cache(model: CachedLM, demos: Sequence[int], policy: Policy, room: int) -> Cache:
    """The demonstrations prefilled under `policy`, with capacity for `room` more tokens."""
    if not demos:
        raise InvalidInput("no demonstration tokens to cache")
    check_policy(policy)
    demos = token_ids(demos, model.cfg.vocab_size, "context")
    plan = drive.plan(model, policy)
    check_positions(plan, model.cfg, len(demos) + room, "a context and its longest continuation")
    bucket = bucket_length(len(demos))
    tokens, positions = pad_left([list(demos)], bucket, 0)
    return engine.prefill(model, jnp.asarray(tokens), jnp.asarray(positions), plan=plan.sized(bucket + room, bucket))[1]


def cached_scores(model: CachedLM, cache: Cache, n_demos: int, item: Item, policy: Policy) -> np.ndarray:
    """Option log-probs `[n_options]` given the cached demonstrations (the cache is not changed)."""
    length = bucket_length(len(item.query) + max(map(len, item.options)))
    tokens, positions, scored = _rows(item, n_demos, length)
    scores = np.asarray(_cached_scores(model, cache, tokens, positions, scored, plan=drive.plan(model, policy)))
    return require_finite(scores, "option log-probabilities (row = option)")


def full_scores(model: CachedLM, demos: Sequence[int], item: Item) -> np.ndarray:
    """Option log-probs `[n_options]` from a full causal forward over demonstrations + query + option."""
    demos = token_ids(demos, model.cfg.vocab_size, "context")
    if len(demos) + room_for([item]) > model.cfg.max_position_embeddings:
        raise InvalidInput(f"a context and its longest continuation of {len(demos) + room_for([item])} tokens would be "
                           f"read past the model's max_position_embeddings={model.cfg.max_position_embeddings}")
    length = bucket_length(len(demos) + len(item.query) + max(map(len, item.options)))
    tokens, positions, scored = _rows(item, 0, length, demos)
    scores = np.asarray(_full_scores(model, tokens, positions, scored))
    return require_finite(scores, "option log-probabilities (row = option)")


def cache_length(cache: Cache) -> int:
    """L_kv: the most slots holding a token in any layer and KV head (row 0)."""
    return max(int(np.max(np.sum(p[0] >= 0, axis=-1))) for p in kvcache.kept_positions(cache))


@dataclasses.dataclass(frozen=True)
class Timing:
    non_caching_s: float
    caching_s: float  # prefill of the demonstrations + every item's extension

    @property
    def speedup(self) -> float:
        return self.non_caching_s / self.caching_s


def time_caching(model: CachedLM, demos: Sequence[int], items: Sequence[Item], policy: Policy,
                 repeats: int = 3) -> Timing:
    """T⇑'s two times, best of `repeats`, each path compiled (run once) before it is timed."""
    room = room_for(items)

    def non_caching():
        for it in items:
            full_scores(model, demos, it)

    def caching():
        cache = prefix_cache(model, demos, policy, room)
        for it in items:
            cached_scores(model, cache, len(demos), it, policy)

    def best(fn):
        fn()  # compile every shape first
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    return Timing(non_caching_s=best(non_caching), caching_s=best(caching))
