"""DMS's delayed eviction (Łańcucki et al. 2025, arXiv:2506.05345, and kvpress 0.5.5's `DMSPress`): each token is
scored once, as it is written; a token scored below `threshold` is evicted once it has left the sliding window of the
`window` most recent tokens, so the window protects the tokens just written, whatever their score.

* prompt (dense prefill): the whole prompt attends as usual; then every token older than the row's last `window` is
  judged, and the kept ones are written to the cache with their scores (`state["score"]`) for later.
* `decoding=True` (DMSPress's `decoding`): each decoded token is scored as it is written; after it has attended, the
  token `window` positions back is judged (kvpress's forward hook runs after the layer's attention: a token still
  sees the pair its step releases). `decoding=False`: decoding only appends.

Evicted slots are emptied and refilled by later tokens; the cache keeps a slot for every token of the sequence, as
how much is evicted depends on the text and the threshold, not on a budget. kvpress masks evicted keys in place; what
attention sees is the same. What scores a token is the method's: KVzap's trained surrogate (`kvjax.policies.kvzap`),
or a prompt compressor's key score (`kvjax.policies.dms`, DMSPress's `press`).
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

import jax
import jax.numpy as jnp

from kvjax import cache as kvcache
from kvjax import values
from kvjax.cache import EMPTY, SLOT, LayerCache
from kvjax.errors import InvalidInput
from kvjax.policies.base import LayerPolicy, StepOnlyWrites
from kvjax.policies.options import option


@dataclasses.dataclass(frozen=True, kw_only=True)
class DelayedEviction(LayerPolicy, StepOnlyWrites):
    """Evicts each token scored below `threshold` (`token_scores`) once it is older than the `window` most recent
    tokens; `decoding`: also while decoding. See the module."""

    threshold: float = option(type=values.finite_float,
                              help="KVzap, DMS: tokens scored below this are evicted once they leave the sliding "
                                   "window (KVzap: a log KVzip+ score; DMS: its scorer's score); no default (the share "
                                   "evicted depends on it and on the text)")
    window: int = option(128, flag="--dms-window", type=values.nonnegative_int,
                         help="KVzap, DMS: the most recent tokens, never evicted (DMSPress's sliding_window_size)")
    decoding: bool = option(False, flag="--dms-decoding", const=True,
                            help="KVzap, DMS: also evict while decoding (DMSPress's decoding=True; the question of the "
                                 "question-agnostic protocol is read as decoded tokens): a different method from the "
                                 "default, which compresses the prompt only")
    cache_state = MappingProxyType({"score": SLOT})  # each slot's score, judged when it leaves the window
    evicts_while_decoding = False  # fed token by token it would judge nothing of the prompt (a stream is refused)
    chunk_refusal = ("DMS's prefill here is dense: the whole prompt attends, then its tokens are judged (a chunked "
                     "prefill would be DMS's sparse prefill, another method)")

    def __post_init__(self):
        super().__post_init__()
        name = type(self).__name__
        if self.window < 0:
            raise InvalidInput(f"{name}: window={self.window} must be >= 0")
        if self.prefill_mode != "full":
            raise InvalidInput(f"{name} cannot run prefill_mode={self.prefill_mode!r}: {self.chunk_refusal}")
        if self.positions != "absolute":
            raise InvalidInput(f"{name}: positions must be 'absolute' (its slots are judged by position)")

    def token_scores(self, layer: int, k: jax.Array, v: jax.Array, ctx) -> jax.Array:
        """`[b, kvh, t]` for a prompt's `k` `[b, kvh, t, d]`, or `[b, kvh]` for a decode step's `[b, kvh, d]`."""
        raise NotImplementedError

    def capacity(self, layer, max_len, prompt_len=0):
        return max_len  # a slot for every token: evictions empty slots (see the module)

    def prefill(self, layer, cache: LayerCache, k, v, ctx, stats) -> LayerCache:
        score = self.token_scores(layer, k, v, ctx)
        pos = ctx.pos
        last = jnp.max(pos, axis=1, keepdims=True)  # [b, 1]: each row's newest position
        judged = (pos >= 0) & (pos <= last - self.window)  # left the window
        keep = (pos >= 0)[:, None, :] & ~(judged[:, None, :] & (score < self.threshold))
        return kvcache.gather_prompt(cache, k, v, pos, kvcache.compact(keep, cache.capacity), state={"score": score})

    def step(self, layer, cache: LayerCache, k, v, ctx) -> LayerCache:
        if not self.decoding:
            return kvcache.append(cache, k, v, ctx.pos)
        slot = jnp.argmax(cache.pos == EMPTY, axis=-1)
        return kvcache.write(cache, slot, k, v, ctx.pos, state={"score": self.token_scores(layer, k, v, ctx)})

    def observe(self, layer, cache: LayerCache, ctx, stats) -> LayerCache:
        if not self.decoding:
            return cache
        leaving = (ctx.pos - self.window)[:, None, None]  # [b, 1, 1]: the token this step moves out of the window
        gone = (cache.pos == leaving) & (leaving >= 0) & (cache.state["score"] < self.threshold)
        return dataclasses.replace(cache, pos=jnp.where(gone, EMPTY, cache.pos))


__all__ = ["DelayedEviction"]
